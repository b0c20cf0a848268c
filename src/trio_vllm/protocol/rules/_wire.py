"""`SAMPLING_WIRE` and `SAMPLING_RAW`: what a request on the wire needs beyond vLLM's checks."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Final

from ..structs import StructuredOutputsParams
from ._core import (
    ENGINE_MAX_TOKEN_ID,
    OUTPUT_KINDS,
    STRUCTURED_OUTPUT_BACKENDS,
    UINT64_MAX,
    Fail,
    Family,
    Limits,
    bad_token_ids,
    ids_within,
    is_int,
    is_number,
    not_a,
    wire_int,
)
from ._sampling import sampling_example

if TYPE_CHECKING:
    from ..structs import SamplingParams

# ------------------------------------------------------------------- on the wire


SAMPLING_WIRE: Final[Family[SamplingParams]] = Family("sampling_wire", sampling_example)
"""What a request on the wire needs beyond vLLM's own checks (types a stock engine's
decoder insists on, the frontend duties done); trio-vllm's messages."""


@SAMPLING_WIRE.rule("max_tokens", example={"max_tokens": None}, fast="s.max_tokens is not None")
def _max_tokens_set(p: SamplingParams, limits: Limits) -> Fail | None:
    if p.max_tokens is None:
        return "max_tokens must be set explicitly (None makes the engine fail the request).", None
    return None


@SAMPLING_WIRE.rule(
    "seed",
    example={"seed": 2**64},
    fast="s.seed is None or (type(s.seed) is int and INT64_MIN <= s.seed <= UINT64_MAX)",
)
def _seed(p: SamplingParams, limits: Limits) -> Fail | None:
    return wire_int("seed", p.seed, optional=True)


@SAMPLING_WIRE.rule("stop_token_ids", example={"_all_stop_token_ids": {-5}})
def _stop_id_lists(p: SamplingParams, limits: Limits) -> Fail | None:
    vocab = limits.vocab_size
    bound = None if vocab is None else vocab - 1
    top = ENGINE_MAX_TOKEN_ID if bound is None else bound
    eos = p._eos_token_id
    stop, all_stop = p.stop_token_ids, p._all_stop_token_ids
    if (
        (eos is None or (type(eos) is int and 0 <= eos <= top))
        and (not stop or (type(stop) is list and ids_within(stop, top)))
        and (type(all_stop) is set and ids_within(all_stop, top))
    ):
        return None
    for field, ids in (
        ("stop_token_ids", p.stop_token_ids),
        ("_all_stop_token_ids", list(p._all_stop_token_ids)),
    ):
        bad = bad_token_ids(field, ids, bound)
        if bad is not None:
            return bad[0], None
    if p._eos_token_id is not None:
        bad = bad_token_ids("_eos_token_id", [p._eos_token_id], bound)
        if bad is not None:
            return bad[0], None
    return None


@SAMPLING_WIRE.rule(
    "_bad_words_token_ids",
    example={"_bad_words_token_ids": [[]]},
    fast="s._bad_words_token_ids is None",
)
def _bad_words_token_ids(p: SamplingParams, limits: Limits) -> Fail | None:
    lists: object = p._bad_words_token_ids
    if lists is None:
        return None
    if not isinstance(lists, list):
        return not_a("_bad_words_token_ids", "a list of token-id lists", lists)
    bound = None if limits.vocab_size is None else limits.vocab_size - 1
    for ids in lists:
        bad = bad_token_ids("_bad_words_token_ids", ids, bound, allow_empty=False)
        if bad is not None:
            return bad[0], None
    return None


@SAMPLING_WIRE.rule(
    "output_kind", example={"output_kind": 7}, fast="type(s.output_kind) is RequestOutputKind"
)
def _output_kind(p: SamplingParams, limits: Limits) -> Fail | None:
    kind = p.output_kind
    if is_int(kind) and kind in OUTPUT_KINDS:
        return None
    return f"output_kind must be a RequestOutputKind (0, 1 or 2), got {kind!r}.", None


@SAMPLING_WIRE.rule(
    "thinking_token_budget",
    example={"thinking_token_budget": -3},
    fast="s.thinking_token_budget is None",
)
def _thinking_token_budget(p: SamplingParams, limits: Limits) -> Fail | None:
    v = p.thinking_token_budget
    if v is None or (is_int(v) and 0 <= v <= UINT64_MAX):
        return None
    return f"thinking_token_budget must be None or an integer >= 0, got {v!r}.", None


@SAMPLING_WIRE.rule(
    "logit_bias", example={"logit_bias": {1: math.inf}}, fast="s.logit_bias is None"
)
def _logit_bias_shape(p: SamplingParams, limits: Limits) -> Fail | None:
    bias: object = p.logit_bias
    if bias is None:
        return None
    if not isinstance(bias, dict):
        return not_a("logit_bias", "a dict {token_id: bias}", bias)
    bad = bad_token_ids("logit_bias", list(bias), UINT64_MAX)
    if bad is not None:
        return bad[0], None
    for v in bias.values():
        if not is_number(v) or not math.isfinite(v):
            return f"logit_bias values must be finite numbers, got {v!r}.", None
    return None


@SAMPLING_WIRE.rule("extra_args", example={"extra_args": {1: "x"}}, fast="s.extra_args is None")
def _extra_args_keys(p: SamplingParams, limits: Limits) -> Fail | None:
    args: object = p.extra_args
    if args is None or (isinstance(args, dict) and all(isinstance(k, str) for k in args)):
        return None
    return f"extra_args must be a dict with str keys, got {args!r}.", None


@SAMPLING_WIRE.rule(
    "routed_experts_prompt_start",
    example={"routed_experts_prompt_start": -1},
    fast=(
        "type(s.routed_experts_prompt_start) is int "
        "and 0 <= s.routed_experts_prompt_start <= UINT64_MAX"
    ),
)
def _routed_experts_prompt_start(p: SamplingParams, limits: Limits) -> Fail | None:
    v = p.routed_experts_prompt_start
    if is_int(v) and 0 <= v <= UINT64_MAX:
        return None
    return f"routed_experts_prompt_start must be an integer >= 0, got {v!r}.", None


@SAMPLING_WIRE.rule(
    "structured_outputs._backend",
    param="structured_outputs",
    example={"structured_outputs": StructuredOutputsParams(regex="a+", _backend="gbnf")},
    fast="s.structured_outputs is None",
)
def _structured_backend(p: SamplingParams, limits: Limits) -> Fail | None:
    # The engine instantiates the backend the first structured request names: an
    # unknown one fails that request; vLLM's frontend always sets a real one.
    so = p.structured_outputs
    if so is None or so._backend in STRUCTURED_OUTPUT_BACKENDS:
        return None
    return (
        "structured_outputs._backend must name the engine's backend, one of "
        f"{sorted(STRUCTURED_OUTPUT_BACKENDS)}, got {so._backend!r} (the text layer "
        "and the server set it; a raw request must).",
        None,
    )


SAMPLING_RAW: Final[Family[SamplingParams]] = Family("sampling_raw", sampling_example)
"""What the raw client adds (it sends what it is given): one sequence per request."""


@SAMPLING_RAW.rule("n", example={"n": 2}, fast="s.n == 1")
def _one_sequence(p: SamplingParams, limits: Limits) -> Fail | None:
    if p.n != 1:
        # The engine runs one sequence per request; vLLM's frontend fans n out into n
        # requests, which is the caller's part with the raw client.
        return (
            f"n must be 1 on the wire, got {p.n!r}: send n requests with distinct ids "
            "(and seeds) instead.",
            None,
        )
    return None
