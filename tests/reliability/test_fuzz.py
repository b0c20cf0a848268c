"""Fuzzing the client from the engine's side of real sockets.

A :class:`~._peer.Peer` does the real handshake, then sends hypothesis-generated
messages on its output socket while the client has streams, a raw request and a utility
call in flight: valid outputs (for live ids, unknown ids, duplicate finishes, late
outputs, stray utility replies, oversized token lists), and broken ones (truncated,
type-confused, random bytes, a wrong ``engine_index``, ``ENGINE_CORE_DEAD``, extra aux
frames). Properties:

* only documented errors reach the caller: a stream ends normally or raises
  ``EngineDeadError``; the utility call returns or raises ``EngineDeadError``; a dead
  client's error has a ``ProtocolError`` cause (or none, for ``ENGINE_CORE_DEAD``);
* nothing escapes ``open_client`` (no crash outside the client's scope);
* valid messages never kill the client, and each stream delivers exactly the tokens sent
  for its id up to its first finish, in order; a broken message always does;
* memory stays bounded under a long run of valid-but-useless messages.

The decoder alone is fuzzed in tests/protocol/test_fuzz.py and, outside CI, with
atheris (``atheris_decoder.py``).
"""

from __future__ import annotations

import contextlib
import gc
import tracemalloc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from trio_vllm import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineDeadError,
    FinishReason,
    ProtocolError,
    UtilityOutput,
    UtilityResult,
    make_request,
)
from trio_vllm.protocol import UtilityCall

from ._peer import Peer, peer_client, peers_client

if TYPE_CHECKING:
    from trio_vllm import EngineCoreClient

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

STREAM_IDS = ("s0", "s1", "s2")
RAW_ID = "raw0"
KNOWN_IDS = (*STREAM_IDS, RAW_ID)

FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)


# ---------------------------------------------------------------------- the messages


@dataclass(frozen=True)
class Valid:
    """One valid EngineCoreOutputs message: (request id, tokens, finish) per output."""

    outputs: tuple[tuple[str, tuple[int, ...], int | None], ...]
    stray_call_id: int | None = None  # a utility reply for a call nobody made


@dataclass(frozen=True)
class Broken:
    """Frames that must kill the client (``kind`` says how they are broken)."""

    kind: str
    frames: tuple[bytes, ...]

    def __repr__(self) -> str:
        sizes = [len(f) for f in self.frames]
        head = [f[:24] for f in self.frames]
        return f"Broken({self.kind!r}, sizes={sizes}, head={head})"


@dataclass(frozen=True)
class Random:
    """Arbitrary frames: the client may accept or refuse them, but only as documented."""

    frames: tuple[bytes, ...]


ids = st.sampled_from((*KNOWN_IDS, "unknown", "late-9"))
tokens = st.lists(st.integers(0, 2**31 - 1), max_size=6).map(tuple)
finish = st.one_of(st.none(), st.sampled_from([int(f) for f in FinishReason]))
valid = st.builds(
    Valid,
    outputs=st.lists(st.tuples(ids, tokens, finish), max_size=4).map(tuple),
    stray_call_id=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
)
big = st.builds(
    Valid,
    outputs=st.tuples(
        st.tuples(st.sampled_from(STREAM_IDS), st.just(tuple(range(200_000))), st.none())
    ),
)

_PEER = Peer()


def _encode(message: Valid) -> list[bytes]:
    outputs = [
        EngineCoreOutput(
            rid, new_token_ids=list(toks), finish_reason=None if f is None else FinishReason(f)
        )
        for rid, toks, f in message.outputs
    ]
    fields: dict[str, Any] = {}
    if message.stray_call_id is not None and message.stray_call_id not in (-1, -2):
        fields["utility_output"] = UtilityOutput(
            message.stray_call_id, None, UtilityResult(None, 1)
        )
    return [bytes(f) for f in _PEER.encode(outputs, **fields)]


@st.composite
def broken(draw: st.DrawFn) -> Broken:
    main = _encode(draw(valid))[0]
    kind = draw(
        st.sampled_from(
            ["truncated", "engine_index", "type_confused", "not_msgpack", "dead", "empty"]
        )
    )
    if kind == "truncated":
        cut = draw(st.integers(0, len(main) - 1))
        return Broken(kind, (main[:cut],))
    if kind == "engine_index":
        wrong = msgspec.msgpack.decode(main)
        wrong[0] = draw(st.integers(1, 2**15))
        return Broken(kind, (msgspec.msgpack.encode(wrong),))
    if kind == "type_confused":
        body = msgspec.msgpack.decode(main)
        confusion = draw(st.sampled_from(["index_str", "outputs_map", "id_int", "tokens_str"]))
        if confusion == "index_str":
            body[0] = "zero"
        elif confusion == "outputs_map":
            body[1] = {"s0": [1]}
        elif confusion == "id_int":
            body[1] = [[7, [1], None]]
        else:
            body[1] = [["s0", ["one", "two"]]]
        return Broken(f"{kind}:{confusion}", (msgspec.msgpack.encode(body),))
    if kind == "not_msgpack":
        return Broken(kind, (b"\xc1" + draw(st.binary(max_size=64)),))
    if kind == "dead":
        return Broken(kind, (ENGINE_CORE_DEAD,))
    # An oversized garbage frame: 4 MiB that cannot be an EngineCoreOutputs.
    return Broken("oversized", (b"\x91" + b"\xc1" * (4 << 20),))


random_frames = st.builds(
    Random, frames=st.lists(st.binary(max_size=256), min_size=1, max_size=3).map(tuple)
)
with_aux = st.builds(
    Random,
    frames=st.tuples(valid.map(lambda m: _encode(m)[0]), st.binary(max_size=32)).map(tuple),
)
messages = st.lists(
    st.one_of(valid, valid, valid, broken(), random_frames, with_aux, big), max_size=8
)


# ---------------------------------------------------------------------- the property


@dataclass
class Expected:
    """What each stream must deliver if the client survives."""

    tokens: dict[str, list[int]] = field(default_factory=lambda: {i: [] for i in KNOWN_IDS})
    finished: set[str] = field(default_factory=set)

    def feed(self, message: Valid) -> None:
        for rid, toks, f in message.outputs:
            if rid in self.tokens and rid not in self.finished:
                self.tokens[rid].extend(toks)
                if f is not None:
                    self.finished.add(rid)


async def _run_example(sequence: list[Valid | Broken | Random]) -> str:
    """Run one example; return what became of the client (for hypothesis' statistics)."""
    async with peer_client(stream_buffer=4) as (client, peer):
        results: dict[str, Any] = {}

        async def consume(rid: str) -> None:
            got: list[int] = []
            try:
                async with client.generate(make_request([1], request_id=rid)) as stream:
                    async for out in stream:
                        got.extend(out.new_token_ids)
                results[rid] = got
            except EngineDeadError as exc:
                results[rid] = exc

        async def raw() -> None:
            got: list[int] = []
            try:
                while True:
                    batch = await client.get_output()
                    for out in batch.outputs:
                        assert out.request_id == RAW_ID, out.request_id
                        got.extend(out.new_token_ids)
                        if out.finish_reason is not None:
                            results[RAW_ID] = got
                            return
            except EngineDeadError as exc:
                results[RAW_ID] = exc

        async def utility() -> None:
            try:
                results["utility"] = await client.call_utility("echo", "u")
            except EngineDeadError as exc:
                results["utility"] = exc

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for rid in STREAM_IDS:
                    tg.start_soon(consume, rid)
                await client.add_request(make_request([1], request_id=RAW_ID))
                tg.start_soon(raw)
                peer.reply_utilities = False
                tg.start_soon(utility)
                await peer.wait_for(5)  # 3 streams, the raw ADD, the utility call
                (call,) = [m for m in peer.received if isinstance(m, UtilityCall)]
                expected = Expected()
                broke = False
                for message in sequence:
                    if isinstance(message, Valid):
                        await peer.send_frames(_encode(message))
                        if not broke:
                            expected.feed(message)
                    else:
                        await peer.send_frames(list(message.frames))
                        broke = broke or isinstance(message, Broken)
                # Finish everything and answer the call: a live client ends all of them.
                closing = Valid(tuple((rid, (), int(FinishReason.STOP)) for rid in KNOWN_IDS))
                await peer.send_frames(_encode(closing))
                await peer.reply(call, ["u"])
                if not broke:
                    expected.feed(closing)
        # Only documented outcomes.
        assert set(results) == {*KNOWN_IDS, "utility"}
        if client.dead:
            error = await client.wait_dead()
            assert error.__cause__ is None or isinstance(error.__cause__, ProtocolError), repr(
                error.__cause__
            )
            if error.__cause__ is None:
                assert "ENGINE_CORE_DEAD" in str(error)
        else:
            assert not broke, "a broken message did not kill the client"
        for rid in KNOWN_IDS:
            result = results[rid]
            if isinstance(result, EngineDeadError):
                assert client.dead
            elif not any(isinstance(m, Random) for m in sequence):
                # Valid traffic only (up to the first broken message): exact delivery.
                assert result == expected.tokens[rid], rid
        if not client.dead:
            assert results["utility"] == ["u"]
            assert client.live_requests == []
        assert client.pending_utility_calls == 0
        return "client died" if client.dead else "client survived"


@FUZZ
@given(sequence=messages)
async def test_fuzzed_engine_frames(sequence: list[Valid | Broken | Random]) -> None:
    event(await _run_example(sequence))


@pytest.mark.parametrize(
    "sequence",
    [
        pytest.param([Broken("dead", (ENGINE_CORE_DEAD,))], id="dead"),
        pytest.param([Broken("oversized", (b"\x91" + b"\xc1" * (4 << 20),))], id="oversized"),
        pytest.param(
            [Valid((("s0", (1, 2), 0), ("s0", (3,), 0), ("unknown", (4,), None)))],
            id="duplicate-finish-unknown-id",
        ),
        pytest.param([Valid((("s1", tuple(range(200_000)), None),))], id="big-valid"),
    ],
)
async def test_fuzz_corner_cases(sequence: list[Valid | Broken | Random]) -> None:
    """Fixed examples of each class, so they run even if hypothesis draws none."""
    await _run_example(sequence)


async def test_memory_stays_bounded_under_useless_traffic() -> None:
    """20,000 valid messages that route nowhere (unknown ids, outputs after a finish,
    duplicate finishes, replies to calls nobody made): the client stays alive and its
    traced memory does not grow with the message count."""
    async with peer_client() as (client, peer):
        async with client.generate(make_request([1], request_id="kept")) as stream:
            await peer.send(
                [EngineCoreOutput("kept", new_token_ids=[5], finish_reason=FinishReason.STOP)]
            )
            assert await stream.collect() == [5]
        useless = [
            _encode(Valid((("kept", (1, 2, 3), 0), ("unknown", (4,), None)), stray_call_id=77)),
            _encode(Valid((("late-9", tuple(range(50)), 1),))),
        ]

        async def blast(count: int) -> None:
            for i in range(count):
                await peer.send_frames(useless[i % 2])
            # A round trip through the same connection: everything before it was handled.
            peer.reply_utilities = True
            with anyio.fail_after(30):
                assert await client.call_utility("echo", "sync") == ["sync"]

        await blast(2_000)  # warm up caches and allocator pools
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            await blast(20_000)
            gc.collect()
            after = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        growth = after - before
        print(f"traced memory growth over 20,000 useless messages: {growth / 1024:.1f} KiB")
        assert not client.dead
        assert client.live_requests == []
        assert client.pending_utility_calls == 0
        assert growth < 256 * 1024, growth


# ---------------------------------------------------------------------- two engines


@dataclass(frozen=True)
class FromRank:
    """A message sent by the peer of ``rank``."""

    rank: int
    message: Valid | Broken


def _encode_from(rank: int, message: Valid) -> list[bytes]:
    frames = _encode(message)
    body = msgspec.msgpack.decode(frames[0])
    body[0] = rank  # engine_index: the sender's rank
    return [msgspec.msgpack.encode(body), *frames[1:]]


dp_messages = st.lists(
    st.builds(FromRank, rank=st.integers(0, 1), message=st.one_of(valid, valid, broken())),
    max_size=8,
)


async def _round_trip(client: EngineCoreClient, rank: int) -> None:
    """A utility call through ``rank``'s connection: when its reply is in, everything
    that engine sent before it has been handled (or the client is dead)."""
    with contextlib.suppress(EngineDeadError):
        assert await client.call_utility("echo", "sync", rank=rank) == ["sync"]


@FUZZ
@given(sequence=dp_messages)
async def test_fuzzed_frames_from_two_engines(sequence: list[FromRank]) -> None:
    """Two data-parallel peers, a stream on each rank: outputs are routed by request id
    whichever engine sends them; valid traffic from both keeps the client alive with
    exact delivery; a broken message from either kills it with a documented error."""
    async with peers_client(2, stream_buffer=4) as (client, peers):
        results: dict[str, Any] = {}

        async def consume(rid: str, rank: int) -> None:
            got: list[int] = []
            try:
                async with client.generate(make_request([1], request_id=rid), rank=rank) as s:
                    async for out in s:
                        got.extend(out.new_token_ids)
                results[rid] = got
            except EngineDeadError as exc:
                results[rid] = exc

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume, "s0", 0)
                tg.start_soon(consume, "s1", 1)
                for peer in peers:
                    await peer.wait_for(1)
                expected = Expected()
                broke = False
                last_rank: int | None = None
                for item in sequence:
                    peer = peers[item.rank]
                    if not broke and last_rank is not None and item.rank != last_rank:
                        # Two connections are not ordered with each other: let everything
                        # the previous engine sent be handled before the next one sends.
                        await _round_trip(client, last_rank)
                    last_rank = item.rank
                    if isinstance(item.message, Valid):
                        await peer.send_frames(_encode_from(item.rank, item.message))
                        if not broke:
                            expected.feed(item.message)
                    else:
                        await peer.send_frames(list(item.message.frames))
                        broke = True
                for peer in peers:
                    if not broke and last_rank is not None and peer.rank != last_rank:
                        await _round_trip(client, last_rank)
                    last_rank = peer.rank
                    closing = Valid(tuple((rid, (), 0) for rid in ("s0", "s1")))
                    await peer.send_frames(_encode_from(peer.rank, closing))
                    if not broke:
                        expected.feed(closing)
            # A round trip through each peer's connection: everything it sent before has
            # been handled (or the client is dead).
            for rank in (0, 1):
                try:
                    assert await client.call_utility("echo", "sync", rank=rank) == ["sync"]
                except EngineDeadError:
                    break
        if client.dead:
            error = await client.wait_dead()
            assert error.__cause__ is None or isinstance(error.__cause__, ProtocolError)
        else:
            assert not broke, f"a broken message did not kill the client: {results}"
            assert client.live_requests == []
        for rid in ("s0", "s1"):
            result = results[rid]
            if isinstance(result, EngineDeadError):
                assert client.dead
            elif not broke:
                assert result == expected.tokens[rid], rid
            else:
                # Two connections are not ordered with each other: a stream may have
                # finished on the other engine's messages before the broken one arrived.
                assert isinstance(result, list), result
        event("client died" if client.dead else "client survived")
