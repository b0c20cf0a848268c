"""Refuse, before encoding, requests that would wedge or kill a stock engine.

A stock engine decodes and validates an ADD in its input thread without an error
handler: a value it rejects there ends that thread silently and the engine never reads
another message (docs/protocol.md §3.7). A few other mistakes (a pooling request without a
supported task) kill the whole engine. `validate_request` checks everything the
wire alone lets us check, plus the engine limits the caller knows (from the ready
response: ``max_model_len``, ``supports_lora``...), and raises `InvalidRequestError` (a
``ValueError``) with vLLM's message for the rule.

The rules are those of `trio_vllm.protocol.rules` that protect the engine
(``engine=True``): the text layer and the server check the same table, so one bad value
gets one message everywhere.

Not checked here, because it needs client state: that ``request_id`` is not the id of a
live request on the same engine (a duplicate kills the engine). The client keeps the set
of live ids and must refuse duplicates itself (resumable streaming-input sessions are the
one exception: a later ADD with the same id appends input).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._exceptions import InvalidRequestError
from .rules import (
    LORA,
    MAX_N_SEQUENCES,
    NO_LIMITS,
    POOLING,
    POOLING_TASKS,
    PROMPT,
    REQUEST,
    SAMPLING,
    SAMPLING_LIMITS,
    SAMPLING_WIRE,
    STRUCTURED_OUTPUT_BACKENDS,
    Limits,
    PromptInput,
    Violation,
    request_prompt_length,
)
from .structs import EngineCoreRequest, LoRARequest, PoolingParams, SamplingParams

if TYPE_CHECKING:
    from collections.abc import Collection

    from .profiles import ProtocolProfile

__all__ = [
    "MAX_N_SEQUENCES",
    "POOLING_TASKS",
    "STRUCTURED_OUTPUT_BACKENDS",
    "check_request",
    "check_sampling_params",
    "validate_lora_request",
    "validate_pooling_params",
    "validate_request",
    "validate_sampling_params",
]


def check_sampling_params(
    params: SamplingParams, limits: Limits = NO_LIMITS, *, engine_only: bool = True
) -> Violation | None:
    """The first rule of `SAMPLING`, `SAMPLING_LIMITS` and `SAMPLING_WIRE` that
    ``params`` breaks (those protecting the engine with ``engine_only``), or ``None``."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(
            f"sampling_params must be a SamplingParams, got {type(params).__name__}",
            field="sampling_params",
        )
    return (
        SAMPLING.check(params, limits, engine_only=engine_only)
        or SAMPLING_LIMITS.check(params, limits, engine_only=engine_only)
        or SAMPLING_WIRE.check(params, limits, engine_only=engine_only)
    )


def check_request(
    request: EngineCoreRequest, limits: Limits = NO_LIMITS, *, engine_only: bool = True
) -> Violation | None:
    """The first rule ``request`` breaks: the envelope, the prompt, then its sampling
    or pooling params and LoRA adapter; ``None`` if it may be sent."""
    if not isinstance(request, EngineCoreRequest):
        raise InvalidRequestError(
            f"expected an EngineCoreRequest, got {type(request).__name__}", field="request"
        )
    violation = REQUEST.check(request, limits, engine_only=engine_only)
    if violation is not None:
        return violation
    sp, pp = request.sampling_params, request.pooling_params
    prompt = PromptInput(
        request.prompt_token_ids, request_prompt_length(request), False, sp is not None
    )
    violation = PROMPT.check(prompt, limits, engine_only=engine_only)
    if violation is not None:
        return violation
    if sp is not None:
        violation = check_sampling_params(sp, limits, engine_only=engine_only)
    elif pp is not None:
        violation = POOLING.check(pp, limits, engine_only=engine_only)
    if violation is None and request.lora_request is not None:
        violation = LORA.check(request.lora_request, limits, engine_only=engine_only)
    return violation


def validate_sampling_params(
    params: SamplingParams,
    *,
    request_id: str = "?",
    max_logprobs: int | None = None,
    vocab_size: int | None = None,
    structured_output_backend: str | None = None,
) -> None:
    """Check ``params`` the way a stock engine's decoder and pre-processor would;
    `InvalidRequestError` with vLLM's message if a rule is broken."""
    del request_id  # kept for a stable signature; messages are vLLM's, without the id
    limits = Limits(
        max_logprobs=max_logprobs,
        vocab_size=vocab_size,
        structured_output_backend=structured_output_backend,
    )
    violation = check_sampling_params(params, limits)
    if violation is not None:
        raise violation.error()


def validate_pooling_params(
    params: PoolingParams,
    *,
    request_id: str = "?",
    supported_tasks: Collection[str] | None = None,
) -> None:
    """Check a pooling request: ``task`` set, known, and supported by the model."""
    del request_id
    if not isinstance(params, PoolingParams):
        raise InvalidRequestError(
            f"pooling_params must be a PoolingParams, got {type(params).__name__}",
            field="pooling_params",
        )
    tasks = None if supported_tasks is None else frozenset(supported_tasks)
    POOLING.raise_for(params, Limits(supported_tasks=tasks), engine_only=True)


def validate_lora_request(
    lora: LoRARequest,
    *,
    request_id: str = "?",
    supports_lora: bool | None = None,
) -> None:
    """Check a LoRA adapter reference (an invalid one kills the engine's input thread)."""
    del request_id
    LORA.raise_for(lora, Limits(supports_lora=supports_lora), engine_only=True)


def validate_request(
    request: EngineCoreRequest,
    *,
    profile: ProtocolProfile | None = None,
    limits: Limits | None = None,
    max_model_len: int | None = None,
    vocab_size: int | None = None,
    max_logprobs: int | None = None,
    supports_lora: bool | None = None,
    supported_tasks: Collection[str] | None = None,
    num_clients: int | None = None,
    structured_output_backend: str | None = None,
) -> None:
    """Raise `InvalidRequestError` (a ``ValueError``) if ``request`` would wedge or kill
    a stock engine.

    Pass the engine limits as a `Limits` (``limits``, built once) or as keywords; they
    are optional: give what the ready response and ``get_supported_tasks`` told you.
    ``profile`` is accepted for release-specific rules. Duplicate live request ids are
    *not* checked here (see the module docstring).
    """
    del profile  # no release-specific rules yet; kept for a stable signature
    if limits is None:
        limits = Limits(
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            max_logprobs=max_logprobs,
            supports_lora=supports_lora,
            supported_tasks=None if supported_tasks is None else frozenset(supported_tasks),
            num_clients=num_clients,
            structured_output_backend=structured_output_backend,
        )
    violation = check_request(request, limits)
    if violation is not None:
        raise violation.error()
