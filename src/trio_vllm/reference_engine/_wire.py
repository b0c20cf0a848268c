"""The engine's only door to the wire: a thin adapter over `trio_vllm.protocol`.

Every byte the engine sends or reads is produced or parsed by the protocol layer's
`EngineCodec` and its startup-message functions, for the
profile chosen with ``--protocol``. This module only maps the scheduler's plain records
onto the protocol structs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .._exceptions import ProtocolError
from ..protocol import codec as _codec
from ..protocol.profiles import profile_for_version
from ..protocol.structs import (
    ENGINE_CORE_DEAD,
    AbortRequests,
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineHandshakeMetadata,
    FinishReason,
    HandshakeReady,
    LogprobsLists,
    LogprobsTensors,
    LoRARequest,
    PrefillStats,
    PrefixCacheStats,
    RequestError,
    SchedulerStats,
    StartDPWave,
    UtilityCall,
    UtilityOutput,
    UtilityResult,
)
from ._errors import UtilityError, WireError

if TYPE_CHECKING:
    from ._scheduler import OutputRecord

__all__ = ["Wire", "WireError"]


class Wire:
    """Encode/decode for one emulated release (``0.25.1``, ``0.32.0``, ``0.33.0``)."""

    def __init__(self, version: str) -> None:
        self.profile = profile_for_version(version)
        self.version = version
        self.codec = _codec.EngineCodec(self.profile)
        # What the release's structs have: the profile's layouts say.
        self._with_cache_creation = "num_cache_creation_tokens" in self.profile.fields(
            "PrefillStats"
        )
        self._with_weight_version = "weight_version" in self.profile.fields("EngineCoreOutputs")
        self._with_request_error = "error" in self.profile.fields("EngineCoreOutput")

    # ---- startup ----

    def encode_hello(self, *, local: bool, headless: bool) -> bytes:
        return _codec.encode_hello(local=local, headless=headless)

    def decode_init_metadata(self, payload: bytes) -> EngineHandshakeMetadata:
        try:
            return _codec.decode_handshake_metadata(payload)
        except ProtocolError as exc:
            raise WireError(str(exc)) from exc

    def encode_ready(
        self, *, local: bool, headless: bool, parallel_config_hash: str | None
    ) -> bytes:
        return _codec.encode_ready(
            HandshakeReady(
                local=local, headless=headless, parallel_config_hash=parallel_config_hash
            )
        )

    def encode_ready_response(self, fields: dict[str, Any]) -> bytes:
        return self.codec.encode_ready_response(EngineCoreReadyResponse(**fields))

    def dead_frame(self) -> bytes:
        return ENGINE_CORE_DEAD

    # ---- input ----

    def decode_input(self, frames: list[Any]) -> tuple[str, Any]:
        """``("add", EngineCoreRequest)``, ``("abort", [ids])``,
        ``("utility", (client_index, call_id, method, args))`` or
        ``("start_dp_wave", (wave, exclude))``; `WireError` otherwise."""
        try:
            msg = self.codec.decode_input(frames)
        except ProtocolError as exc:
            raise WireError(str(exc)) from exc
        if isinstance(msg, EngineCoreRequest):
            return "add", msg
        if isinstance(msg, AbortRequests):
            return "abort", list(msg.request_ids)
        if isinstance(msg, UtilityCall):
            return "utility", (msg.client_index, msg.call_id, msg.method, list(msg.args))
        if isinstance(msg, StartDPWave):
            return "start_dp_wave", (msg.wave, msg.exclude_engine_index)
        raise WireError(f"unexpected decoded message {type(msg).__name__}")

    def convert_lora(self, value: Any) -> Any:
        if isinstance(value, LoRARequest):
            return value  # already decoded (a request's adapter)
        try:
            return self.codec.convert_lora_request(value)
        except ProtocolError as exc:
            raise UtilityError(str(exc)) from exc

    def to_numpy(self, tensor: Any) -> np.ndarray[Any, Any]:
        """A decoded tensor (torch, numpy or RawTensor) as a float32 ndarray."""
        if isinstance(tensor, np.ndarray):
            return tensor.astype(np.float32)
        if hasattr(tensor, "detach"):
            return tensor.detach().float().cpu().numpy()  # type: ignore[no-any-return]
        dtype = getattr(tensor, "dtype", None)
        if dtype == "bfloat16":
            raw = np.frombuffer(tensor.data, dtype=np.uint16).astype(np.uint32) << 16
            return raw.view(np.float32).reshape(tensor.shape)
        raise ValueError(f"cannot read prompt_embeds of dtype {dtype!r}")

    # ---- output ----

    def encode_outputs(self, outputs: EngineCoreOutputs) -> list[Any]:
        return self.codec.encode_outputs(outputs)

    def outputs(self, **fields: Any) -> EngineCoreOutputs:
        if not self._with_weight_version:
            fields.pop("weight_version", None)
        return EngineCoreOutputs(**fields)

    def output(self, record: OutputRecord) -> EngineCoreOutput:
        if (
            record.logprobs is None
            and record.prompt_logprobs is None
            and record.pooling_output is None
            and not record.events
            and record.prefill_stats is None
            and record.error is None
            and record.trace_headers is None
            and record.stop_reason is None
        ):
            # The common decode-step case: positional construction is much cheaper.
            if record.finish_reason is None:
                return EngineCoreOutput(record.request_id, record.new_token_ids)
            return EngineCoreOutput(
                record.request_id,
                record.new_token_ids,
                finish_reason=FinishReason(record.finish_reason),
            )
        new_logprobs = None
        if record.logprobs is not None:
            ids, vals, ranks = record.logprobs
            new_logprobs = LogprobsLists(ids, vals, ranks, None)
        prompt_lp = None
        if record.prompt_logprobs is not None:
            ids, vals, ranks = record.prompt_logprobs
            prompt_lp = LogprobsTensors(ids, vals, ranks, None, None)
        events = None
        if record.events:
            events = [EngineCoreEvent(EngineCoreEventType(t), ts) for t, ts in record.events]
        prefill = None
        if record.prefill_stats is not None:
            stats = dict(record.prefill_stats)
            if not self._with_cache_creation:
                stats.pop("num_cache_creation_tokens", None)
            prefill = PrefillStats(**stats)
        error = None
        if record.error is not None and self._with_request_error:
            code, message, retryable = record.error
            error = RequestError(code, message, retryable)
        return EngineCoreOutput(
            request_id=record.request_id,
            new_token_ids=record.new_token_ids,
            new_logprobs=new_logprobs,
            new_prompt_logprobs_tensors=prompt_lp,
            pooling_output=record.pooling_output,
            finish_reason=FinishReason(record.finish_reason)
            if record.finish_reason is not None
            else None,
            stop_reason=record.stop_reason,
            events=events,
            trace_headers=record.trace_headers,
            prefill_stats=prefill,
            error=error,
        )

    def token_output(self, request_id: str, token: int, finish_reason: int | None) -> Any:
        """The common case of a one-token output without extras (firehose fast path)."""
        if finish_reason is None:
            return EngineCoreOutput(request_id, [token])
        return EngineCoreOutput(request_id, [token], finish_reason=FinishReason(finish_reason))

    def stats(self, values: dict[str, Any]) -> SchedulerStats:
        values = dict(values)
        prefix = values.pop("prefix_cache_stats", None)
        stats = SchedulerStats(**values)
        if prefix is not None:
            stats.prefix_cache_stats = PrefixCacheStats(**prefix)
        return stats

    def utility_output(self, call_id: int, failure: str | None, value: Any) -> UtilityOutput:
        if failure is not None:
            return UtilityOutput(call_id, failure, None)
        return UtilityOutput(call_id, None, UtilityResult(None, value))
