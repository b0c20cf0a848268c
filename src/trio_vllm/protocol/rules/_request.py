"""`REQUEST`: the ``EngineCoreRequest`` envelope a stock engine decodes."""

from __future__ import annotations

import math
from typing import Any, Final

from ..structs import (
    EngineCoreRequest,
    PoolingParams,
    SamplingParams,
)
from ._core import (
    UINT64_MAX,
    Fail,
    Family,
    Limits,
    is_int,
    is_number,
    list_of,
    nonempty_str,
    not_a,
    wire_int,
)

# ------------------------------------------------------------------- the request envelope


def _request_example(**fields: Any) -> EngineCoreRequest:
    fields.setdefault("request_id", "r")
    fields.setdefault("prompt_token_ids", [1, 2, 3])
    if "pooling_params" not in fields:
        fields.setdefault("sampling_params", SamplingParams(max_tokens=4))
    fields.setdefault("arrival_time", 0.0)
    return EngineCoreRequest(**fields)


REQUEST: Final[Family[EngineCoreRequest]] = Family(
    "request",
    _request_example,
    names={"SamplingParams": SamplingParams, "PoolingParams": PoolingParams},
)
"""The ``EngineCoreRequest`` envelope a stock engine decodes (ids, kinds, indexes)."""


@REQUEST.rule(
    "request_id",
    example={"request_id": ""},
    fast='type(s.request_id) is str and s.request_id != ""',
)
def _request_id(r: EngineCoreRequest, limits: Limits) -> Fail | None:
    if nonempty_str(r.request_id):
        return None
    return f"request_id must be a non-empty str, got {r.request_id!r}.", None


@REQUEST.rule(
    "sampling_params",
    example={"sampling_params": None},
    fast=(
        "(s.pooling_params is None and type(s.sampling_params) is SamplingParams) "
        "or (s.sampling_params is None and type(s.pooling_params) is PoolingParams)"
    ),
)
def _kind(r: EngineCoreRequest, limits: Limits) -> Fail | None:
    sp: object = r.sampling_params
    pp: object = r.pooling_params
    if (sp is None) == (pp is None):
        which = "both are" if sp is not None else "neither is"
        return (
            f"exactly one of sampling_params and pooling_params must be set, {which}.",
            None,
        )
    if sp is not None and not isinstance(sp, SamplingParams):
        return not_a("sampling_params", "a SamplingParams", sp)
    if pp is not None and not isinstance(pp, PoolingParams):
        return not_a("pooling_params", "a PoolingParams", pp)
    return None


@REQUEST.rule(
    "prompt_token_ids",
    example={"prompt_token_ids": None},
    fast=(
        "type(s.prompt_token_ids) is list and s.prompt_embeds is None "
        "and s.prompt_is_token_ids is None"
    ),
)
def _prompt_given(r: EngineCoreRequest, limits: Limits) -> Fail | None:
    ids: object = r.prompt_token_ids
    embeds = r.prompt_embeds
    if ids is None and embeds is None:
        return "a request needs prompt_token_ids or prompt_embeds.", None
    if ids is not None and not isinstance(ids, list):
        return not_a("prompt_token_ids", "a list of token ids", ids)
    if embeds is not None:
        shape = _shape_of(embeds)
        if shape is None or not shape or 0 in shape:
            return (
                f"prompt_embeds must be a non-empty [num_tokens, hidden] tensor, got {shape}.",
                None,
            )
    mask = r.prompt_is_token_ids
    if mask is not None:
        if not list_of(mask, lambda b: isinstance(b, bool)):
            return not_a("prompt_is_token_ids", "a list of bools", mask)
        length = request_prompt_length(r)
        if len(mask) != length:
            return (
                "prompt_is_token_ids must have the same length as prompt_embeds "
                f"(expected {length}, got {len(mask)}).",
                None,
            )
    return None


@REQUEST.rule(
    "arrival_time",
    example={"arrival_time": math.nan},
    fast="type(s.arrival_time) is float and -inf < s.arrival_time < inf",
)
def _arrival_time(r: EngineCoreRequest, limits: Limits) -> Fail | None:
    t = r.arrival_time
    if type(t) is float and math.isfinite(t):
        return None
    if is_number(t) and math.isfinite(t):
        return None
    return f"arrival_time must be a finite number (time.time()), got {t!r}.", None


@REQUEST.rule(
    "client_index",
    example={"client_index": 1},
    fast="type(s.client_index) is int and s.client_index == 0",
)
def _client_index(r: EngineCoreRequest, limits: Limits) -> Fail | None:
    i = r.client_index
    if not is_int(i) or i < 0:
        return f"client_index must be an integer >= 0, got {i!r}.", None
    clients = limits.num_clients
    if clients is not None and i >= clients:
        return (
            f"client_index must be < the number of output addresses {clients} (a larger "
            f"index kills the engine's output thread), got {i}.",
            None,
        )
    return None


@REQUEST.rule(
    "priority",
    example={"priority": 2**64},
    fast=(
        "type(s.current_wave) is int and type(s.priority) is int "
        "and INT64_MIN <= s.current_wave <= UINT64_MAX "
        "and INT64_MIN <= s.priority <= UINT64_MAX and s.data_parallel_rank is None"
    ),
)
def _ints(r: EngineCoreRequest, limits: Limits) -> Fail | None:
    for name in ("current_wave", "priority"):
        bad = wire_int(name, getattr(r, name))
        if bad is not None:
            return bad
    rank = r.data_parallel_rank
    if rank is not None and (not is_int(rank) or not 0 <= rank <= UINT64_MAX):
        return f"data_parallel_rank must be None or an integer >= 0, got {rank!r}.", None
    return None


@REQUEST.rule(
    "cache_salt",
    example={"cache_salt": 5},
    fast=(
        "s.cache_salt is None and s.session_id is None and s.trace_headers is None "
        "and s.mm_features is None and type(s.resumable) is bool "
        "and type(s.abort_immediately) is bool and (s.external_req_id is None "
        "or type(s.external_req_id) is str)"
    ),
)
def _strings(r: EngineCoreRequest, limits: Limits) -> Fail | None:
    for name in ("cache_salt", "external_req_id", "session_id"):
        v = getattr(r, name)
        if v is not None and not isinstance(v, str):
            return f"{name} must be None or a str, got {v!r}.", None
    headers: object = r.trace_headers
    if headers is not None and not (
        isinstance(headers, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())
    ):
        return f"trace_headers must be a dict of str to str, got {headers!r}.", None
    for name in ("resumable", "abort_immediately"):
        if not isinstance(getattr(r, name), bool):
            return f"{name} must be a bool, got {getattr(r, name)!r}.", None
    if r.mm_features is not None:
        return "mm_features are not supported by trio-vllm (send None).", None
    return None


def request_prompt_length(r: EngineCoreRequest) -> int:
    """A request's prompt length: its ids, else its embeddings' rows."""
    if r.prompt_token_ids is not None:
        return len(r.prompt_token_ids)
    shape = _shape_of(r.prompt_embeds)
    return shape[0] if shape else 0


def _shape_of(obj: object) -> tuple[int, ...] | None:
    shape = getattr(obj, "shape", None)
    if shape is None:
        return None
    try:
        return tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        return None
