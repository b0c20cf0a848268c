"""The sans-I/O client handshake state machine (protocol/handshake.py), frame by frame."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_vllm import ProtocolError
from trio_vllm.protocol.handshake import (
    ClientHandshake,
    EngineHello,
    EngineReady,
    HandshakeComplete,
    HandshakeState,
    RankState,
    ReadyResponseReceived,
    SendInitMetadata,
    encode_init_metadata,
    identity_for_rank,
    rank_for_identity,
)

VECTORS = Path(__file__).resolve().parents[3] / "shared" / "wire-vectors"
INPUTS = ["tcp://127.0.0.1:29601"]
OUTPUTS = ["tcp://127.0.0.1:29602"]

HELLO = msgspec.msgpack.encode({"status": "HELLO", "local": False, "headless": True})
READY = msgspec.msgpack.encode({"status": "READY", "local": False, "headless": True})


def _vector(version: str, name: str) -> list[bytes]:
    path = VECTORS / f"vllm-{version}" / f"{name}.json"
    if not path.exists():
        pytest.skip(f"wire vector {path} not available")
    data = json.loads(path.read_text())
    return [base64.b64decode(f) for f in data["frames_b64"]]


def _response(rank: int, version: str = "0.32.0") -> bytes:
    return msgspec.msgpack.encode(
        {"max_model_len": 256, "vllm_version": version, "data_parallel_rank": rank}
    )


def _machine(ranks: list[int] | None = None, **kw: object) -> ClientHandshake:
    return ClientHandshake(ranks or [0], inputs=INPUTS, outputs=OUTPUTS, **kw)  # type: ignore[arg-type]


def test_identity_roundtrip() -> None:
    assert identity_for_rank(0) == b"\x00\x00"
    assert identity_for_rank(258) == b"\x02\x01"
    assert rank_for_identity(b"\x02\x01") == 258
    with pytest.raises(ProtocolError, match="identity"):
        rank_for_identity(b"\x00")
    with pytest.raises(ValueError, match="2-byte"):
        identity_for_rank(70000)


@pytest.mark.parametrize("version", ["0.25.1", "0.32.0", "0.33.0"])
def test_init_metadata_is_byte_identical_to_vllm(version: str) -> None:
    (expected,) = _vector(version, "handshake_init_metadata")
    assert encode_init_metadata(inputs=INPUTS, outputs=OUTPUTS) == expected


def test_wildcard_addresses_are_refused() -> None:
    with pytest.raises(ValueError, match="wildcard"):
        encode_init_metadata(inputs=["tcp://0.0.0.0:1"], outputs=["tcp://127.0.0.1:2"])


@pytest.mark.parametrize("ready_first", [True, False])
def test_full_handshake_with_real_vectors(ready_first: bool) -> None:
    (hello,) = _vector("0.32.0", "handshake_hello_headless")
    (ready,) = _vector("0.32.0", "handshake_ready")
    (response,) = _vector("0.32.0", "ready_response")
    hs = _machine(expect_headless=True, expect_local=False)
    events = hs.receive_handshake(b"\x00\x00", hello)
    assert events[0] == EngineHello(0, local=False, headless=True)
    reply = events[1]
    assert isinstance(reply, SendInitMetadata)
    assert reply.identity == b"\x00\x00"
    assert reply.payload == _vector("0.32.0", "handshake_init_metadata")[0]
    assert hs.rank_state(0) is RankState.WAIT_READY
    if ready_first:
        events = hs.receive_handshake(b"\x00\x00", ready)
        assert [type(e) for e in events] == [EngineReady]
        assert hs.handshake_socket_done
        events = hs.receive_input(b"\x00\x00", response)
    else:
        events = hs.receive_input(b"\x00\x00", response)
        assert [type(e) for e in events] == [ReadyResponseReceived]
        assert not hs.handshake_socket_done
        events = hs.receive_handshake(b"\x00\x00", ready)
    done = events[-1]
    assert isinstance(done, HandshakeComplete)
    assert done.vllm_version == "0.32.0"
    assert done.ready_responses[0]["max_model_len"] == 256
    assert hs.state is HandshakeState.COMPLETE
    with pytest.raises(ProtocolError, match="complete"):
        hs.receive_input(b"\x00\x00", response)


def test_several_ranks_complete_only_when_all_are_ready() -> None:
    hs = _machine([2, 3])
    for ident in (b"\x02\x00", b"\x03\x00"):
        hs.receive_handshake(ident, HELLO)
    assert hs.connected == [2, 3]
    hs.receive_handshake(b"\x02\x00", READY)
    assert hs.receive_input(b"\x02\x00", _response(2))[-1] == ReadyResponseReceived(
        2, {"max_model_len": 256, "vllm_version": "0.32.0", "data_parallel_rank": 2}
    )
    assert "rank(s) [3]" in hs.describe_waiting()
    hs.receive_input(b"\x03\x00", b"")  # legacy empty ready response
    events = hs.receive_handshake(b"\x03\x00", READY)
    assert isinstance(events[-1], HandshakeComplete)
    assert events[-1].ready_responses[3] == {}


def _fails(
    hs: ClientHandshake,
    match: str,
    *,
    handshake: bytes | None = None,
    identity: bytes = b"\x00\x00",
    input_payload: bytes | None = None,
) -> None:
    if handshake is not None:
        with pytest.raises(ProtocolError, match=match):
            hs.receive_handshake(identity, handshake)
    else:
        assert input_payload is not None
        with pytest.raises(ProtocolError, match=match):
            hs.receive_input(identity, input_payload)
    assert hs.state is HandshakeState.ERROR
    with pytest.raises(ProtocolError, match="already failed"):
        hs.receive_handshake(b"\x00\x00", HELLO)


def test_unexpected_rank() -> None:
    _fails(_machine(), "unexpected data parallel rank: 5", handshake=HELLO, identity=b"\x05\x00")


def test_bad_identity_length() -> None:
    _fails(_machine(), "identity", handshake=HELLO, identity=b"abc")


def test_local_mismatch() -> None:
    _fails(_machine(expect_local=True), "expected it to be local", handshake=HELLO)


def test_headless_mismatch() -> None:
    hello = msgspec.msgpack.encode({"status": "HELLO", "local": True, "headless": False})
    _fails(_machine(expect_headless=True), "must use --headless", handshake=hello)


def test_ready_before_hello() -> None:
    _fails(_machine(), "Unexpected READY message .* WAIT_HELLO", handshake=READY)


def test_duplicate_hello() -> None:
    hs = _machine()
    hs.receive_handshake(b"\x00\x00", HELLO)
    _fails(hs, "Unexpected HELLO", handshake=HELLO)


def test_unknown_status() -> None:
    bad = msgspec.msgpack.encode({"status": "BYE", "local": False, "headless": True})
    _fails(_machine(), "unexpected handshake status 'BYE'", handshake=bad)


@pytest.mark.parametrize(
    "payload", [b"\xc1", b"\x93\x01\x02\x03", msgspec.msgpack.encode({"x": 1})]
)
def test_malformed_handshake_payload(payload: bytes) -> None:
    _fails(_machine(), "handshake message|cannot decode|not a map", handshake=payload)


def test_ready_response_before_hello() -> None:
    _fails(_machine(), "before its HELLO", input_payload=_response(0))


def test_ready_response_rank_mismatch() -> None:
    hs = _machine()
    hs.receive_handshake(b"\x00\x00", HELLO)
    _fails(hs, "reports data_parallel_rank 1", input_payload=_response(1))


def test_duplicate_ready_response() -> None:
    hs = _machine()
    hs.receive_handshake(b"\x00\x00", HELLO)
    hs.receive_input(b"\x00\x00", _response(0))
    _fails(hs, "second message", input_payload=_response(0))


def test_version_mismatch_between_engines() -> None:
    hs = _machine([0, 1])
    hs.receive_handshake(b"\x00\x00", HELLO)
    hs.receive_handshake(b"\x01\x00", HELLO)
    hs.receive_input(b"\x00\x00", _response(0, "0.32.0"))
    _fails(
        hs, "different vLLM versions", identity=b"\x01\x00", input_payload=_response(1, "0.25.1")
    )


def test_parallel_config_hash_mismatch() -> None:
    hs = _machine([0, 1])
    hs.receive_handshake(b"\x00\x00", HELLO)
    hs.receive_handshake(b"\x01\x00", HELLO)
    ready_a = msgspec.msgpack.encode(
        {"status": "READY", "local": False, "headless": True, "parallel_config_hash": "a"}
    )
    ready_b = msgspec.msgpack.encode(
        {"status": "READY", "local": False, "headless": True, "parallel_config_hash": "b"}
    )
    hs.receive_handshake(b"\x00\x00", ready_a)
    _fails(hs, "Configuration mismatch", handshake=ready_b, identity=b"\x01\x00")


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ClientHandshake([], inputs=INPUTS, outputs=OUTPUTS)
    with pytest.raises(ValueError, match="duplicate"):
        ClientHandshake([0, 0], inputs=INPUTS, outputs=OUTPUTS)
    with pytest.raises(ValueError, match="same length"):
        ClientHandshake([0], inputs=INPUTS, outputs=[])


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_any_valid_interleaving_completes_exactly_once(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 5), label="engines")
    start = data.draw(st.integers(0, 300), label="start rank")
    ranks = list(range(start, start + n))
    # Per rank: HELLO first, then READY and the ready response in either order.
    queues = {
        r: ["hello", *data.draw(st.permutations(["ready", "response"]), label=f"rank {r}")]
        for r in ranks
    }
    hs = _machine(ranks, expect_headless=True)
    replies: list[int] = []
    completions = 0
    remaining = sum(len(q) for q in queues.values())
    while remaining:
        rank = data.draw(st.sampled_from([r for r in ranks if queues[r]]), label="next")
        kind = queues[rank].pop(0)
        remaining -= 1
        identity = identity_for_rank(rank)
        if kind == "hello":
            events = hs.receive_handshake(identity, HELLO)
        elif kind == "ready":
            events = hs.receive_handshake(identity, READY)
        else:
            events = hs.receive_input(identity, _response(rank))
        replies += [e.rank for e in events if isinstance(e, SendInitMetadata)]
        done = [e for e in events if isinstance(e, HandshakeComplete)]
        completions += len(done)
        assert bool(done) == (remaining == 0)
    assert sorted(replies) == ranks
    assert completions == 1
    assert hs.state is HandshakeState.COMPLETE


# -- several frontends: the parent's handshake-only stage, a worker's input-only stage


def test_handshake_stage_completes_on_ready_and_advertises_every_frontend() -> None:
    inputs = ["ipc:///x/input0", "ipc:///x/input1"]
    outputs = ["ipc:///x/output0", "ipc:///x/output1"]
    hs = ClientHandshake([0, 1], inputs=inputs, outputs=outputs, stage="handshake")
    for rank in (0, 1):
        (_hello, reply) = hs.receive_handshake(identity_for_rank(rank), HELLO)
        assert isinstance(reply, SendInitMetadata)
        sent = msgspec.msgpack.decode(reply.payload)
        assert sent["addresses"]["inputs"] == inputs
        assert sent["addresses"]["outputs"] == outputs
    assert hs.receive_handshake(identity_for_rank(0), READY)[-1] == EngineReady(
        0, {"status": "READY", "local": False, "headless": True}
    )
    assert "no ready response" not in hs.describe_waiting()
    events = hs.receive_handshake(identity_for_rank(1), READY)
    assert events[-1] == HandshakeComplete({}, None)
    assert hs.state is HandshakeState.COMPLETE


def test_handshake_stage_refuses_input_messages() -> None:
    hs = _machine(stage="handshake")
    hs.receive_handshake(identity_for_rank(0), HELLO)
    with pytest.raises(ProtocolError, match="handshake-only"):
        hs.receive_input(identity_for_rank(0), _response(0))
    assert hs.state is HandshakeState.ERROR


def test_input_stage_completes_on_ready_responses_alone() -> None:
    hs = _machine([0, 1], stage="input")
    assert hs.handshake_socket_done
    assert hs.ready == [0, 1]
    (received,) = hs.receive_input(identity_for_rank(1), _response(1))
    assert received == ReadyResponseReceived(1, msgspec.msgpack.decode(_response(1)))
    assert "no ready response on the input socket yet from rank(s) [0]" in hs.describe_waiting()
    events = hs.receive_input(identity_for_rank(0), _response(0))
    assert isinstance(events[-1], HandshakeComplete)
    assert sorted(events[-1].ready_responses) == [0, 1]
    assert events[-1].vllm_version == "0.32.0"


def test_input_stage_refuses_handshake_messages_and_repeats() -> None:
    hs = _machine(stage="input")
    with pytest.raises(ProtocolError, match="attached client"):
        hs.receive_handshake(identity_for_rank(0), HELLO)
    hs2 = _machine([0, 1], stage="input")
    hs2.receive_input(identity_for_rank(0), _response(0))
    with pytest.raises(ProtocolError, match="second message"):
        hs2.receive_input(identity_for_rank(0), _response(0))
    with pytest.raises(ValueError, match="stage"):
        _machine(stage="nope")
