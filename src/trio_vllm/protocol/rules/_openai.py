"""`OPENAI`, `COMPLETION`, `CHAT`: the OpenAI server's own request checks (vLLM's
request validators and ``TokenizeParams``), before any ``SamplingParams`` exists.

Frontend-only (``engine=False``). The subject is the decoded request: the server's
request struct, or an `OpenAIFields` of keywords in examples. `OPENAI` holds the rules
of both endpoints; `COMPLETION` and `CHAT` those of one (vLLM's ``CompletionRequest`` /
``ChatCompletionRequest`` validators); the server checks `OPENAI`, then its endpoint's.
"""

from __future__ import annotations

from typing import Any, Final

from ._core import (
    Fail,
    Family,
    Limits,
)

# ------------------------------------------------------------------- the OpenAI server


class OpenAIFields:
    """An OpenAI request's fields as the `OPENAI` rules read them: any object with
    the request's attributes (a missing one reads as ``None``); examples build one from
    keywords."""

    def __init__(self, **fields: object) -> None:
        self.__dict__.update(fields)

    def __getattr__(self, name: str) -> object:
        return None


def _field(req: object, name: str) -> Any:
    return getattr(req, name, None)


OPENAI: Final[Family[object]] = Family("openai", OpenAIFields)
"""Rules of both OpenAI generation endpoints."""
COMPLETION: Final[Family[object]] = Family("completion", OpenAIFields)
"""Rules of ``/v1/completions`` only."""
CHAT: Final[Family[object]] = Family("chat", OpenAIFields)
"""Rules of ``/v1/chat/completions`` only."""


@OPENAI.rule(
    "stream_options",
    param="stream_options",
    engine=False,
    example={"stream_options": {"include_usage": True}},
    http={"stream_options": {"include_usage": True}},
)
def _stream_options(req: object, limits: Limits) -> Fail | None:
    if _field(req, "stream_options") is not None and not _field(req, "stream"):
        return "Stream options can only be defined when `stream=True`.", None
    return None


@COMPLETION.rule(
    "logprobs", param="logprobs", engine=False, example={"logprobs": -2}, http={"logprobs": -2}
)
def _logprobs(req: object, limits: Limits) -> Fail | None:
    v = _field(req, "logprobs")
    if v is None or v >= 0 or v == -1:
        return None
    return "`logprobs` must be a positive value or -1.", v


@COMPLETION.rule(
    "prompt", param="prompt", engine=False, example={"prompt": ""}, http={"prompt": ""}
)
def _prompt_given(req: object, limits: Limits) -> Fail | None:
    prompt = _field(req, "prompt")
    if prompt is None or prompt == "" or prompt == []:
        return "Either prompt or prompt_embeds must be provided and non-empty.", None
    return None


@CHAT.rule(
    "top_logprobs",
    param="top_logprobs",
    engine=False,
    example={"top_logprobs": -2, "logprobs": True},
    http={"top_logprobs": -2, "logprobs": True},
)
def _top_logprobs(req: object, limits: Limits) -> Fail | None:
    v = _field(req, "top_logprobs")
    if v is None:
        return None
    if v < 0 and v != -1:
        return "`top_logprobs` must be a positive value or -1.", v
    if (v == -1 or v > 0) and not _field(req, "logprobs"):
        return "when using `top_logprobs`, `logprobs` must be set to true.", None
    return None


@OPENAI.rule(
    "prompt_logprobs",
    param="prompt_logprobs",
    engine=False,
    example={"prompt_logprobs": 1, "stream": True},
    http={"prompt_logprobs": 1, "stream": True},
)
def _prompt_logprobs_stream(req: object, limits: Limits) -> Fail | None:
    # vLLM's check_logprobs validator (both endpoints): no prompt logprobs on a stream
    # (0, the sampled prompt token only, is let through), and -1 means the whole vocab.
    v = _field(req, "prompt_logprobs")
    if v is None:
        return None
    if _field(req, "stream") and (v > 0 or v == -1):
        return "`prompt_logprobs` are not available when `stream=True`.", None
    if v < 0 and v != -1:
        return "`prompt_logprobs` must be a positive value or -1.", v
    return None


@OPENAI.rule(
    "max_tokens",
    param="max_tokens",
    engine=False,
    example={"max_tokens": 1000},
    http={"max_tokens": 1000},
)
def _output_len(req: object, limits: Limits) -> Fail | None:
    # vLLM's TokenizeParams: the output limit asked for (chat's max_completion_tokens
    # first), against the context.
    max_len = limits.max_model_len
    param = "max_completion_tokens"
    n = _field(req, param)
    if n is None:
        param, n = "max_tokens", _field(req, "max_tokens")
    if n is None or max_len is None or n <= max_len:
        return None
    return (
        f"{param}={n} cannot be greater than max_model_len={max_len}. Please request "
        "fewer output tokens.",
        n,
        param,
    )
