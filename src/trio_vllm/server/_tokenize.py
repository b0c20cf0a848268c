"""``/tokenize`` and ``/detokenize``: vLLM 0.32.0's ``entrypoints/serve/tokenize``.

Bodies and answers as vLLM's pydantic models (``TokenizeCompletionRequest`` |
``TokenizeChatRequest``, ``DetokenizeRequest``; ``TokenizeResponse`` with ``count``,
``max_model_len``, ``tokens``, ``token_strs``). The work is the text layer's
(`trio_vllm.text.tokenize` ...): no engine round trip, so these never touch a request
slot, and they answer while the engine is busy, as vLLM's do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from msgspec import Struct

from .._exceptions import InvalidRequestError
from ._decode import decode_object, decode_struct, decode_value
from ._http import HTTPError
from ._openai import request_chat_template

if TYPE_CHECKING:
    from ..text import Tokenizer
    from ._frontend import TextFrontend

__all__ = [
    "DetokenizeRequest",
    "DetokenizeResponse",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "TokenizeResponse",
    "decode_detokenize_request",
    "decode_tokenize_request",
    "detokenize_response",
    "tokenize_response",
]

_INT64_MAX = 2**63 - 1


class TokenizeCompletionRequest(Struct, kw_only=True):
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(Struct, kw_only=True):
    messages: list[dict[str, Any]]
    model: str | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(Struct):
    prompt: str


_COMPLETION = msgspec.json.Decoder(TokenizeCompletionRequest, strict=False)
_CHAT = msgspec.json.Decoder(TokenizeChatRequest, strict=False)
_DETOKENIZE = msgspec.json.Decoder(DetokenizeRequest, strict=False)


def decode_tokenize_request(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The body as vLLM's union reads it: ``prompt`` makes a completion-style request,
    else ``messages`` a chat one. `HTTPError` 400 for anything else."""
    raw = decode_object(body)
    if "prompt" in raw or "messages" not in raw:
        return decode_struct(_COMPLETION, body)
    req = decode_struct(_CHAT, body)
    if decode_value(raw.get("continue_final_message", b"null")) and decode_value(
        raw.get("add_generation_prompt", b"null")
    ):
        # vLLM's model validator runs on the raw body: only both given and true get its
        # text (with add_generation_prompt left at its default True, transformers' own
        # refusal comes from tokenize_chat).
        raise HTTPError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    return req


def decode_detokenize_request(body: bytes) -> DetokenizeRequest:
    """The body as vLLM's ``DetokenizeRequest`` (ids in ``[0, 2**63 - 1]``)."""
    decode_object(body)
    req = decode_struct(_DETOKENIZE, body)
    for i, token in enumerate(req.tokens):
        if not 0 <= token <= _INT64_MAX:
            bound = (
                "greater than or equal to 0" if token < 0 else f"less than or equal to {_INT64_MAX}"
            )
            raise HTTPError(
                f"1 validation error:\n  Input should be {bound} - at `$.tokens[{i}]`",
                err_type="Bad Request",
                param="tokens",
            )
    return req


def _tokenizer(llm: TextFrontend) -> Tokenizer:
    from ..text import Tokenizer

    tokenizer = llm.tokenizer
    if not isinstance(tokenizer, Tokenizer):  # a stand-in frontend without one
        raise HTTPError("this server has no tokenizer to tokenize with", 501)
    return tokenizer


def tokenize_response(
    llm: TextFrontend,
    req: TokenizeCompletionRequest | TokenizeChatRequest,
    *,
    trust_request_chat_template: bool = False,
) -> TokenizeResponse:
    """vLLM's ``create_tokenize``: `HTTPError` 400 for a conversation the template
    refuses, or that brings its own template unless ``trust_request_chat_template``
    (the model name is the caller's to check)."""
    from ..text import token_strs, tokenize, tokenize_chat

    tokenizer = _tokenizer(llm)
    try:
        if isinstance(req, TokenizeChatRequest):
            chat_template, chat_template_kwargs = request_chat_template(
                req.chat_template, req.chat_template_kwargs, trusted=trust_request_chat_template
            )
            _, ids = tokenize_chat(
                tokenizer,
                req.messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                add_special_tokens=req.add_special_tokens,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
                tools=req.tools,
            )
        else:
            ids = tokenize(tokenizer, req.prompt, add_special_tokens=req.add_special_tokens)
    except InvalidRequestError as exc:
        raise HTTPError(str(exc), param=exc.param) from None
    strs = token_strs(tokenizer, ids) if req.return_token_strs else None
    return TokenizeResponse(len(ids), llm.max_model_len, ids, strs)


def detokenize_response(llm: TextFrontend, req: DetokenizeRequest) -> DetokenizeResponse:
    """vLLM's ``create_detokenize``: the ids' text, special tokens kept."""
    from ..text import detokenize

    return DetokenizeResponse(detokenize(_tokenizer(llm), req.tokens))
