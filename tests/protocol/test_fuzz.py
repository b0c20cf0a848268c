"""Fuzzing the decoders: the only outcomes are a decoded message or ProtocolError.

Inputs: random bytes, random frame lists, random msgpack values of the wrong shape,
valid messages truncated, mutated, with frames dropped or added, and headers that
declare huge sizes. Example counts are kept small so the suite stays fast on 2 cores.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_vllm import ProtocolError
from trio_vllm.protocol import (
    V0_25_1,
    V0_32_0,
    V0_33_0,
    AbortRequests,
    ClientCodec,
    EngineCodec,
    EngineCoreDead,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineHandshakeMetadata,
    HandshakeHello,
    HandshakeReady,
    LogprobsLists,
    LoRARequest,
    PoolingParams,
    SamplingParams,
    StartDPWave,
    UtilityCall,
    UtilityOutput,
    UtilityResult,
    decode_handshake_metadata,
    decode_hello,
    decode_ready,
    decode_ready_response,
)

FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILES = (V0_25_1, V0_32_0, V0_33_0)
CLIENTS = [ClientCodec(p) for p in PROFILES]
ENGINES = [EngineCodec(p) for p in PROFILES]
INPUT_TYPES = (AbortRequests, EngineCoreRequest, StartDPWave, UtilityCall)


def _valid_outputs(engine: EngineCodec) -> list[list[bytes]]:
    lp = LogprobsLists(
        np.arange(128, dtype=np.int32).reshape(16, 8),
        np.zeros((16, 8), dtype=np.float32),
        np.arange(16, dtype=np.int32),
        [0, 16],
    )
    messages = [
        EngineCoreOutputs(outputs=[EngineCoreOutput(f"r{i}", [i]) for i in range(4)]),
        EngineCoreOutputs(outputs=[EngineCoreOutput("lp", list(range(16)), new_logprobs=lp)]),
        EngineCoreOutputs(
            outputs=[EngineCoreOutput("p", [], pooling_output=np.ones(8, np.float32))]
        ),
        EngineCoreOutputs(utility_output=UtilityOutput(3, None, UtilityResult(None, [1, "a"]))),
    ]
    return [[bytes(f) for f in engine.encode_outputs(m)] for m in messages]


def _valid_inputs(client: ClientCodec) -> list[list[bytes]]:
    sp = SamplingParams(max_tokens=4, temperature=0.5, stop=["x"], logit_bias={3: 1.0})
    messages = [
        client.encode_add(EngineCoreRequest("a", prompt_token_ids=[1, 2], sampling_params=sp)),
        client.encode_add(
            EngineCoreRequest(
                "b",
                prompt_embeds=np.ones((8, 16), dtype=np.float32),
                pooling_params=PoolingParams(task="embed"),
                lora_request=LoRARequest("l", 1, "/p"),
            )
        ),
        client.encode_abort(["a", "b"]),
        client.encode_utility(0, 9, "add_lora", [LoRARequest("l", 1, "/p")]),
        client.encode_start_dp_wave(2, 1),
    ]
    return [[bytes(f) for f in m] for m in messages]


VALID_OUTPUTS = [(i, m) for i, e in enumerate(ENGINES) for m in _valid_outputs(e)]
VALID_INPUTS = [(i, m) for i, c in enumerate(CLIENTS) for m in _valid_inputs(c)]


def _decode_outputs(index: int, frames: Any) -> None:
    try:
        result = CLIENTS[index].decode_outputs(frames)
    except ProtocolError:
        return
    assert isinstance(result, EngineCoreOutputs | EngineCoreDead)


def _decode_input(index: int, frames: Any) -> None:
    try:
        result = ENGINES[index].decode_input(frames)
    except ProtocolError:
        return
    assert isinstance(result, INPUT_TYPES)


def _decode_startup(frame: bytes) -> None:
    for fn, tp in (
        (decode_ready_response, EngineCoreReadyResponse),
        (decode_hello, HandshakeHello),
        (decode_ready, HandshakeReady),
        (decode_handshake_metadata, EngineHandshakeMetadata),
    ):
        try:
            result = fn(frame)
        except ProtocolError:
            continue
        assert isinstance(result, tp)


profile_index = st.integers(0, len(PROFILES) - 1)
frames_st = st.lists(st.binary(max_size=64), max_size=5)

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=8)),
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(st.text(max_size=4) | st.integers(-3, 3), inner, max_size=4)
    ),
    max_leaves=25,
)


def _packb(value: Any) -> bytes:
    # Integers outside msgpack's range cannot be encoded; clamp them.
    try:
        return msgspec.msgpack.encode(value)
    except OverflowError:
        return msgspec.msgpack.encode(None)


@FUZZ
@given(profile_index, frames_st)
def test_random_frames_outputs(index: int, frames: list[bytes]) -> None:
    _decode_outputs(index, frames)


@FUZZ
@given(profile_index, st.binary(max_size=1), frames_st)
def test_random_frames_input(index: int, head: bytes, frames: list[bytes]) -> None:
    _decode_input(index, [head, *frames])


@FUZZ
@given(st.binary(max_size=128))
def test_random_bytes_startup(frame: bytes) -> None:
    _decode_startup(frame)


@FUZZ
@given(profile_index, msgpack_values, st.lists(st.binary(max_size=16), max_size=3))
def test_wrong_types_outputs(index: int, value: Any, aux: list[bytes]) -> None:
    _decode_outputs(index, [_packb(value), *aux])


@FUZZ
@given(profile_index, st.sampled_from([b"\x00", b"\x01", b"\x02", b"\x03"]), msgpack_values)
def test_wrong_types_input(index: int, head: bytes, value: Any) -> None:
    _decode_input(index, [head, _packb(value)])


@FUZZ
@given(msgpack_values)
def test_wrong_types_startup(value: Any) -> None:
    _decode_startup(_packb(value))


@FUZZ
@given(st.sampled_from(VALID_OUTPUTS), st.data())
def test_truncated_and_mutated_outputs(case: tuple[int, list[bytes]], data: st.DataObject) -> None:
    index, frames = case
    frames = list(frames)
    which = data.draw(st.integers(0, len(frames) - 1))
    frame = bytearray(frames[which])
    action = data.draw(st.sampled_from(["truncate", "flip", "drop", "add", "insert"]))
    if action == "truncate":
        frame = frame[: data.draw(st.integers(0, max(0, len(frame) - 1)))]
    elif action == "flip" and frame:
        for _ in range(data.draw(st.integers(1, 4))):
            pos = data.draw(st.integers(0, len(frame) - 1))
            frame[pos] = data.draw(st.integers(0, 255))
    elif action == "insert":
        pos = data.draw(st.integers(0, len(frame)))
        frame[pos:pos] = data.draw(st.binary(min_size=1, max_size=6))
    frames[which] = bytes(frame)
    if action == "drop" and len(frames) > 1:
        del frames[data.draw(st.integers(0, len(frames) - 1))]
    elif action == "add":
        frames.append(data.draw(st.binary(max_size=32)))
    _decode_outputs(index, frames)


@FUZZ
@given(st.sampled_from(VALID_INPUTS), st.data())
def test_truncated_and_mutated_inputs(case: tuple[int, list[bytes]], data: st.DataObject) -> None:
    index, frames = case
    frames = list(frames)
    which = data.draw(st.integers(0, len(frames) - 1))
    frame = bytearray(frames[which])
    if data.draw(st.booleans()):
        frame = frame[: data.draw(st.integers(0, max(0, len(frame) - 1)))]
    elif frame:
        pos = data.draw(st.integers(0, len(frame) - 1))
        frame[pos] = data.draw(st.integers(0, 255))
    frames[which] = bytes(frame)
    if data.draw(st.booleans()) and len(frames) > 1:
        del frames[-1]
    _decode_input(index, frames)


_HUGE_HEADERS = [
    b"\xdd" + struct.pack(">I", 0xFFFFFFFF),  # array32
    b"\xdf" + struct.pack(">I", 0xFFFFFFFF),  # map32
    b"\xdb" + struct.pack(">I", 0xFFFFFFFF),  # str32
    b"\xc6" + struct.pack(">I", 0xFFFFFFFF),  # bin32
    b"\xc9" + struct.pack(">I", 0xFFFFFFFF) + b"\x03",  # ext32, raw-view
    b"\xdc\xff\xff",  # array16
]


@FUZZ
@given(st.sampled_from(VALID_OUTPUTS), st.sampled_from(_HUGE_HEADERS), st.data())
def test_huge_declared_sizes(
    case: tuple[int, list[bytes]], header: bytes, data: st.DataObject
) -> None:
    index, frames = case
    main = frames[0]
    pos = data.draw(st.integers(0, len(main)))
    replace = data.draw(st.integers(0, 3))
    mutated = main[:pos] + header + main[pos + replace :]
    _decode_outputs(index, [mutated, *frames[1:]])
    _decode_startup(mutated)


@FUZZ
@given(
    profile_index,
    st.lists(st.integers(0, 2**32), min_size=0, max_size=6),
    st.sampled_from(["float32", "bfloat16", "<f4", "int64", "float8_e4m3fn", "bogus", "O", "V8"]),
    st.one_of(st.integers(-2, 5), st.binary(max_size=64)),
)
def test_tensor_triples(index: int, shape: list[int], dtype: str, data: Any) -> None:
    payload: Any = data if isinstance(data, int) else msgspec.msgpack.Ext(3, data)
    triple = [dtype, shape, payload]
    out = [
        "r",
        [],
        [triple, triple, triple, None],
        None,
        triple,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        triple,
        0,
    ]
    main = msgspec.msgpack.encode([0, [out], None, 1.0])
    _decode_outputs(index, [main, b"\x00" * 8, b"\x00" * 16])


def test_deep_nesting_is_a_protocol_error() -> None:
    deep = b"\x91" * 200_000 + b"\xc0"
    main = msgspec.msgpack.encode([0, [], None, 1.0, [1, None, [None, None]]])
    # Nest inside the Any-typed utility value.
    nested = main[:-2] + b"\x92\xc0" + deep
    for index in range(len(PROFILES)):
        _decode_outputs(index, [nested])
        _decode_outputs(index, [deep])


@pytest.mark.parametrize("frames", [None, 5, "abc", [None], [5], [object()], iter([b"x"])])
def test_non_frames_are_protocol_errors(frames: Any) -> None:
    with pytest.raises(ProtocolError):
        CLIENTS[2].decode_outputs(frames)
    with pytest.raises(ProtocolError):
        ENGINES[2].decode_input(frames)
