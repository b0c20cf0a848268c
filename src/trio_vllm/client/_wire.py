"""The client's one door to the protocol layer: encode requests, decode outputs.

Everything byte-level the client does goes through :class:`Wire`, which binds a
protocol profile (chosen from the engines' ``vllm_version`` or pinned) to the codec of
:mod:`trio_vllm.protocol`. Keeping it in one place lets the client stay free of wire
details.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from .._exceptions import InsecureSerializationError, ProtocolError
from ..protocol.profiles import ProtocolProfile, newest_profile, profile_for_version
from ..protocol.structs import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestType,
    UtilityOutput,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

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
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)

    @classmethod
    def create(
        cls,
        *,
        profile: ProtocolProfile | str | None,
        vllm_version: str | None,
        allow_insecure_serialization: bool,
    ) -> Wire:
        """Pick the profile: pinned (object or version string), else from ``vllm_version``.

        Raises :class:`ProtocolError` for an engine version whose layout is unknown.
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
        """Reject what the engine would choke on (raises ``ValueError``)."""
        if (request.sampling_params is None) == (request.pooling_params is None):
            raise ValueError("exactly one of sampling_params and pooling_params must be set")
        if request.prompt_token_ids is None and request.prompt_embeds is None:
            raise ValueError("prompt_token_ids is required (or prompt_embeds)")
        if request.prompt_token_ids is not None and not request.prompt_token_ids:
            raise ValueError("the prompt must not be empty")
        params = request.sampling_params
        if params is not None and params.max_tokens is None:
            raise ValueError("sampling_params.max_tokens must be set explicitly (§10)")
        if request.client_index != 0:
            raise ValueError("client_index must be 0 (this client is the only frontend)")

    def encode_add(self, request: EngineCoreRequest) -> list[bytes]:
        return [RequestType.ADD.value, self._encoder.encode(request)]

    def encode_abort(self, request_ids: Sequence[str]) -> list[bytes]:
        return [RequestType.ABORT.value, self._encoder.encode(list(request_ids))]

    def encode_utility(
        self, client_index: int, call_id: int, method: str, args: Sequence[Any]
    ) -> list[bytes]:
        return [
            RequestType.UTILITY.value,
            self._encoder.encode([client_index, call_id, method, list(args)]),
        ]

    # -- outputs --------------------------------------------------------------------

    def decode_outputs(self, frames: Sequence[Any]) -> EngineCoreOutputs | None:
        """Decode one output message; ``None`` means ENGINE_CORE_DEAD."""
        if len(frames) == 1 and bytes(frames[0]) == ENGINE_CORE_DEAD:
            return None
        try:
            return self._decoder.decode(frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            head = bytes(frames[0][:24]).hex() if frames else ""
            raise ProtocolError(
                f"cannot decode EngineCoreOutputs ({len(frames)} frame(s), first "
                f"{len(frames[0]) if frames else 0} bytes, starts {head}): {exc}"
            ) from exc

    def utility_value(self, utility: UtilityOutput) -> Any:
        result = utility.result
        if result is None:
            return None
        if result.type_info is not None and not self.allow_insecure_serialization:
            raise InsecureSerializationError(
                "utility result carries a type hint (insecure serialization); pass "
                "allow_insecure_serialization=True to accept it"
            )
        return result.result

    @staticmethod
    def replace_outputs(outputs: EngineCoreOutputs, selected: list[Any]) -> EngineCoreOutputs:
        return msgspec.structs.replace(outputs, outputs=selected)
