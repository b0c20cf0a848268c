"""`PROMPT` and `PROMPT_TEXT`: vLLM's prompt checks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, NamedTuple

from ._core import (
    INT_ONLY,
    Fail,
    Family,
    Limits,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

# ------------------------------------------------------------------------------ prompts


class PromptInput(NamedTuple):
    """A prompt as the input processor checks it: its ``ids`` (``None`` for embeddings
    only), its ``length``, whether it came from text (``from_text``: vLLM tokenizes
    those to at most ``max_model_len + 1`` tokens, and says so) and whether it is for
    generation (a pooling prompt may fill the whole context)."""

    ids: Sequence[int] | None
    length: int
    from_text: bool = False
    generate: bool = True


def _prompt_example(
    ids: Sequence[int] | None = None,
    length: int | None = None,
    from_text: bool = False,
    generate: bool = True,
) -> PromptInput:
    return PromptInput(ids, len(ids or ()) if length is None else length, from_text, generate)


PROMPT: Final[Family[PromptInput]] = Family("prompt", _prompt_example)
"""vLLM's prompt checks (``InputProcessor._validate_prompt_len``, the renderer's
context-length check, ``validate_token_ids``)."""

CONTEXT_SUFFIX: Final = " This model's maximum context length is {} tokens."
"""Appended to vLLM's text for a prompt of exactly ``max_model_len`` tokens, so every
too-long refusal names the context length (the contract servers rely on)."""


@PROMPT.rule("prompt", example={"ids": []}, fast="s.length > 0")
def _prompt_empty(prompt: PromptInput, limits: Limits) -> Fail | None:
    if prompt.length == 0:
        return "The decoder prompt cannot be empty", None
    return None


@PROMPT.rule(
    "prompt_token_ids",
    param="input_tokens",
    example={"ids": [5] * 300},
    http={"prompt": [5] * 300},
    fast="limits.max_model_len is None or s.length <= limits.max_model_len",
)
def _prompt_too_long(prompt: PromptInput, limits: Limits) -> Fail | None:
    max_len = limits.max_model_len
    n = prompt.length
    if max_len is None or n <= max_len:
        return None
    # vLLM tokenizes a text to at most max_model_len + 1 tokens, and says "at least".
    count = max_len + 1 if prompt.from_text else n
    qualifier = "at least " if count == max_len + 1 else ""
    return (
        f"This model's maximum context length is {max_len} tokens. However, your prompt "
        f"contains {qualifier}{count} input tokens, which exceeds this limit even without "
        "any output tokens. Please reduce the length of the input prompt.",
        count,
    )


@PROMPT.rule(
    "prompt_token_ids",
    example={"ids": [5] * 256},
    fast="limits.max_model_len is None or s.length != limits.max_model_len or not s.generate",
)
def _prompt_no_room(prompt: PromptInput, limits: Limits) -> Fail | None:
    max_len = limits.max_model_len
    n = prompt.length
    if max_len is None or n != max_len or not prompt.generate:
        return None
    return (
        f"The decoder prompt (length {n}) plus the number of requested output tokens (at "
        f"least 1) is longer than the maximum model length of {max_len}. Make sure that "
        "`max_model_len` is no smaller than the number of text tokens (prompt + requested "
        f"output tokens).{CONTEXT_SUFFIX.format(max_len)}",
        None,
    )


@PROMPT.rule("prompt_token_ids", example={"ids": [1, 2**63]}, http={"prompt": [1, 2**63]})
def _prompt_vocab(prompt: PromptInput, limits: Limits) -> Fail | None:
    ids = prompt.ids
    if not ids:
        return None
    if set(map(type, ids)) != INT_ONLY:
        bad = next(t for t in ids if type(t) is not int)
        return f"prompt_token_ids must contain only integers, got {bad!r}.", None
    lo = min(ids)
    if lo < 0:
        return f"Token id {lo} is out of vocabulary", None
    hi = max(ids)
    if hi > limits.prompt_id_bound:
        return f"Token id {hi} is out of vocabulary", None
    return None


class PromptText(NamedTuple):
    """A text prompt before tokenizing, and the tokenizer's longest piece in characters."""

    text: str
    max_chars_per_token: int


PROMPT_TEXT: Final[Family[PromptText]] = Family(
    "prompt_text",
    lambda text="y" * 100_000, max_chars_per_token=42: PromptText(text, max_chars_per_token),
)
"""vLLM's bound on a text prompt, before tokenizing (a huge text costs no tokenizer
time): ``max_model_len`` tokens of the longest vocabulary piece."""


@PROMPT_TEXT.rule(
    "prompt",
    param="input_text",
    engine=False,
    example={"text": "y" * 100_000},
    http={"prompt": "y" * 100_000},
)
def _prompt_chars(prompt: PromptText, limits: Limits) -> Fail | None:
    max_len = limits.max_model_len
    if max_len is None:
        return None
    limit = max_len * prompt.max_chars_per_token
    n = len(prompt.text)
    if n <= limit:
        return None
    return (
        f"This model's maximum context length is {max_len} tokens. However, your prompt "
        f"contains {n} characters (more than {limit} characters, which is the upper bound "
        f"for {max_len} input tokens). Please reduce the length of the input prompt.",
        n,
    )
