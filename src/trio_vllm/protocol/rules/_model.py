"""`SAMPLING_LIMITS`: vLLM's ``SamplingParams.verify`` against the model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import numpy as np

from ..structs import (
    SamplingParams,
    StructuredOutputsParams,
)
from ._core import (
    ENGINE_MAX_TOKEN_ID,
    MAX_LOGPROB_TOKEN_IDS,
    Fail,
    Family,
    Limits,
    bad_token_ids,
    is_int,
    not_a,
)
from ._sampling import sampling_example
from ._structured import STRUCTURED

if TYPE_CHECKING:
    from collections.abc import Sequence

# --------------------------------------------------------------- against the model


SAMPLING_LIMITS: Final[Family[SamplingParams]] = Family("sampling_limits", sampling_example)
"""vLLM's ``SamplingParams.verify`` against the model (``max_logprobs``, vocabulary),
run by its input processor; each part needs its `Limits` entry."""


def _max_logprobs(limits: Limits) -> int | None:
    m = limits.max_logprobs
    if m == -1:
        return limits.vocab_size
    return m


@SAMPLING_LIMITS.rule(
    "logprobs",
    param="logprobs",
    example={"logprobs": 21},
    http={"logprobs": 21},
    fast="not s.logprobs",
)
def _logprobs_max(p: SamplingParams, limits: Limits) -> Fail | None:
    return _at_most_max_logprobs("sample", p.logprobs, limits)


def _at_most_max_logprobs(kind: str, n: int | None, limits: Limits) -> Fail | None:
    if not n:
        return None
    top = _max_logprobs(limits)
    if n == -1:  # the whole vocabulary
        if limits.vocab_size is None:
            return None
        n = limits.vocab_size
    if top is not None and n > top:
        return f"Requested {kind} logprobs of {n}, which is greater than max allowed: {top}", n
    return None


@SAMPLING_LIMITS.rule(
    "logprob_token_ids",
    param="logprob_token_ids",
    example={"logprob_token_ids": [1] * 129},
    fast="s.logprob_token_ids is None",
)
def _logprob_token_ids(p: SamplingParams, limits: Limits) -> Fail | None:
    ids: object = p.logprob_token_ids
    if ids is None:
        return None
    if not isinstance(ids, list):
        return not_a("logprob_token_ids", "a list of token ids", ids)
    n = len(ids)
    if n > MAX_LOGPROB_TOKEN_IDS:
        return (
            f"Requested logprob_token_ids of length {n}, which is greater than max "
            f"allowed: {MAX_LOGPROB_TOKEN_IDS}",
            n,
        )
    vocab = limits.vocab_size
    bad = bad_token_ids("logprob_token_ids", ids, None if vocab is None else vocab - 1)
    if bad is not None:
        if bad[1] is None:
            return bad
        return (
            f"token_id(s) {bad[1]} in logprob_token_ids contain out-of-vocab token ids. "
            f"Vocabulary size: {vocab if vocab is not None else 'unknown'}",
            bad[1],
        )
    if p.logprobs is not None and p.logprobs != n:
        return (
            "When both logprobs and logprob_token_ids are set, logprobs must equal "
            f"len(logprob_token_ids). Got logprobs={p.logprobs}, "
            f"len(logprob_token_ids)={n}.",
            n,
        )
    return None


@SAMPLING_LIMITS.rule(
    "prompt_logprobs",
    param="prompt_logprobs",
    example={"prompt_logprobs": 30},
    fast="not s.prompt_logprobs",
)
def _prompt_logprobs_max(p: SamplingParams, limits: Limits) -> Fail | None:
    return _at_most_max_logprobs("prompt", p.prompt_logprobs, limits)


@SAMPLING_LIMITS.rule(
    "prompt_logprob_start",
    param="prompt_logprob_start",
    example={"prompt_logprob_start": 1},
    fast="s.prompt_logprob_token_ids is None and s.prompt_logprob_start is None",
)
def _prompt_logprob_start(p: SamplingParams, limits: Limits) -> Fail | None:
    start = p.prompt_logprob_start
    if p.prompt_logprob_token_ids is None:
        if start is not None:
            return "prompt_logprob_start requires prompt_logprob_token_ids.", start
        return None
    rows: object = p.prompt_logprob_token_ids
    if not isinstance(rows, np.ndarray):
        return not_a("prompt_logprob_token_ids", "an integer ndarray", rows)
    if start is not None and (not is_int(start) or start < 0):
        return "prompt_logprob_start must be non-negative.", start
    return None


def _vocab_ids(field: str, ids: Sequence[int], vocab: int | None) -> Fail | None:
    top = ENGINE_MAX_TOKEN_ID if vocab is None else vocab - 1
    if min(ids) >= 0 and max(ids) <= top:
        return None
    invalid = [t for t in ids if t < 0 or t > top]
    return (
        f"token_id(s) {invalid} in {field} contain out-of-vocab token ids. "
        f"Vocabulary size: {vocab if vocab is not None else 'unknown'}",
        invalid,
    )


@SAMPLING_LIMITS.rule(
    "logit_bias",
    param="logit_bias",
    example={"logit_bias": {600: 1.0}},
    http={"logit_bias": {"600": 1.0}},
    fast="not s.logit_bias",
)
def _logit_bias_vocab(p: SamplingParams, limits: Limits) -> Fail | None:
    bias: object = p.logit_bias
    if not bias or not isinstance(bias, dict) or not all(is_int(k) for k in bias):
        return None  # SAMPLING_WIRE refuses the wrong shapes
    return _vocab_ids("logit_bias", list(bias), limits.vocab_size)


@SAMPLING_LIMITS.rule(
    "stop_token_ids",
    param="stop_token_ids",
    example={"stop_token_ids": [600]},
    http={"stop_token_ids": [600]},
    fast="not s.stop_token_ids",
)
def _stop_token_ids_vocab(p: SamplingParams, limits: Limits) -> Fail | None:
    ids = p.stop_token_ids
    if not ids or not isinstance(ids, list):
        return None
    return _vocab_ids("stop_token_ids", ids, limits.vocab_size)


@SAMPLING_LIMITS.rule(
    "allowed_token_ids",
    param="allowed_token_ids",
    example={"allowed_token_ids": [600]},
    http={"allowed_token_ids": [600]},
    fast="s.allowed_token_ids is None",
)
def _allowed_token_ids(p: SamplingParams, limits: Limits) -> Fail | None:
    ids: object = p.allowed_token_ids
    if ids is None:
        return None
    if not isinstance(ids, list):
        return not_a("allowed_token_ids", "a list of token ids", ids)
    if not ids:
        return "allowed_token_ids is not None and empty!", ids
    bad = bad_token_ids(
        "allowed_token_ids", ids, None if limits.vocab_size is None else limits.vocab_size - 1
    )
    if bad is None or bad[1] is None:
        return bad
    return "allowed_token_ids contains out-of-vocab token id!", bad[1]


@SAMPLING_LIMITS.rule(
    "structured_outputs",
    example={"structured_outputs": StructuredOutputsParams(choice=[])},
    fast="s.structured_outputs is None",
)
def _structured_outputs(p: SamplingParams, limits: Limits) -> Fail | None:
    so = p.structured_outputs
    if so is None:
        return None
    violation = STRUCTURED.check(so, limits)
    return None if violation is None else (violation.message, violation.value)
