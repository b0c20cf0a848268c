"""``trio-vllm wire check``: run the codec against folders of captured wire vectors.

A vector is one JSON file (see ``wire-vectors/README.md``): the exact frames a real vLLM
produced (``frames_b64``) and the message spelled out with field names (``value``).

* engine -> client: decoding the frames must give ``value`` (sets compared as sets);
  re-encoding the decoded message with the engine-side codec and decoding it again must
  give ``value`` too.
* client -> engine: building the message from ``value`` and encoding it must give the
  frames byte for byte; the engine-side decoder must read the frames back as ``value``.
* handshake and ready response: both directions.

The profile comes from each vector's ``vllm_version`` (``profile_for_version``).
"""

from __future__ import annotations

import base64
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from ._exceptions import ProtocolError
from .protocol import _tensors
from .protocol.codec import (
    ClientCodec,
    EngineCodec,
    decode_handshake_metadata,
    decode_hello,
    decode_ready,
    decode_ready_response,
    encode_handshake_metadata,
    encode_hello,
    encode_ready,
    encode_ready_response,
)
from .protocol.profiles import ProtocolProfile, profile_for_version
from .protocol.structs import (
    AbortRequests,
    EngineCoreDead,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineHandshakeMetadata,
    EngineZmqAddresses,
    HandshakeReady,
    LateChunkingParams,
    LateInteractionParams,
    LoRARequest,
    PoolingParams,
    RawTensor,
    RepetitionDetectionParams,
    RequestType,
    SamplingParams,
    StartDPWave,
    StructuredOutputsParams,
    UtilityCall,
    UtilityResult,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "VectorResult",
    "build_request",
    "check_vector",
    "compare_value",
    "iter_vector_files",
    "run_wire_check",
]


class Mismatch(Exception):
    """A vector did not match; the message says where and how."""


@dataclass(frozen=True)
class VectorResult:
    """Outcome of one vector: ``reason`` is ``None`` when it passed."""

    path: Path
    name: str
    reason: str | None

    @property
    def passed(self) -> bool:
        return self.reason is None


# ---- comparing decoded messages with ``value`` ------------------------------------------


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_default(struct: msgspec.Struct, name: str) -> bool:
    for f in msgspec.structs.fields(struct):
        if f.name == name:
            value = getattr(struct, name)
            if f.default is not msgspec.NODEFAULT:
                return bool(value == f.default)
            if f.default_factory is not msgspec.NODEFAULT:
                return bool(value == f.default_factory())
            return False
    return False


def _torch_name(dtype: str) -> str:
    # A tensor decoded without torch may be an ndarray: compare dtypes by torch name.
    return {
        "<f8": "float64",
        "<f4": "float32",
        "<f2": "float16",
        "<i8": "int64",
        "<i4": "int32",
        "<i2": "int16",
        "|i1": "int8",
        "|u1": "uint8",
        "|b1": "bool",
    }.get(dtype, dtype)


def _compare_values(expected: list[Any], actual: list[Any], path: str) -> None:
    if len(expected) != len(actual):
        raise Mismatch(f"{path}: {len(actual)} values, expected {len(expected)}")
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        if isinstance(e, float) or isinstance(a, float):
            if not (e == a or (math.isnan(e) and math.isnan(a))):
                raise Mismatch(f"{path}[{i}]: {a!r} != expected {e!r}")
        elif e != a:
            raise Mismatch(f"{path}[{i}]: {a!r} != expected {e!r}")


def compare_value(expected: Any, actual: Any, path: str = "$") -> None:
    """Raise `Mismatch` unless ``actual`` (decoded) matches the vector ``expected``."""
    if isinstance(expected, dict) and len(expected) == 1:
        (key,) = expected
        if key == "__tensor__" or key == "__ndarray__":
            spec = expected[key]
            if not isinstance(actual, _tensors.TensorLike):
                raise Mismatch(f"{path}: expected a tensor, got {type(actual).__name__}")
            got = _tensors.describe(actual)
            want_dtype, got_dtype = spec["dtype"], got["dtype"]
            if key == "__tensor__":
                want_dtype, got_dtype = _torch_name(want_dtype), _torch_name(got_dtype)
            if want_dtype != got_dtype:
                raise Mismatch(f"{path}: dtype {got['dtype']!r} != expected {spec['dtype']!r}")
            if list(spec["shape"]) != got["shape"]:
                raise Mismatch(f"{path}: shape {got['shape']} != expected {spec['shape']}")
            if got["values"] is None:
                raise Mismatch(f"{path}: cannot read {got['dtype']} values without torch")
            _compare_values(list(spec["values"]), got["values"], path)
            return
        if key == "__utility_result__":
            if not isinstance(actual, UtilityResult):
                raise Mismatch(f"{path}: expected a utility result, got {type(actual).__name__}")
            if actual.type_info is not None:
                raise Mismatch(f"{path}: unexpected type_info {_short(actual.type_info)}")
            compare_value(expected[key], actual.result, f"{path}.result")
            return
    if isinstance(expected, dict):
        if isinstance(actual, msgspec.Struct):
            names = {f.name for f in msgspec.structs.fields(actual)}
            for k, v in expected.items():
                if k not in names:
                    raise Mismatch(f"{path}: {type(actual).__name__} has no field {k!r}")
                compare_value(v, getattr(actual, k), f"{path}.{k}")
            for name in names - set(expected):
                if not _is_default(actual, name):
                    raise Mismatch(
                        f"{path}.{name}: {_short(getattr(actual, name))} but the vector "
                        "has no such field"
                    )
            return
        if not isinstance(actual, dict):
            raise Mismatch(f"{path}: expected a map, got {_short(actual)}")
        got = {str(k): v for k, v in actual.items()}
        if set(got) != set(expected):
            raise Mismatch(f"{path}: keys {sorted(got)} != expected {sorted(expected)}")
        for k, v in expected.items():
            compare_value(v, got[k], f"{path}.{k}")
        return
    if isinstance(expected, list):
        if isinstance(actual, (set, frozenset)):
            if sorted(actual, key=repr) != sorted(expected, key=repr):
                raise Mismatch(f"{path}: set {_short(sorted(actual, key=repr))} != {expected}")
            return
        if not isinstance(actual, (list, tuple)):
            raise Mismatch(f"{path}: expected an array, got {_short(actual)}")
        if len(actual) != len(expected):
            raise Mismatch(f"{path}: {len(actual)} items, expected {len(expected)}")
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            compare_value(e, a, f"{path}[{i}]")
        return
    if isinstance(expected, bool) or isinstance(actual, bool):
        if expected is not actual:
            raise Mismatch(f"{path}: {_short(actual)} != expected {expected!r}")
        return
    if isinstance(actual, bytes | memoryview) and isinstance(expected, str):
        actual = bytes(actual).decode("latin-1")
    if expected != actual or (type(expected) is float and type(actual) is not float):
        raise Mismatch(f"{path}: {_short(actual)} != expected {_short(expected)}")


# ---- building client->engine messages from ``value`` ------------------------------------


def _bf16_bytes(values: list[float]) -> bytes:
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
    return rounded.astype("<u2").tobytes()


def _tensor_from_spec(spec: dict[str, Any], *, torch_layout: bool) -> Any:
    dtype, shape, values = spec["dtype"], tuple(spec["shape"]), spec["values"]
    if dtype == "bfloat16":
        return RawTensor(dtype, shape, _bf16_bytes(values))
    np_dtype = np.dtype(_tensors._TORCH_TO_NUMPY.get(dtype, dtype))
    arr = np.asarray(values, dtype=np_dtype).reshape(shape)
    if torch_layout:
        return RawTensor(_torch_name(dtype), shape, arr.tobytes())
    return arr


def _tensor(value: Any, *, torch_layout: bool) -> Any:
    if isinstance(value, dict) and "__tensor__" in value:
        return _tensor_from_spec(value["__tensor__"], torch_layout=torch_layout)
    if isinstance(value, dict) and "__ndarray__" in value:
        return _tensor_from_spec(value["__ndarray__"], torch_layout=torch_layout)
    return value


def _sampling(value: dict[str, Any]) -> SamplingParams:
    d = dict(value)
    if d.get("logit_bias") is not None:
        d["logit_bias"] = {int(k): v for k, v in d["logit_bias"].items()}
    if d.get("_all_stop_token_ids") is not None:
        d["_all_stop_token_ids"] = set(d["_all_stop_token_ids"])
    if d.get("structured_outputs") is not None:
        d["structured_outputs"] = StructuredOutputsParams(**d["structured_outputs"])
    if d.get("repetition_detection") is not None:
        d["repetition_detection"] = RepetitionDetectionParams(**d["repetition_detection"])
    if d.get("prompt_logprob_token_ids") is not None:
        d["prompt_logprob_token_ids"] = _tensor(d["prompt_logprob_token_ids"], torch_layout=False)
    return SamplingParams(**d)


def _pooling(value: dict[str, Any]) -> PoolingParams:
    d = dict(value)
    if isinstance(d.get("late_interaction_params"), dict):
        d["late_interaction_params"] = LateInteractionParams(**d["late_interaction_params"])
    if isinstance(d.get("late_chunking_params"), dict):
        d["late_chunking_params"] = LateChunkingParams(**d["late_chunking_params"])
    return PoolingParams(**d)


def _lora(value: dict[str, Any]) -> LoRARequest:
    return LoRARequest(**value)


def build_request(value: dict[str, Any]) -> EngineCoreRequest:
    """An `EngineCoreRequest` from a vector's ``value`` (field-name keyed)."""
    d = dict(value)
    if d.get("sampling_params") is not None:
        d["sampling_params"] = _sampling(d["sampling_params"])
    if d.get("pooling_params") is not None:
        d["pooling_params"] = _pooling(d["pooling_params"])
    if d.get("lora_request") is not None:
        d["lora_request"] = _lora(d["lora_request"])
    if d.get("prompt_embeds") is not None:
        d["prompt_embeds"] = _tensor(d["prompt_embeds"], torch_layout=True)
    return EngineCoreRequest(**d)


def _utility_arg(method: str, arg: Any) -> Any:
    if method == "add_lora" and isinstance(arg, dict):
        return _lora(arg)
    return _tensor(arg, torch_layout=True)


def _compare_frames(encoded: Sequence[Any], frames: Sequence[bytes], what: str) -> None:
    got = [bytes(f) for f in encoded]
    if len(got) != len(frames):
        raise Mismatch(f"{what}: encoded {len(got)} frame(s), vLLM sent {len(frames)}")
    for i, (g, w) in enumerate(zip(got, frames, strict=True)):
        if g != w:
            at = next((j for j, (x, y) in enumerate(zip(g, w, strict=False)) if x != y), None)
            at = min(len(g), len(w)) if at is None else at
            raise Mismatch(
                f"{what}: frame {i} differs at byte {at} (ours {len(g)} bytes "
                f"{g[at : at + 8].hex()}..., vLLM's {len(w)} bytes {w[at : at + 8].hex()}...)"
            )


# ---- one vector ------------------------------------------------------------------------


def _check_output(profile: ProtocolProfile, frames: list[bytes], value: Any) -> None:
    client = ClientCodec(profile)
    decoded = client.decode_outputs(frames)
    if isinstance(decoded, EngineCoreDead):
        if value != "ENGINE_CORE_DEAD":
            raise Mismatch("decoded ENGINE_CORE_DEAD but the vector holds a message")
        return
    if value == "ENGINE_CORE_DEAD":
        raise Mismatch("the vector is ENGINE_CORE_DEAD but it decoded as a message")
    compare_value(value, decoded)
    again = client.decode_outputs(EngineCodec(profile).encode_outputs(decoded))
    try:
        compare_value(value, again)
    except Mismatch as exc:
        raise Mismatch(f"after re-encoding with the engine codec: {exc}") from None


def _check_input(profile: ProtocolProfile, frames: list[bytes], value: Any) -> None:
    if not frames or len(frames[0]) != 1:
        raise Mismatch("frame 0 must be the 1-byte request type")
    kind = RequestType(frames[0])
    client = ClientCodec(profile)
    if kind is RequestType.ADD:
        encoded = client.encode_add(build_request(value))
    elif kind is RequestType.ABORT:
        encoded = client.encode_abort(value)
    elif kind is RequestType.UTILITY:
        client_index, call_id, method, args = value
        encoded = client.encode_utility(
            client_index, call_id, method, [_utility_arg(method, a) for a in args]
        )
    elif kind is RequestType.START_DP_WAVE:
        encoded = client.encode_start_dp_wave(*value)
    else:
        raise Mismatch(f"request type {kind.name} is internal and never sent")
    _compare_frames(encoded, frames, kind.name)

    engine = EngineCodec(profile)
    message = engine.decode_input(frames)
    if isinstance(message, AbortRequests):
        compare_value(value, message.request_ids)
    elif isinstance(message, UtilityCall):
        decoded_args: list[Any] = list(message.args)
        if message.method == "add_lora" and decoded_args:
            decoded_args[0] = engine.convert_lora_request(decoded_args[0])
        compare_value(value, [message.client_index, message.call_id, message.method, decoded_args])
    elif isinstance(message, StartDPWave):
        compare_value(value, [message.wave, message.exclude_engine_index])
    else:
        compare_value(value, message)


def _check_ready_response(profile: ProtocolProfile, frames: list[bytes], value: Any) -> None:
    if len(frames) != 1:
        raise Mismatch(f"a ready response is one frame, the vector has {len(frames)}")
    decoded = decode_ready_response(frames[0])
    compare_value(value, decoded)
    keys = profile.map_keys["EngineCoreReadyResponse"]
    if list(value) == list(keys):
        rebuilt = EngineCoreReadyResponse(**value)
        _compare_frames([encode_ready_response(rebuilt, profile)], frames, "ready response")


def _check_handshake(frames: list[bytes], value: Any) -> None:
    if len(frames) != 1:
        raise Mismatch(f"handshake messages are one frame, the vector has {len(frames)}")
    if not isinstance(value, dict):
        raise Mismatch("handshake value must be a map")
    if "addresses" in value:
        addresses = EngineZmqAddresses(**value["addresses"])
        metadata = EngineHandshakeMetadata(addresses, dict(value.get("parallel_config", {})))
        _compare_frames([encode_handshake_metadata(metadata)], frames, "init metadata")
        compare_value(value, decode_handshake_metadata(frames[0]))
    elif value.get("status") == "HELLO":
        encoded = encode_hello(local=value["local"], headless=value["headless"])
        _compare_frames([encoded], frames, "HELLO")
        compare_value(value, decode_hello(frames[0]))
    elif value.get("status") == "READY":
        ready = HandshakeReady(**value)
        _compare_frames([encode_ready(ready)], frames, "READY")
        compare_value(value, decode_ready(frames[0]))
    else:
        raise Mismatch(f"unknown handshake message {_short(value)}")


def check_vector(vector: dict[str, Any]) -> None:
    """Check one parsed vector; raises `Mismatch` (or another error) on failure."""
    profile = profile_for_version(str(vector["vllm_version"]))
    frames = [base64.b64decode(f) for f in vector["frames_b64"]]
    value = vector["value"]
    socket, direction = vector["socket"], vector["direction"]
    if socket == "output":
        _check_output(profile, frames, value)
    elif socket == "input" and direction == "client_to_engine":
        _check_input(profile, frames, value)
    elif socket == "input":
        _check_ready_response(profile, frames, value)
    elif socket == "handshake":
        _check_handshake(frames, value)
    else:
        raise Mismatch(f"unknown socket {socket!r}")


def iter_vector_files(directory: Path) -> list[Path]:
    """The vector files of a folder (every ``*.json`` except ``INDEX.json``), sorted."""
    return sorted(p for p in directory.glob("*.json") if p.name != "INDEX.json")


def check_file(path: Path) -> VectorResult:
    """Load and check one vector file, turning every failure into a reason string."""
    try:
        vector = json.loads(path.read_text())
        name = str(vector.get("name", path.stem))
    except Exception as exc:
        return VectorResult(path, path.stem, f"cannot read vector: {exc}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            check_vector(vector)
    except Mismatch as exc:
        return VectorResult(path, name, str(exc))
    except ProtocolError as exc:
        return VectorResult(path, name, f"ProtocolError: {exc}")
    except Exception as exc:
        return VectorResult(path, name, f"{type(exc).__name__}: {exc}")
    return VectorResult(path, name, None)


def run_wire_check(dirs: Sequence[str], *, verbose: bool) -> int:
    """Check every vector in ``dirs``; print failures and ``N passed, M failed``.

    Returns the exit status: 0 when every vector passed (and there was at least one),
    1 otherwise.
    """
    passed = failed = 0
    for d in dirs:
        directory = Path(d)
        if not directory.is_dir():
            print(f"FAIL {d}: not a directory")
            failed += 1
            continue
        files = iter_vector_files(directory)
        if not files:
            print(f"FAIL {d}: no vector files (*.json)")
            failed += 1
            continue
        for path in files:
            result = check_file(path)
            if result.passed:
                passed += 1
                if verbose:
                    print(f"ok   {directory.name}/{path.name}")
            else:
                failed += 1
                print(f"FAIL {directory.name}/{path.name}: {result.reason}")
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 and passed > 0 else 1
