"""Tokenize and detokenize as vLLM's ``/tokenize`` and ``/detokenize`` do (sans-I/O).

vLLM 0.32.0 (``entrypoints/serve/tokenize``): a text prompt is encoded with
``add_special_tokens`` (default ``True``: BOS); a conversation is rendered with the chat
template (``add_generation_prompt`` default ``True``, ``continue_final_message``) and the
text encoded with ``add_special_tokens`` (default ``False``: the template brings its
own). Neither checks the length against ``max_model_len`` (vLLM passes
``max_total_tokens=None``). Detokenizing is ``tokenizer.decode(ids)`` with the special
tokens kept, as transformers' default; ``return_token_strs`` is
``convert_ids_to_tokens`` (vocabulary pieces such as ``"▁Hello"``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._exceptions import InvalidRequestError
from ._chat import render_chat_template

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from ._tokenizer import Tokenizer
    from ._types import ChatMessage

__all__ = ["detokenize", "token_strs", "tokenize", "tokenize_chat"]

_BOTH_FLAGS = (
    "continue_final_message and add_generation_prompt are not compatible. Use "
    "continue_final_message when you want the model to continue the final message, and "
    "add_generation_prompt when you want to add a header that will prompt it to start a "
    "new assistant message instead."
)


def tokenize(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """The token ids of a text prompt, as vLLM's ``/tokenize`` gives them (no length
    check). Raises `InvalidRequestError` for a non-string."""
    if not isinstance(text, str):
        raise InvalidRequestError(f"prompt must be a str, not {type(text).__name__}")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def tokenize_chat(
    tokenizer: Tokenizer,
    messages: Sequence[ChatMessage],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, object] | None = None,
    tools: Sequence[Mapping[str, object]] | None = None,
) -> tuple[str, list[int]]:
    """``(prompt text, token ids)`` of a conversation as vLLM's ``/tokenize`` gives them:
    the chat template's text, encoded with ``add_special_tokens`` (no length check).

    vLLM merges the request's ``chat_template_kwargs`` under its explicit
    ``add_generation_prompt`` / ``continue_final_message`` (``merge_kwargs``: the explicit
    fields win). Raises `InvalidRequestError` for both flags set (transformers'
    ``apply_chat_template`` message, which vLLM passes on when the request left
    ``add_generation_prompt`` at its default), a bad message, a missing template or one
    that raises."""
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError(_BOTH_FLAGS)
    kwargs = dict(chat_template_kwargs or {})
    kwargs["add_generation_prompt"] = add_generation_prompt
    kwargs["continue_final_message"] = continue_final_message
    text = render_chat_template(
        messages,
        tokenizer=tokenizer,
        chat_template=chat_template,
        tools=tools,
        chat_template_kwargs=kwargs,
    )
    return text, tokenizer.encode(text, add_special_tokens=add_special_tokens)


def detokenize(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The text of ``ids`` as vLLM's ``/detokenize`` gives it: special tokens kept."""
    return tokenizer.decode(ids, skip_special_tokens=False)


def token_strs(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str | None]:
    """The vocabulary pieces of ``ids`` (``return_token_strs``; ``None`` for an id the
    tokenizer does not know)."""
    return tokenizer.convert_ids_to_tokens(ids)
