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
from ..protocol.structs import EngineCoreDead, EngineCoreOutputs, EngineCoreRequest, UtilityOutput
from ..protocol.validation import validate_request

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
        self.max_model_len: int | None = None
        self.supports_lora: bool | None = None
        # The model's vocabulary size, when the caller knows it (open_client(vocab_size=)).
        self.vocab_size: int | None = None
        self._codec = ClientCodec(
            profile, allow_insecure_serialization=allow_insecure_serialization
        )

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
            raise ValueError("request_id must be a non-empty str")
        return request.request_id

    def validate_request(self, request: EngineCoreRequest) -> None:
        """Client-level checks on top of the codec's validation (``ValueError``)."""
        if request.client_index != 0:
            raise ValueError("client_index must be 0 (this client is the only frontend)")
        sampling = request.sampling_params
        if sampling is not None and getattr(sampling, "n", 1) != 1:
            # The engine runs one sequence per request; vLLM's frontend fans n out into
            # n requests, which is the caller's part here (docs/reliability.md).
            raise ValueError(
                f"request {request.request_id!r}: n must be 1 (got {sampling.n!r}); send n "
                "requests with distinct ids (and seeds) instead"
            )

    def set_limits(self, ready_responses: Mapping[int, Mapping[str, Any]]) -> None:
        """Take the engines' limits from their ready responses (for validation)."""
        lens = [r["max_model_len"] for r in ready_responses.values() if "max_model_len" in r]
        self.max_model_len = min(lens) if lens else None
        lora = [r["supports_lora"] for r in ready_responses.values() if "supports_lora" in r]
        self.supports_lora = all(lora) if lora else None

    def encode_add(self, request: EngineCoreRequest) -> list[Any]:
        """Validate and encode an ADD (``ValueError`` before any byte is produced)."""
        validate_request(
            request,
            profile=self.profile,
            max_model_len=self.max_model_len,
            supports_lora=self.supports_lora,
            vocab_size=self.vocab_size,
            num_clients=1,
        )
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
