"""Profile selection, per-release layouts, and the startup messages."""

from __future__ import annotations

import warnings

import msgspec
import pytest

from trio_vllm import ProtocolError
from trio_vllm.protocol import (
    PROFILES,
    V0_25_1,
    V0_32_0,
    V0_33_0,
    ClientCodec,
    EngineCodec,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineHandshakeMetadata,
    EngineZmqAddresses,
    HandshakeReady,
    SamplingParams,
    decode_handshake_metadata,
    decode_hello,
    decode_ready,
    decode_ready_response,
    encode_handshake_metadata,
    encode_hello,
    encode_ready,
    encode_ready_response,
    profile_for_version,
)
from trio_vllm.protocol import profiles as profiles_module


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.25.1", V0_25_1),
        ("0.32.0", V0_32_0),
        ("0.33.0", V0_33_0),
        ("0.32.0+cu128", V0_32_0),
        ("0.33.0rc1", V0_33_0),
        ("0.33.2", V0_33_0),
        ("v0.25.1", V0_25_1),
    ],
)
def test_known_versions(version: str, expected: object) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        profile = profile_for_version(version)
    assert profile.layouts is expected.layouts  # type: ignore[attr-defined]
    assert profile.requested_version == version
    assert not profile.fallback


def test_newer_version_falls_back_and_warns_once() -> None:
    profiles_module._warned.discard("0.40.1")
    with pytest.warns(RuntimeWarning, match=r"0\.40\.1 is newer"):
        profile = profile_for_version("0.40.1")
    assert profile.fallback
    assert profile.vllm_version == "0.33.0"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert profile_for_version("0.40.1").fallback  # no second warning
    with pytest.warns(RuntimeWarning):
        profile_for_version("1.0.0")


@pytest.mark.parametrize("version", ["0.24.0", "0.28.3", "0.10.1", "", "latest", "abc.def", "0"])
def test_unknown_older_or_garbage_versions_are_refused(version: str) -> None:
    with pytest.raises(ProtocolError, match=r"vLLM|version"):
        profile_for_version(version)


def test_non_string_version_is_refused() -> None:
    with pytest.raises(ProtocolError):
        profile_for_version(32)  # type: ignore[arg-type]


def test_profiles_table() -> None:
    assert list(PROFILES) == ["0.25.1", "0.32.0", "0.33.0"]
    counts = {
        v: (
            len(p.layouts["EngineCoreRequest"]),
            len(p.layouts["EngineCoreOutput"]),
            len(p.layouts["EngineCoreOutputs"]),
            len(p.layouts["LoRARequest"]),
            len(p.layouts["PoolingParams"]),
            len(p.layouts["LogprobsTensors"]),
            len(p.map_keys["SamplingParams"]),
            len(p.map_keys["EngineCoreReadyResponse"]),
            len(p.map_keys["SchedulerStats"]),
        )
        for v, p in PROFILES.items()
    }
    # PROTOCOL.md §9.
    assert counts == {
        "0.25.1": (20, 13, 8, 7, 10, 4, 37, 10, 15),
        "0.32.0": (22, 18, 9, 6, 10, 5, 43, 25, 18),
        "0.33.0": (22, 19, 9, 6, 11, 5, 43, 28, 18),
    }
    assert V0_25_1.reserved_call_ids == {-1}
    assert V0_32_0.reserved_call_ids == {-1, -2}
    assert V0_33_0.utility_arity["profile"] == (0, 5)


def test_0_25_sampling_params_use_that_release_key_order() -> None:
    sp = SamplingParams(
        max_tokens=4, routed_experts_prompt_start=3, stream_interval=2, bad_words=["x"]
    )
    req = EngineCoreRequest("r", prompt_token_ids=[1], sampling_params=sp, arrival_time=0.0)
    old = msgspec.msgpack.decode(ClientCodec(V0_25_1).encode_add(req)[1])[3]
    new = msgspec.msgpack.decode(ClientCodec(V0_32_0).encode_add(req)[1])[3]
    assert "stream_interval" not in old  # 0.25.1 has no such field
    assert new["stream_interval"] == 2
    assert list(old).index("routed_experts_prompt_start") < list(old).index("bad_words")
    assert list(new).index("routed_experts_prompt_start") > list(new).index("bad_words")


def test_short_add_array_is_refused_like_a_stock_engine() -> None:
    main = msgspec.msgpack.encode(["r", [1], None, {"max_tokens": 3}])
    with pytest.raises(ProtocolError, match="at least 9"):
        EngineCodec().decode_input([b"\x00", main])


@pytest.mark.parametrize("head", [b"\x04", b"\x05", b"\x07", b"", b"\x00\x00"])
def test_internal_or_unknown_request_types_are_refused(head: bytes) -> None:
    with pytest.raises(ProtocolError, match="request type"):
        EngineCodec().decode_input([head, msgspec.msgpack.encode([])])


# ---- startup ---------------------------------------------------------------------------


def test_ready_response_legacy_empty_frame() -> None:
    assert decode_ready_response(b"") == EngineCoreReadyResponse()


def test_ready_response_ignores_unknown_keys_and_needs_none() -> None:
    payload = msgspec.msgpack.encode({"vllm_version": "0.32.0", "brand_new": [1, 2]})
    resp = decode_ready_response(payload)
    assert resp.vllm_version == "0.32.0"
    assert resp.max_model_len is None
    assert decode_ready_response(msgspec.msgpack.encode({})) == EngineCoreReadyResponse()


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", msgspec.msgpack.encode([1, 2]), msgspec.msgpack.encode({"vllm_version": 32})],
)
def test_bad_ready_response_is_a_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError, match="EngineCoreReadyResponse"):
        decode_ready_response(payload)


@pytest.mark.parametrize("profile", [V0_25_1, V0_32_0, V0_33_0], ids=lambda p: p.vllm_version)
def test_ready_response_keys_per_release(profile: object) -> None:
    resp = EngineCoreReadyResponse(max_model_len=64, vllm_version="x", supports_lora=False)
    keys = list(msgspec.msgpack.decode(encode_ready_response(resp, profile)))  # type: ignore[arg-type]
    assert keys == list(profile.map_keys["EngineCoreReadyResponse"])  # type: ignore[attr-defined]


def test_hello_and_ready() -> None:
    hello = decode_hello(encode_hello(local=True, headless=False))
    assert (hello.local, hello.headless) == (True, False)
    ready = HandshakeReady(local=False, headless=True, parallel_config_hash="abc")
    back = decode_ready(encode_ready(ready))
    assert back == ready
    assert "coord_store_port" not in msgspec.msgpack.decode(encode_ready(ready))
    with pytest.raises(ProtocolError, match="HELLO"):
        decode_hello(encode_ready(ready))
    with pytest.raises(ProtocolError, match="READY"):
        decode_ready(encode_hello(local=True, headless=False))
    with pytest.raises(ProtocolError):
        decode_hello(msgspec.msgpack.encode({"status": "HELLO"}))


def test_handshake_metadata() -> None:
    meta = EngineHandshakeMetadata(
        EngineZmqAddresses(["tcp://127.0.0.1:1"], ["tcp://127.0.0.1:2"]), {"x": 1}
    )
    assert decode_handshake_metadata(encode_handshake_metadata(meta)) == meta
    with pytest.raises(ValueError, match=r"same length|equal length"):
        encode_handshake_metadata(EngineHandshakeMetadata(EngineZmqAddresses(["a"], []), {}))
    with pytest.raises(ProtocolError, match="EngineHandshakeMetadata"):
        decode_handshake_metadata(msgspec.msgpack.encode({"addresses": {"inputs": []}}))
