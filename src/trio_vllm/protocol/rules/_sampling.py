"""`SAMPLING`: vLLM's ``SamplingParams._verify_args``, rule by rule."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Final

from ..structs import (
    RepetitionDetectionParams,
    SamplingParams,
)
from ._core import (
    INT64_MIN,
    MAX_N_SEQUENCES,
    SAMPLING_EPS,
    UINT64_MAX,
    Fail,
    Family,
    Limits,
    is_int,
    is_number,
    list_of,
    not_a,
    wire_int,
)

if TYPE_CHECKING:
    from collections.abc import Callable

# ---------------------------------------------------------------------- SamplingParams


def sampling_example(**fields: Any) -> SamplingParams:
    fields.setdefault("max_tokens", 16)
    fields.setdefault("temperature", 1.0)
    return SamplingParams(**fields)


SAMPLING: Final[Family[SamplingParams]] = Family("sampling", sampling_example)
"""vLLM's ``SamplingParams._verify_args`` (and the greedy check), in its order: what
vLLM refuses when a ``SamplingParams`` is made, and a stock engine's decoder again."""


@SAMPLING.rule(
    "n", example={"n": 0}, http={"n": 0}, fast="type(s.n) is int and 1 <= s.n <= MAX_N_SEQUENCES"
)
def _n(p: SamplingParams, limits: Limits) -> Fail | None:
    n = p.n
    if not is_int(n):
        return f"n must be an int, but is of type {type(n)}", None
    if n < 1:
        return f"n must be at least 1, got {n}.", None
    if n > MAX_N_SEQUENCES:
        return (
            f"n must be at most {MAX_N_SEQUENCES}, got {n}. To increase this limit, set "
            "the VLLM_MAX_N_SEQUENCES environment variable.",
            None,
        )
    return None


@SAMPLING.rule(
    "extra_args", param="extra_args", example={"extra_args": {"k": 2**64}}, fast="not s.extra_args"
)
def _extra_args_ints(p: SamplingParams, limits: Limits) -> Fail | None:
    if not p.extra_args:
        return None
    pending: list[object] = [p.extra_args]
    seen: set[int] = set()
    while pending:
        value = pending.pop()
        if isinstance(value, int) and not INT64_MIN <= value <= UINT64_MAX:
            return "extra_args integers must be between -2**63 and 2**64 - 1.", None
        if isinstance(value, (dict, list, tuple)) and id(value) not in seen:
            seen.add(id(value))
            if isinstance(value, dict):
                pending.extend(value.keys())
                pending.extend(value.values())
            else:
                pending.extend(value)
    return None


def _penalty(name: str) -> Callable[[SamplingParams, Limits], Fail | None]:
    def check(p: SamplingParams, limits: Limits) -> Fail | None:
        v = getattr(p, name)
        if not is_number(v):
            return not_a(name, "a number", v)
        if not -2.0 <= v <= 2.0:
            return f"{name} must be in [-2, 2], got {v}.", None
        return None

    check.__name__ = name
    return check


SAMPLING.rule(
    "presence_penalty",
    example={"presence_penalty": 3.0},
    http={"presence_penalty": 3},
    fast="type(s.presence_penalty) is float and -2.0 <= s.presence_penalty <= 2.0",
)(_penalty("presence_penalty"))
SAMPLING.rule(
    "frequency_penalty",
    example={"frequency_penalty": -2.5},
    http={"frequency_penalty": -2.5},
    fast="type(s.frequency_penalty) is float and -2.0 <= s.frequency_penalty <= 2.0",
)(_penalty("frequency_penalty"))


@SAMPLING.rule(
    "repetition_penalty",
    example={"repetition_penalty": 0.0},
    http={"repetition_penalty": 0},
    fast="type(s.repetition_penalty) is float and 0.0 < s.repetition_penalty < inf",
)
def _repetition_penalty(p: SamplingParams, limits: Limits) -> Fail | None:
    v = p.repetition_penalty
    if not is_number(v):
        return not_a("repetition_penalty", "a number", v)
    if not math.isfinite(v):
        return f"repetition_penalty must be a finite number, got {v}.", None
    if v <= 0.0:
        return f"repetition_penalty must be greater than zero, got {v}.", None
    return None


@SAMPLING.rule(
    "temperature",
    param="temperature",
    example={"temperature": -1.0},
    http={"temperature": -1},
    fast="type(s.temperature) is float and 0.0 <= s.temperature <= 2.0",
)
def _temperature(p: SamplingParams, limits: Limits) -> Fail | None:
    t = p.temperature
    if not is_number(t):
        return not_a("temperature", "a number", t)
    if not math.isfinite(t):
        return f"temperature must be a finite number, got {t}.", t
    if t < 0.0:
        return f"temperature must be non-negative, got {t}.", t
    if t > 2.0:
        return f"temperature must be in [0, 2], got {t}.", t
    return None


@SAMPLING.rule(
    "top_p",
    param="top_p",
    example={"top_p": 2.0},
    http={"top_p": 2},
    fast="type(s.top_p) is float and 0.0 < s.top_p <= 1.0",
)
def _top_p(p: SamplingParams, limits: Limits) -> Fail | None:
    v = p.top_p
    if not is_number(v):
        return not_a("top_p", "a number", v)
    if not 0.0 < v <= 1.0:
        return f"top_p must be in (0, 1], got {v}.", v
    return None


@SAMPLING.rule(
    "top_k",
    example={"top_k": -2},
    http={"top_k": -2},
    fast="type(s.top_k) is int and -1 <= s.top_k <= UINT64_MAX",
)
def _top_k(p: SamplingParams, limits: Limits) -> Fail | None:
    k = p.top_k
    if not is_int(k):
        return f"top_k must be an integer, got {type(k).__name__}", None
    if k < -1:
        return f"top_k must be 0 (disable), or at least 1, got {k}.", None
    # vLLM's frontend lets a huge top_k through and fails encoding it (HTTP 500); an
    # int msgpack cannot carry is refused here.
    return wire_int("top_k", k)


@SAMPLING.rule(
    "min_p",
    example={"min_p": 1.5},
    http={"min_p": 1.5},
    fast="type(s.min_p) is float and 0.0 <= s.min_p <= 1.0",
)
def _min_p(p: SamplingParams, limits: Limits) -> Fail | None:
    v = p.min_p
    if not is_number(v):
        return not_a("min_p", "a number", v)
    if not 0.0 <= v <= 1.0:
        return f"min_p must be in [0, 1], got {v}.", None
    return None


@SAMPLING.rule(
    "max_tokens",
    param="max_tokens",
    example={"max_tokens": 0},
    http={"max_tokens": 0},
    fast="s.max_tokens is None or (type(s.max_tokens) is int and 1 <= s.max_tokens <= UINT64_MAX)",
)
def _max_tokens(p: SamplingParams, limits: Limits) -> Fail | None:
    m = p.max_tokens
    if m is None:
        return None
    if not is_int(m):
        return not_a("max_tokens", "an integer", m)
    if m < 1:
        return f"max_tokens must be at least 1, got {m}.", m
    return wire_int("max_tokens", m)


@SAMPLING.rule(
    "min_tokens",
    example={"min_tokens": -1},
    http={"min_tokens": -1},
    fast="type(s.min_tokens) is int and s.min_tokens >= 0",
)
def _min_tokens(p: SamplingParams, limits: Limits) -> Fail | None:
    m = p.min_tokens
    if not is_int(m):
        return not_a("min_tokens", "an integer", m)
    if m < 0:
        return f"min_tokens must be greater than or equal to 0, got {m}.", None
    return None


@SAMPLING.rule(
    "min_tokens",
    example={"min_tokens": 9, "max_tokens": 4},
    http={"min_tokens": 9, "max_tokens": 4},
    fast="s.max_tokens is None or s.min_tokens <= s.max_tokens",
)
def _min_tokens_at_most_max(p: SamplingParams, limits: Limits) -> Fail | None:
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        return (
            f"min_tokens must be less than or equal to max_tokens={p.max_tokens}, "
            f"got {p.min_tokens}.",
            None,
        )
    return None


@SAMPLING.rule(
    "stream_interval",
    param="stream_interval",
    example={"stream_interval": 0},
    fast="s.stream_interval is None or (type(s.stream_interval) is int and s.stream_interval >= 1)",
)
def _stream_interval(p: SamplingParams, limits: Limits) -> Fail | None:
    v = p.stream_interval
    if v is None:
        return None
    if not is_int(v):
        return not_a("stream_interval", "an integer", v)
    if v < 1:
        return f"stream_interval must be at least 1, got {v}.", v
    return None


def _logprob_count(name: str) -> Callable[[SamplingParams, Limits], Fail | None]:
    def check(p: SamplingParams, limits: Limits) -> Fail | None:
        v = getattr(p, name)
        if v is None:
            return None
        if not is_int(v):
            return not_a(name, "an integer", v)
        if v < -1:
            return f"{name} must be non-negative or -1, got {v}.", v
        return None

    check.__name__ = name
    return check


SAMPLING.rule(
    "logprobs",
    param="logprobs",
    example={"logprobs": -2},
    fast="s.logprobs is None or (type(s.logprobs) is int and s.logprobs >= -1)",
)(_logprob_count("logprobs"))
SAMPLING.rule(
    "prompt_logprobs",
    param="prompt_logprobs",
    example={"prompt_logprobs": -2},
    fast=(
        "s.prompt_logprobs is None or (type(s.prompt_logprobs) is int and s.prompt_logprobs >= -1)"
    ),
)(_logprob_count("prompt_logprobs"))


@SAMPLING.rule(
    "stop_token_ids",
    example={"stop_token_ids": [1, "2"]},
    fast=(
        "not s.stop_token_ids or (type(s.stop_token_ids) is list "
        "and ids_within(s.stop_token_ids, UINT64_MAX))"
    ),
)
def _stop_token_ids_ints(p: SamplingParams, limits: Limits) -> Fail | None:
    ids: object = p.stop_token_ids
    if not ids:
        return None
    if not isinstance(ids, list) or not all(is_int(t) for t in ids):
        return f"stop_token_ids must contain only integers, got {ids}.", None
    return None


@SAMPLING.rule("stop", example={"stop": ["a", ""]}, http={"stop": [""]}, fast="not s.stop")
def _stop(p: SamplingParams, limits: Limits) -> Fail | None:
    stop = p.stop
    if not stop:
        return None
    if not list_of(stop, lambda s: isinstance(s, str)):
        return not_a("stop", "a list of strings", stop)
    if not all(stop):
        return "stop cannot contain an empty string.", None
    if not p.detokenize:
        return (
            "stop strings are only supported when detokenize is True. "
            "Set detokenize=True to use stop.",
            None,
        )
    return None


@SAMPLING.rule(
    "bad_words", example={"bad_words": [""]}, http={"bad_words": [""]}, fast="not s.bad_words"
)
def _bad_words(p: SamplingParams, limits: Limits) -> Fail | None:
    words = p.bad_words
    if not words:
        return None
    if not list_of(words, lambda s: isinstance(s, str)):
        return not_a("bad_words", "a list of strings", words)
    if not all(words):
        return f"bad_words cannot contain an empty string. Got bad_words={words}", None
    return None


@SAMPLING.rule(
    "n",
    example={"n": 2, "temperature": 0.0},
    http={"n": 2, "temperature": 0},
    fast="s.n == 1 or s.temperature >= SAMPLING_EPS",
)
def _greedy_n(p: SamplingParams, limits: Limits) -> Fail | None:
    if p.n > 1 and p.temperature < SAMPLING_EPS:
        return f"n must be 1 when using greedy sampling, got {p.n}.", None
    return None


@SAMPLING.rule(
    "repetition_detection",
    example={"repetition_detection": RepetitionDetectionParams(2, 3, 2)},
    fast="s.repetition_detection is None",
)
def _repetition_detection(p: SamplingParams, limits: Limits) -> Fail | None:
    rd = p.repetition_detection
    if rd is None:
        return None
    sizes = (rd.max_pattern_size, rd.min_pattern_size, rd.min_count)
    if not all(is_int(v) for v in sizes):
        return not_a("repetition_detection", "integers", sizes)
    if rd.max_pattern_size < 0 or rd.min_pattern_size < 0 or rd.min_count < 0:
        return (
            "max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= "
            "max_pattern_size. Set both to 0 to disable repetitive pattern detection.",
            None,
        )
    if rd.min_pattern_size > rd.max_pattern_size:
        return (
            "max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= "
            "max_pattern_size. Set both to 0 to disable repetitive pattern detection.",
            None,
        )
    if rd.max_pattern_size > 0 and rd.min_count < 2:
        return (
            "min_count must be >= 2 to detect repetitive patterns in engine output. If "
            "you do not wish to detect repetitive patterns, set max_pattern_size to 0.",
            None,
        )
    return None


DEFAULTED_MAX_TOKENS: Final = (SAMPLING["max_tokens"], SAMPLING["min_tokens_at_most_max"])
"""The rules vLLM's input processor checks again once ``max_tokens`` got its default
(``max_model_len - prompt_len``)."""
