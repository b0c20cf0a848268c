"""The client's one door to the protocol layer: encode requests, decode outputs.

Everything byte-level the client does goes through `Wire`, which binds a
protocol profile (chosen from the engines' ``vllm_version`` or pinned) to the codec of
`trio_vllm.protocol`. Keeping it in one place lets the client stay free of wire
details.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from ..protocol.codec import ClientCodec
from ..protocol.profiles import ProtocolProfile, newest_profile, profile_for_version
from ..protocol.rules import REQUEST, SAMPLING_RAW, Limits
from ..protocol.structs import EngineCoreDead, EngineCoreOutputs, EngineCoreRequest, UtilityOutput
from ..protocol.validation import check_request

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = ["Wire"]


class Wire:
    """Codec bound to one protocol profile, client side."""

    def __init__(
        self,
        profile: ProtocolProfile,
        *,
        vllm_version: str | None,
        allow_insecure_serialization: bool,
    ) -> None:
        self.profile = profile
        self.vllm_version = vllm_version
        self.allow_insecure_serialization = allow_insecure_serialization
        # This client's place among the engines' frontends (AttachedEngines): vLLM's
        # client stamps its index into every ADD and utility call, and the engine
        # sends their results to outputs[client_index].
        self.client_index = 0
        self.client_count = 1
        self.max_model_len: int | None = None
        self.supports_lora: bool | None = None
        # The model's vocabulary size, when the caller knows it (open_client(vocab_size=)).
        self._vocab_size: int | None = None
        # The engines' tasks, once a pooling call asked (get_supported_tasks).
        self._supported_tasks: frozenset[str] | None = None
        # What the request rules may know, rebuilt when a limit changes (not per request).
        self.limits = Limits(num_clients=1)
        self._codec = ClientCodec(
            profile, allow_insecure_serialization=allow_insecure_serialization
        )
        # The receive loop's decode, bound once (one Python call per message less than
        # decode_outputs): EngineCoreOutputs, or the codec's EngineCoreDead singleton.
        self.decode_message = self._codec.decode_outputs

    @classmethod
    def create(
        cls,
        *,
        profile: ProtocolProfile | str | None,
        vllm_version: str | None,
        allow_insecure_serialization: bool,
    ) -> Wire:
        """Pick the profile: pinned (object or version string), else from ``vllm_version``.

        Raises `ProtocolError` for an engine version whose layout is unknown.
        """
        if isinstance(profile, str):
            chosen = profile_for_version(profile)
        elif profile is not None:
            chosen = profile
        elif vllm_version is not None:
            chosen = profile_for_version(vllm_version)
        else:
            chosen = newest_profile()
        return cls(
            chosen,
            vllm_version=vllm_version,
            allow_insecure_serialization=allow_insecure_serialization,
        )

    # -- requests -------------------------------------------------------------------

    @staticmethod
    def request_id(request: Any) -> str:
        if not isinstance(request, EngineCoreRequest):
            raise TypeError(f"expected an EngineCoreRequest, got {type(request).__name__}")
        if type(request.request_id) is not str or not request.request_id:
            violation = REQUEST["request_id"](request)
            assert violation is not None
            raise violation.error()
        return request.request_id

    def validate_request(self, request: EngineCoreRequest) -> None:
        """The request rules that protect a stock engine, with the engines' limits
        (``trio_vllm.protocol.rules``), and one sequence per request:
        `InvalidRequestError` (a ``ValueError``) with the rule's message."""
        violation = check_request(request, self.limits)
        if violation is None and request.sampling_params is not None:
            violation = SAMPLING_RAW.check(request.sampling_params, self.limits)
        if violation is not None:
            raise violation.error()

    @property
    def vocab_size(self) -> int | None:
        return self._vocab_size

    @vocab_size.setter
    def vocab_size(self, value: int | None) -> None:
        self._vocab_size = value
        self._update_limits()

    @property
    def supported_tasks(self) -> frozenset[str] | None:
        return self._supported_tasks

    @supported_tasks.setter
    def supported_tasks(self, value: frozenset[str] | None) -> None:
        self._supported_tasks = value
        self._update_limits()

    def set_limits(self, ready_responses: Mapping[int, Mapping[str, Any]]) -> None:
        """Take the engines' limits from their ready responses (for validation)."""
        lens = [r["max_model_len"] for r in ready_responses.values() if "max_model_len" in r]
        self.max_model_len = min(lens) if lens else None
        lora = [r["supports_lora"] for r in ready_responses.values() if "supports_lora" in r]
        self.supports_lora = all(lora) if lora else None
        self._update_limits()

    def _update_limits(self) -> None:
        self.limits = Limits(
            max_model_len=self.max_model_len,
            vocab_size=self._vocab_size,
            supports_lora=self.supports_lora,
            supported_tasks=self._supported_tasks,
            num_clients=self.client_count,
        )

    def encode_add(self, request: EngineCoreRequest) -> list[Any]:
        """Encode an ADD that passed `validate_request`, stamped with this client's
        index (as vLLM's client overwrites it: the engine routes by it)."""
        if request.client_index != self.client_index:
            request = msgspec.structs.replace(request, client_index=self.client_index)
        return self._codec.encode_add(request, validate=False)

    def encode_abort(self, request_ids: Sequence[str]) -> list[Any]:
        return self._codec.encode_abort(request_ids)

    def encode_utility(
        self, client_index: int, call_id: int, method: str, args: Sequence[Any]
    ) -> list[Any]:
        return self._codec.encode_utility(client_index, call_id, method, args)

    def encode_start_dp_wave(self, wave: int, exclude: int | None) -> list[Any]:
        return self._codec.encode_start_dp_wave(wave, exclude)

    # -- outputs --------------------------------------------------------------------

    def decode_outputs(self, frames: Sequence[Any]) -> EngineCoreOutputs | None:
        """Decode one output message; ``None`` means ENGINE_CORE_DEAD.

        Raises `ProtocolError` describing the frame otherwise.
        """
        outputs = self._codec.decode_outputs(frames)
        if isinstance(outputs, EngineCoreDead):
            return None
        return outputs

    @staticmethod
    def utility_value(utility: UtilityOutput) -> Any:
        # The codec already refused (or converted) typed results.
        return None if utility.result is None else utility.result.result

    @staticmethod
    def replace_outputs(outputs: EngineCoreOutputs, selected: list[Any]) -> EngineCoreOutputs:
        return msgspec.structs.replace(outputs, outputs=selected)
