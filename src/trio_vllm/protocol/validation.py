"""Refuse, before encoding, requests that would wedge or kill a stock engine.

A stock engine decodes and validates an ADD in its input thread without an error
handler: a value it rejects there ends that thread silently and the engine never reads
another message (docs/protocol.md §3.7). A few other mistakes (a pooling request without a
supported task) kill the whole engine. `validate_request` checks everything the
wire alone lets us check, plus the engine limits the caller knows (from the ready
response: ``max_model_len``, ``supports_lora``...), and raises ``ValueError`` naming the
field and the rule.

Not checked here, because it needs client state: that ``request_id`` is not the id of a
live request on the same engine (a duplicate kills the engine). The client keeps the set
of live ids and must refuse duplicates itself (resumable streaming-input sessions are the
one exception: a later ADD with the same id appends input).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from .structs import (
    EngineCoreRequest,
    LoRARequest,
    PoolingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Sequence

    from .profiles import ProtocolProfile

__all__ = [
    "MAX_N_SEQUENCES",
    "POOLING_TASKS",
    "STRUCTURED_OUTPUT_BACKENDS",
    "validate_lora_request",
    "validate_pooling_params",
    "validate_request",
    "validate_sampling_params",
]

#: vLLM's ``VLLM_MAX_N_SEQUENCES``.
MAX_N_SEQUENCES: Final = 16384
#: Pooling tasks a stock engine's decoder accepts.
POOLING_TASKS: Final = frozenset(
    {"embed", "classify", "token_embed", "token_classify", "plugin", "embed&token_classify"}
)
#: Structured-output backends an engine can instantiate from ``_backend``.
STRUCTURED_OUTPUT_BACKENDS: Final = frozenset(
    {"xgrammar", "guidance", "outlines", "lm-format-enforcer"}
)
_MAX_LOGPROB_TOKEN_IDS: Final = 128
_INT_ONLY: Final = {int}
_INT64_MIN: Final = -(1 << 63)
_UINT64_MAX: Final = (1 << 64) - 1


def _is_int(x: object) -> bool:
    return type(x) is int or (isinstance(x, int) and not isinstance(x, bool))


def _is_number(x: object) -> bool:
    t = type(x)
    if t is float or t is int:
        return True
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) or isinstance(
        x, (np.floating, np.integer)
    )


def _nonempty_str(x: object) -> bool:
    return isinstance(x, str) and bool(x)


def _list_of(x: object, pred: Callable[[object], bool]) -> bool:
    return isinstance(x, list) and all(pred(item) for item in x)


def _str_keyed(x: object) -> bool:
    return isinstance(x, dict) and all(isinstance(k, str) for k in x)


def _str_dict(x: object) -> bool:
    return isinstance(x, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in x.items()
    )


def _output_kind(x: object) -> bool:
    return _is_int(x) and x in _OUTPUT_KINDS


_OUTPUT_KINDS: Final = frozenset(int(k) for k in RequestOutputKind)


def _bad(rid: str, field: str, rule: str, value: object) -> ValueError:
    return ValueError(f"request {rid!r}: {field} {rule} (got {value!r})")


def _check_token_ids(
    rid: str, field: str, ids: object, vocab_size: int | None, *, allow_empty: bool = True
) -> None:
    if not isinstance(ids, (list, tuple)):
        raise _bad(rid, field, "must be a list of ints", type(ids).__name__)
    if not ids:
        if not allow_empty:
            raise _bad(rid, field, "must not be empty", ids)
        return
    # C-speed checks first (prompts can be long); find the culprit only on failure.
    if set(map(type, ids)) != _INT_ONLY or min(ids) < 0:
        bad = next(t for t in ids if type(t) is not int or t < 0)
        raise _bad(rid, field, "must contain non-negative ints only", bad)
    if vocab_size is not None and max(ids) >= vocab_size:
        bad = next(t for t in ids if t >= vocab_size)
        raise _bad(rid, field, f"must be < the vocabulary size {vocab_size}", bad)


def validate_sampling_params(
    params: SamplingParams,
    *,
    request_id: str = "?",
    max_logprobs: int | None = None,
    vocab_size: int | None = None,
    structured_output_backend: str | None = None,
) -> None:
    """Check ``params`` the way a stock engine's decoder and pre-processor would."""
    rid = request_id
    p = params
    if not isinstance(p, SamplingParams):
        raise _bad(rid, "sampling_params", "must be a SamplingParams", type(p).__name__)
    if not _is_int(p.n) or not 1 <= p.n <= MAX_N_SEQUENCES:
        raise _bad(rid, "n", f"must be an int in [1, {MAX_N_SEQUENCES}]", p.n)
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not _is_number(v) or not -2.0 <= v <= 2.0:
            raise _bad(rid, name, "must be a number in [-2, 2]", v)
    if not _is_number(p.repetition_penalty) or not (
        math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0
    ):
        raise _bad(rid, "repetition_penalty", "must be finite and > 0", p.repetition_penalty)
    if not _is_number(p.temperature) or not (
        math.isfinite(p.temperature) and 0.0 <= p.temperature <= 2.0
    ):
        raise _bad(rid, "temperature", "must be finite and in [0, 2]", p.temperature)
    if not _is_number(p.top_p) or not 0.0 < p.top_p <= 1.0:
        raise _bad(rid, "top_p", "must be in (0, 1]", p.top_p)
    if not _is_int(p.top_k) or p.top_k < -1:
        raise _bad(rid, "top_k", "must be an int >= -1 (0 or -1 disable it)", p.top_k)
    if not _is_number(p.min_p) or not 0.0 <= p.min_p <= 1.0:
        raise _bad(rid, "min_p", "must be in [0, 1]", p.min_p)
    if p.seed is not None and (not _is_int(p.seed) or not _INT64_MIN <= p.seed <= _UINT64_MAX):
        raise _bad(rid, "seed", "must be None or a 64-bit int", p.seed)
    if p.max_tokens is None:
        raise _bad(
            rid,
            "max_tokens",
            "must be set explicitly (None makes the engine fail the request)",
            None,
        )
    if not _is_int(p.max_tokens) or p.max_tokens < 1:
        raise _bad(rid, "max_tokens", "must be an int >= 1", p.max_tokens)
    if not _is_int(p.min_tokens) or not 0 <= p.min_tokens <= p.max_tokens:
        raise _bad(rid, "min_tokens", "must be an int in [0, max_tokens]", p.min_tokens)
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(p, name)
        if v is None:
            continue
        if not _is_int(v) or v < -1:
            raise _bad(rid, name, "must be None, -1 (whole vocabulary) or an int >= 0", v)
        if max_logprobs is not None and v != -1 and v > max_logprobs:
            raise _bad(rid, name, f"must be <= the engine's max_logprobs {max_logprobs}", v)
    if p.logprob_token_ids is not None:
        _check_token_ids(rid, "logprob_token_ids", p.logprob_token_ids, vocab_size)
        if len(p.logprob_token_ids) > _MAX_LOGPROB_TOKEN_IDS:
            raise _bad(
                rid, "logprob_token_ids", "may hold at most 128 ids", len(p.logprob_token_ids)
            )
    if p.prompt_logprob_start is not None and (
        not _is_int(p.prompt_logprob_start) or p.prompt_logprob_start < 0
    ):
        raise _bad(
            rid, "prompt_logprob_start", "must be None or an int >= 0", p.prompt_logprob_start
        )
    if p.prompt_logprob_token_ids is not None and not isinstance(
        p.prompt_logprob_token_ids, np.ndarray
    ):
        raise _bad(
            rid,
            "prompt_logprob_token_ids",
            "must be None or an int ndarray",
            type(p.prompt_logprob_token_ids).__name__,
        )
    if not _list_of(p.stop, _nonempty_str):
        raise _bad(rid, "stop", "must be a list of non-empty strings", p.stop)
    if p.stop and not p.detokenize:
        raise _bad(rid, "stop", "requires detokenize=True", p.stop)
    if not isinstance(p.stop_token_ids, list):
        raise _bad(rid, "stop_token_ids", "must be a list of ints", p.stop_token_ids)
    _check_token_ids(rid, "stop_token_ids", p.stop_token_ids, vocab_size)
    _check_token_ids(rid, "_all_stop_token_ids", list(p._all_stop_token_ids), vocab_size)
    if p._eos_token_id is not None:
        _check_token_ids(rid, "_eos_token_id", [p._eos_token_id], vocab_size)
    if not _list_of(p.bad_words, _nonempty_str):
        raise _bad(rid, "bad_words", "must be a list of non-empty strings", p.bad_words)
    if p._bad_words_token_ids is not None:
        if not isinstance(p._bad_words_token_ids, list):
            raise _bad(
                rid,
                "_bad_words_token_ids",
                "must be a list of token-id lists",
                p._bad_words_token_ids,
            )
        for ids in p._bad_words_token_ids:
            _check_token_ids(rid, "_bad_words_token_ids", ids, vocab_size, allow_empty=False)
    if p.greedy and p.n != 1:
        raise _bad(rid, "n", "must be 1 for greedy sampling (temperature 0)", p.n)
    if p.stream_interval is not None and (not _is_int(p.stream_interval) or p.stream_interval < 1):
        raise _bad(rid, "stream_interval", "must be None or an int >= 1", p.stream_interval)
    if not _output_kind(p.output_kind):
        raise _bad(rid, "output_kind", "must be a RequestOutputKind (0, 1 or 2)", p.output_kind)
    if p.thinking_token_budget is not None and (
        not _is_int(p.thinking_token_budget) or p.thinking_token_budget < 0
    ):
        raise _bad(
            rid, "thinking_token_budget", "must be None or an int >= 0", p.thinking_token_budget
        )
    if p.logit_bias is not None:
        if not isinstance(p.logit_bias, dict):
            raise _bad(rid, "logit_bias", "must be a dict {token_id: bias}", p.logit_bias)
        _check_token_ids(rid, "logit_bias keys", list(p.logit_bias), vocab_size)
        for v in p.logit_bias.values():
            if not _is_number(v) or not math.isfinite(v):
                raise _bad(rid, "logit_bias", "values must be finite numbers", v)
    if p.allowed_token_ids is not None:
        _check_token_ids(
            rid, "allowed_token_ids", p.allowed_token_ids, vocab_size, allow_empty=False
        )
    if p.extra_args is not None:
        if not _str_keyed(p.extra_args):
            raise _bad(rid, "extra_args", "must be a dict with str keys", p.extra_args)
        _check_ints_in_range(rid, "extra_args", p.extra_args)
    if p.structured_outputs is not None:
        _check_structured(rid, p.structured_outputs, structured_output_backend)
    rd = p.repetition_detection
    if rd is not None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            v = getattr(rd, name)
            if not _is_int(v) or v < 0:
                raise _bad(rid, f"repetition_detection.{name}", "must be an int >= 0", v)
        if rd.max_pattern_size > 0:
            if rd.min_count < 2:
                raise _bad(
                    rid,
                    "repetition_detection.min_count",
                    "must be >= 2 when max_pattern_size > 0",
                    rd.min_count,
                )
            if rd.min_pattern_size > rd.max_pattern_size:
                raise _bad(
                    rid,
                    "repetition_detection.min_pattern_size",
                    "must be <= max_pattern_size",
                    rd.min_pattern_size,
                )
    if not _is_int(p.routed_experts_prompt_start) or p.routed_experts_prompt_start < 0:
        raise _bad(
            rid, "routed_experts_prompt_start", "must be an int >= 0", p.routed_experts_prompt_start
        )


def _check_ints_in_range(rid: str, field: str, value: Any, depth: int = 0) -> None:
    if depth > 32:
        raise _bad(rid, field, "is nested too deeply", "...")
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _UINT64_MAX:
            raise _bad(rid, field, "ints must fit in [-2**63, 2**64)", value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_ints_in_range(rid, field, k, depth + 1)
            _check_ints_in_range(rid, field, v, depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_ints_in_range(rid, field, v, depth + 1)


def _check_structured(rid: str, so: StructuredOutputsParams, backend: str | None) -> None:
    if not isinstance(so, StructuredOutputsParams):
        raise _bad(rid, "structured_outputs", "must be a StructuredOutputsParams", so)
    constraints = [
        so.json,
        so.regex,
        so.choice,
        so.grammar,
        so.json_object or None,
        so.structural_tag,
    ]
    count = sum(c is not None for c in constraints)
    if count != 1:
        raise _bad(
            rid,
            "structured_outputs",
            "must set exactly one constraint "
            "(json, regex, choice, grammar, json_object, structural_tag)",
            count,
        )
    if so._backend is None or so._backend not in STRUCTURED_OUTPUT_BACKENDS:
        raise _bad(
            rid,
            "structured_outputs._backend",
            f"must name the engine's backend, one of {sorted(STRUCTURED_OUTPUT_BACKENDS)}",
            so._backend,
        )
    if backend is not None and so._backend != backend:
        raise _bad(
            rid,
            "structured_outputs._backend",
            f"must be the engine's configured backend {backend!r}",
            so._backend,
        )


def validate_pooling_params(
    params: PoolingParams,
    *,
    request_id: str = "?",
    supported_tasks: Collection[str] | None = None,
) -> None:
    """Check a pooling request: ``task`` set, known, and supported by the model."""
    rid = request_id
    if not isinstance(params, PoolingParams):
        raise _bad(rid, "pooling_params", "must be a PoolingParams", type(params).__name__)
    if params.task is None:
        raise _bad(
            rid,
            "pooling_params.task",
            "must be set (a stock engine dies on a pooling request without a task)",
            None,
        )
    if params.task not in POOLING_TASKS:
        raise _bad(
            rid, "pooling_params.task", f"must be one of {sorted(POOLING_TASKS)}", params.task
        )
    if supported_tasks is not None and params.task not in supported_tasks:
        raise _bad(
            rid,
            "pooling_params.task",
            f"is not supported by the model (supported: {sorted(supported_tasks)})",
            params.task,
        )
    if params.dimensions is not None and (not _is_int(params.dimensions) or params.dimensions < 1):
        raise _bad(
            rid, "pooling_params.dimensions", "must be None or an int >= 1", params.dimensions
        )
    if not _output_kind(params.output_kind):
        raise _bad(
            rid, "pooling_params.output_kind", "must be a RequestOutputKind", params.output_kind
        )


def validate_lora_request(
    lora: LoRARequest,
    *,
    request_id: str = "?",
    supports_lora: bool | None = None,
) -> None:
    """Check a LoRA adapter reference (an invalid one kills the engine's input thread)."""
    rid = request_id
    if not isinstance(lora, LoRARequest):
        raise _bad(rid, "lora_request", "must be a LoRARequest", type(lora).__name__)
    if supports_lora is False:
        raise _bad(rid, "lora_request", "needs an engine with LoRA support", lora.lora_name)
    if not _nonempty_str(lora.lora_name):
        raise _bad(rid, "lora_request.lora_name", "must be a non-empty str", lora.lora_name)
    if not _is_int(lora.lora_int_id) or lora.lora_int_id < 1:
        raise _bad(rid, "lora_request.lora_int_id", "must be an int >= 1", lora.lora_int_id)
    if not _nonempty_str(lora.lora_path):
        raise _bad(rid, "lora_request.lora_path", "must be a non-empty str", lora.lora_path)


def validate_request(
    request: EngineCoreRequest,
    *,
    profile: ProtocolProfile | None = None,
    max_model_len: int | None = None,
    vocab_size: int | None = None,
    max_logprobs: int | None = None,
    supports_lora: bool | None = None,
    supported_tasks: Collection[str] | None = None,
    num_clients: int | None = None,
    structured_output_backend: str | None = None,
) -> None:
    """Raise ``ValueError`` if ``request`` would wedge or kill a stock engine.

    The keyword limits are optional; pass what the ready response and
    ``get_supported_tasks`` told you. ``profile`` is accepted for release-specific rules.
    Duplicate live request ids are *not* checked here (see the module docstring).
    """
    del profile  # no release-specific rules yet; kept for a stable signature
    if not isinstance(request, EngineCoreRequest):
        raise ValueError(f"expected an EngineCoreRequest, got {type(request).__name__}")
    rid = request.request_id
    if not _nonempty_str(rid):
        raise ValueError(f"request_id must be a non-empty str, got {rid!r}")
    sp, pp = request.sampling_params, request.pooling_params
    if (sp is None) == (pp is None):
        raise _bad(
            rid,
            "sampling_params/pooling_params",
            "exactly one must be set (generation or pooling)",
            "both" if sp is not None else "neither",
        )
    ids = request.prompt_token_ids
    embeds = request.prompt_embeds
    if ids is None and embeds is None:
        raise _bad(rid, "prompt", "must be given (prompt_token_ids or prompt_embeds)", None)
    if ids is not None:
        _check_token_ids(rid, "prompt_token_ids", ids, vocab_size, allow_empty=False)
    prompt_len = len(ids) if ids is not None else 0
    if embeds is not None:
        shape = _shape_of(embeds)
        if shape is None or len(shape) == 0 or 0 in shape:
            raise _bad(
                rid, "prompt_embeds", "must be a non-empty [num_tokens, hidden] tensor", shape
            )
        if ids is None:
            prompt_len = shape[0]
    if request.prompt_is_token_ids is not None:
        mask = request.prompt_is_token_ids
        if not _list_of(mask, lambda b: isinstance(b, bool)):
            raise _bad(rid, "prompt_is_token_ids", "must be a list of bools", mask)
        if len(mask) != prompt_len:
            raise _bad(
                rid, "prompt_is_token_ids", f"must have the prompt's length {prompt_len}", len(mask)
            )
    if max_model_len is not None:
        if sp is not None and prompt_len >= max_model_len:
            raise _bad(
                rid,
                "prompt",
                f"must be shorter than max_model_len {max_model_len} "
                "(one slot is needed for output)",
                prompt_len,
            )
        if pp is not None and prompt_len > max_model_len:
            raise _bad(rid, "prompt", f"must be at most max_model_len {max_model_len}", prompt_len)
    if sp is not None:
        validate_sampling_params(
            sp,
            request_id=rid,
            max_logprobs=max_logprobs,
            vocab_size=vocab_size,
            structured_output_backend=structured_output_backend,
        )
    if pp is not None:
        validate_pooling_params(pp, request_id=rid, supported_tasks=supported_tasks)
    if request.lora_request is not None:
        validate_lora_request(request.lora_request, request_id=rid, supports_lora=supports_lora)
    if not _is_number(request.arrival_time) or not math.isfinite(request.arrival_time):
        raise _bad(
            rid, "arrival_time", "must be a finite number (time.time())", request.arrival_time
        )
    if not _is_int(request.client_index) or request.client_index < 0:
        raise _bad(rid, "client_index", "must be an int >= 0", request.client_index)
    if num_clients is not None and request.client_index >= num_clients:
        raise _bad(
            rid,
            "client_index",
            f"must be < the number of output addresses {num_clients} "
            "(a larger index kills the engine's output thread)",
            request.client_index,
        )
    for name in ("current_wave", "priority"):
        v = getattr(request, name)
        if not _is_int(v) or not _INT64_MIN <= v <= _UINT64_MAX:
            raise _bad(rid, name, "must be a 64-bit int", v)
    if request.data_parallel_rank is not None and (
        not _is_int(request.data_parallel_rank) or request.data_parallel_rank < 0
    ):
        raise _bad(
            rid, "data_parallel_rank", "must be None or an int >= 0", request.data_parallel_rank
        )
    for name in ("cache_salt", "external_req_id", "session_id"):
        v = getattr(request, name)
        if v is not None and not isinstance(v, str):
            raise _bad(rid, name, "must be None or a str", v)
    if request.trace_headers is not None and not _str_dict(request.trace_headers):
        raise _bad(rid, "trace_headers", "must be a dict of str to str", request.trace_headers)
    for name in ("resumable", "abort_immediately"):
        if not isinstance(getattr(request, name), bool):
            raise _bad(rid, name, "must be a bool", getattr(request, name))
    if request.mm_features is not None:
        raise _bad(rid, "mm_features", "are not supported by trio-vllm (send None)", "...")


def _shape_of(obj: Any) -> Sequence[int] | None:
    shape = getattr(obj, "shape", None)
    if shape is None:
        return None
    try:
        return tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        return None
