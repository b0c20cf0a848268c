"""Build valid EngineCoreRequests without knowing vLLM's frontend duties (docs/protocol.md §10).

vLLM's input processor fills in a request before the engine sees it: a unique id, the
arrival time, an explicit ``max_tokens``, the EOS token among the stop ids, the stop
ids mirrored into ``_all_stop_token_ids``, ``n = 1``. `make_request` does the
same for a prompt of token ids; `prepare_sampling_params` does it for a
`SamplingParams` you built yourself.
"""

from __future__ import annotations

import functools
import os
import time
from typing import TYPE_CHECKING

import msgspec

from ..protocol.rules import (
    DEFAULTED_MAX_TOKENS,
    NO_LIMITS,
    POOLING,
    PROMPT,
    SAMPLING,
    SAMPLING_RAW,
    Limits,
    PromptInput,
    with_pooling_defaults,
)
from ..protocol.structs import EngineCoreRequest, LoRARequest, PoolingParams, SamplingParams

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

__all__ = [
    "make_pooling_request",
    "make_request",
    "new_request_id",
    "prepare_pooling_params",
    "prepare_sampling_params",
]


def new_request_id(prefix: str = "req") -> str:
    """A request id unique with overwhelming probability: ``"<prefix>-<16 hex chars>"``.

    vLLM itself sends ``"<caller id>-<8 random hex chars>"``; 64 random bits make a
    collision among live requests practically impossible, but the client still refuses
    a live duplicate before sending (a duplicate kills the engine, §3.7).
    """
    return f"{prefix}-{os.urandom(8).hex()}"


def prepare_sampling_params(
    params: SamplingParams,
    *,
    prompt_len: int | None = None,
    max_model_len: int | None = None,
    eos_token_id: int | None = None,
    extra_eos_token_ids: Iterable[int] = (),
) -> SamplingParams:
    """Return a copy of ``params`` with the frontend's duties done (docs/protocol.md §10).

    * ``max_tokens``: must be set; if it is ``None`` it becomes ``max_model_len -
      prompt_len`` (vLLM's default), which needs both lengths.
    * EOS: unless ``ignore_eos``, ``_eos_token_id = eos_token_id`` and it joins
      ``_all_stop_token_ids``; ``extra_eos_token_ids`` (a generation config's other EOS
      ids) join ``_all_stop_token_ids`` and, unless ``ignore_eos``, ``stop_token_ids``.
    * every ``stop_token_ids`` entry is in ``_all_stop_token_ids``.
    * ``n`` must be 1 (fan out yourself, one request per sample).

    Raises `InvalidRequestError` (a ``ValueError``) first for what vLLM refuses when a
    ``SamplingParams`` is made (temperature, top_p, top_k, min_p ranges...), with vLLM's
    message (``trio_vllm.protocol.rules``); the rest of the engine's rules are checked
    when the request is sent.
    """
    SAMPLING.raise_for(params)
    SAMPLING_RAW.raise_for(params)
    max_tokens = params.max_tokens
    if max_tokens is None:
        if prompt_len is None or max_model_len is None:
            raise ValueError(
                "max_tokens is None: set it, or give prompt_len and max_model_len so it "
                "can default to max_model_len - prompt_len"
            )
        max_tokens = max_model_len - prompt_len
    stop_ids = list(params.stop_token_ids or ())
    all_stop = set(params._all_stop_token_ids)
    all_stop.update(stop_ids)
    eos = params._eos_token_id
    if eos_token_id is not None and not params.ignore_eos:
        eos = eos_token_id
    if eos is not None and not params.ignore_eos:
        all_stop.add(eos)
    for extra in extra_eos_token_ids:
        all_stop.add(extra)
        if not params.ignore_eos and extra not in stop_ids:
            stop_ids.append(extra)
    prepared = msgspec.structs.replace(
        params,
        max_tokens=max_tokens,
        stop_token_ids=stop_ids,
        _all_stop_token_ids=all_stop,
        _eos_token_id=None if params.ignore_eos else eos,
    )
    if params.max_tokens is None:  # the default, checked as vLLM's input processor does
        for rule in DEFAULTED_MAX_TOKENS:
            violation = rule(prepared)
            if violation is not None:
                raise violation.error()
    return prepared


@functools.lru_cache(maxsize=64)
def _limits(max_model_len: int) -> Limits:
    return Limits(max_model_len=max_model_len)


def make_request(
    prompt_token_ids: Sequence[int],
    *,
    max_tokens: int | None = 16,
    temperature: float = 0.0,
    seed: int | None = None,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    stop_token_ids: Sequence[int] = (),
    eos_token_id: int | None = None,
    extra_eos_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    min_tokens: int = 0,
    logprobs: int | None = None,
    sampling_params: SamplingParams | None = None,
    request_id: str | None = None,
    max_model_len: int | None = None,
    priority: int = 0,
    cache_salt: str | None = None,
    lora_request: LoRARequest | None = None,
    data_parallel_rank: int | None = None,
) -> EngineCoreRequest:
    """A generation request for ``prompt_token_ids`` with vLLM-frontend defaults.

    Greedy by default (``temperature=0.0``) and ``max_tokens=16``; pass
    ``sampling_params`` to take full control (the simple keywords are then ignored,
    but the §10 duties are still applied). ``request_id`` defaults to a fresh
    `new_request_id`; ``arrival_time`` is now. With ``max_model_len`` the prompt
    length is checked (``len(prompt) < max_model_len``) and a ``None`` ``max_tokens``
    means "up to the context limit".

    Raises `InvalidRequestError` (a ``ValueError``) with vLLM's message for an empty
    prompt, a token id no vocabulary has, a prompt that does not fit, and the sampling
    values vLLM refuses (see `prepare_sampling_params`).
    """
    prompt = [int(t) for t in prompt_token_ids]
    limits = NO_LIMITS if max_model_len is None else _limits(max_model_len)
    PROMPT.raise_for(PromptInput(prompt, len(prompt)), limits, engine_only=True)
    if sampling_params is None:
        sampling_params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            stop_token_ids=list(stop_token_ids),
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
            logprobs=logprobs,
        )
    params = prepare_sampling_params(
        sampling_params,
        prompt_len=len(prompt),
        max_model_len=max_model_len,
        eos_token_id=eos_token_id,
        extra_eos_token_ids=extra_eos_token_ids,
    )
    return EngineCoreRequest(
        request_id=request_id if request_id is not None else new_request_id(),
        prompt_token_ids=prompt,
        sampling_params=params,
        arrival_time=time.time(),
        lora_request=lora_request,
        cache_salt=cache_salt,
        data_parallel_rank=data_parallel_rank,
        priority=priority,
    )


def prepare_pooling_params(params: PoolingParams, *, task: str | None = None) -> PoolingParams:
    """Return a copy of ``params`` with vLLM's frontend duties done for a pooling request.

    vLLM's frontend (``PoolingParams.verify``) sets what the engine reads without a
    default of its own: ``task`` (``task`` here, when given, else ``params.task``),
    ``use_activation`` (``True`` unless set: the engine then normalises an embedding
    and applies a classifier's activation) and ``skip_reading_prefix_cache`` (``True``
    for the per-token tasks, ``False`` otherwise). Raises `InvalidRequestError` (a
    ``ValueError``) for what would kill a stock engine (no task, an unknown one) and for
    what vLLM refuses of any model (a classifier's ``dimensions``).
    """
    if not isinstance(params, PoolingParams):
        raise TypeError(f"expected a PoolingParams, got {type(params).__name__}")
    prepared = with_pooling_defaults(params, task)
    POOLING.raise_for(prepared)
    return prepared


def make_pooling_request(
    prompt_token_ids: Sequence[int],
    *,
    task: str = "embed",
    dimensions: int | None = None,
    use_activation: bool | None = None,
    pooling_params: PoolingParams | None = None,
    request_id: str | None = None,
    max_model_len: int | None = None,
    priority: int = 0,
    cache_salt: str | None = None,
    lora_request: LoRARequest | None = None,
    data_parallel_rank: int | None = None,
) -> EngineCoreRequest:
    """A pooling request (embed, classify, token_embed, token_classify) for
    ``prompt_token_ids``, as vLLM's frontend builds it (`prepare_pooling_params`).

    Pass ``pooling_params`` to take full control (``task`` then only fills a missing
    task; ``dimensions`` and ``use_activation`` are ignored). With ``max_model_len`` the
    prompt length is checked: a pooling prompt may fill the whole context
    (``len(prompt) <= max_model_len``; nothing is generated). The engine must support
    the task (``get_supported_tasks``): `EngineCoreClient.encode` checks that before
    sending.

    Raises `InvalidRequestError` (a ``ValueError``) with vLLM's message for an empty
    prompt, a token id no vocabulary has, a prompt that does not fit, and pooling
    params a stock engine cannot run.
    """
    prompt = [int(t) for t in prompt_token_ids]
    limits = NO_LIMITS if max_model_len is None else _limits(max_model_len)
    PROMPT.raise_for(PromptInput(prompt, len(prompt), False, False), limits, engine_only=True)
    if pooling_params is None:
        params = prepare_pooling_params(
            PoolingParams(task=task, dimensions=dimensions, use_activation=use_activation)
        )
    else:
        params = prepare_pooling_params(
            pooling_params, task=pooling_params.task if pooling_params.task else task
        )
    return EngineCoreRequest(
        request_id=request_id if request_id is not None else new_request_id(),
        prompt_token_ids=prompt,
        pooling_params=params,
        arrival_time=time.time(),
        lora_request=lora_request,
        cache_salt=cache_salt,
        data_parallel_rank=data_parallel_rank,
        priority=priority,
    )
