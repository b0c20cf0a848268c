"""Issue 16 class (d): every argument of every public entry point, table-driven.

Each row gives an entry point a value of the wrong type, NaN, infinity, a negative, a
huge value, a bool where an int belongs or the wrong unit, and expects ``TypeError`` or
``ValueError`` naming the argument, before any engine process starts (the sources here
record a spawn and fail it) and, for a running client, before anything is sent (the
peer engine sees only the sentinel afterwards). Issue 16 item 7: ``shutdown_grace="5"``
and ``nan`` were accepted and failed only at exit, inside an exception group, with the
engine left running (``"5"``) or a zombie (NaN on trio).
"""

from __future__ import annotations

import datetime
import math
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from trio_vllm import (
    ExternalEngines,
    ReferenceEngines,
    VllmEngines,
    make_request,
    open_client,
)
from trio_vllm.protocol import UtilityCall

from ._peer import peer_client

if TYPE_CHECKING:
    from trio_vllm.client._process import EngineProcess

pytestmark = pytest.mark.timeout(60)

ARGS = ("argument", "value", "error", "names")
NAN = math.nan
INF = math.inf


class RecordingSource(ReferenceEngines):
    """A reference-engine source that records a spawn and refuses it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(1, model="echo", **kwargs)
        self.spawned = False

    async def spawn(self, handshake_address: str) -> list[EngineProcess]:
        self.spawned = True
        raise AssertionError("an engine was started despite a bad argument")


# (argument, value, exception, what the message must name)
OPEN_CLIENT: list[tuple[str, Any, type[Exception], str]] = [
    ("ready_timeout", "5", TypeError, "ready_timeout"),
    ("ready_timeout", NAN, ValueError, "ready_timeout"),
    ("ready_timeout", INF, ValueError, "ready_timeout"),
    ("ready_timeout", -1, ValueError, "ready_timeout"),
    ("ready_timeout", 0, ValueError, "ready_timeout"),
    ("ready_timeout", 1e12, ValueError, "ready_timeout"),
    ("ready_timeout", True, TypeError, "ready_timeout"),
    ("ready_timeout", datetime.timedelta(seconds=5), TypeError, "ready_timeout"),
    ("shutdown_grace", "5", TypeError, "shutdown_grace"),
    ("shutdown_grace", NAN, ValueError, "shutdown_grace"),
    ("shutdown_grace", INF, ValueError, "shutdown_grace"),
    ("shutdown_grace", -0.5, ValueError, "shutdown_grace"),
    ("shutdown_grace", 5000.0, ValueError, "shutdown_grace"),  # milliseconds
    ("shutdown_grace", None, TypeError, "shutdown_grace"),
    ("shutdown_grace", False, TypeError, "shutdown_grace"),
    ("stream_buffer", 0, ValueError, "stream_buffer"),
    ("stream_buffer", -1, ValueError, "stream_buffer"),
    ("stream_buffer", 1.5, TypeError, "stream_buffer"),
    ("stream_buffer", True, TypeError, "stream_buffer"),
    ("stream_buffer", "64", TypeError, "stream_buffer"),
    ("stream_buffer", 1 << 40, ValueError, "stream_buffer"),
    ("profile", 32, TypeError, "profile"),
    ("profile", "banana", ValueError, "profile"),
    ("profile", "0.1.0", ValueError, "profile"),
    ("allow_insecure_serialization", "yes", TypeError, "allow_insecure_serialization"),
    ("allow_insecure_serialization", 1, TypeError, "allow_insecure_serialization"),
    ("on_progress", "print", TypeError, "on_progress"),
    ("on_engine_death", "ignore", ValueError, "on_engine_death"),
    ("on_engine_death", None, TypeError, "on_engine_death"),
    ("waves", 1, TypeError, "waves"),
    ("waves", "true", TypeError, "waves"),
    ("vocab_size", 0, ValueError, "vocab_size"),
    ("vocab_size", -5, ValueError, "vocab_size"),
    ("vocab_size", 151936.0, TypeError, "vocab_size"),
    ("vocab_size", NAN, TypeError, "vocab_size"),
    ("vocab_size", True, TypeError, "vocab_size"),
    ("vocab_size", 1 << 40, ValueError, "vocab_size"),
    ("hang_timeout", 0, ValueError, "hang_timeout"),
    ("hang_timeout", 0.05, ValueError, "hang_timeout"),
    ("hang_timeout", -1.0, ValueError, "hang_timeout"),
    ("hang_timeout", NAN, ValueError, "hang_timeout"),
    ("hang_timeout", INF, ValueError, "hang_timeout"),
    ("hang_timeout", 1e9, ValueError, "hang_timeout"),
    ("hang_timeout", "30", TypeError, "hang_timeout"),
    ("hang_timeout", True, TypeError, "hang_timeout"),
    ("stall_timeout", 0, ValueError, "stall_timeout"),
    ("stall_timeout", NAN, ValueError, "stall_timeout"),
    ("stall_timeout", "60", TypeError, "stall_timeout"),
    ("stall_timeout", False, TypeError, "stall_timeout"),
]


def _id(row: tuple[Any, ...]) -> str:
    return f"{row[0]}={row[1]!r}"


@pytest.mark.anyio
@pytest.mark.parametrize(ARGS, OPEN_CLIENT, ids=map(_id, OPEN_CLIENT))
async def test_open_client_arguments(
    argument: str, value: Any, error: type[Exception], names: str
) -> None:
    source = RecordingSource()
    with pytest.raises(error, match=names):
        async with open_client(source, **{argument: value}):
            pytest.fail("open_client must refuse the argument")
    assert not source.spawned


ENGINES: list[tuple[str, Any, type[Exception], str]] = [
    ("engines", None, TypeError, "engines"),
    ("engines", [], ValueError, "engines"),
    ("engines", "echo", TypeError, "engines"),
    ("engines", ReferenceEngines, TypeError, "engines"),
    ("engines", "mixed", TypeError, r"engines\[1\]"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("argument", "value", "error", "names"), ENGINES, ids=map(_id, ENGINES))
async def test_open_client_engines_argument(
    argument: str, value: Any, error: type[Exception], names: str
) -> None:
    source = RecordingSource()
    engines = [source, "not a source"] if value == "mixed" else value
    with pytest.raises(error, match=names):
        async with open_client(engines):
            pytest.fail("open_client must refuse the argument")
    assert not source.spawned


@pytest.mark.anyio
@pytest.mark.parametrize("value", ["nan", "abc", "-1", "inf", "0"])
async def test_ready_timeout_environment_variable(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_ENGINE_READY_TIMEOUT_S", value)
    source = RecordingSource()
    with pytest.raises(ValueError, match="VLLM_ENGINE_READY_TIMEOUT_S"):
        async with open_client(source):
            pytest.fail("open_client must refuse the variable")
    assert not source.spawned


REFERENCE: list[tuple[str, Any, type[Exception], str]] = [
    ("count", 0, ValueError, "count"),
    ("count", -1, ValueError, "count"),
    ("count", True, TypeError, "count"),
    ("count", 1.0, TypeError, "count"),
    ("count", "2", TypeError, "count"),
    ("count", 70000, ValueError, "count"),
    ("start_rank", -1, ValueError, "start_rank"),
    ("start_rank", True, TypeError, "start_rank"),
    ("start_rank", 65535.0, TypeError, "start_rank"),
    ("start_rank", 65535, ValueError, "2-byte"),  # with count 1 it fits; 2 below
    ("model", "gpt-2", ValueError, "model"),
    ("model", None, TypeError, "model"),
    ("device", "tpu", ValueError, "device"),
    ("device", 0, TypeError, "device"),
    ("faults", "--die-after-steps 3", TypeError, "faults"),
    ("faults", ["--die-after-steps", 3], TypeError, "faults"),
    ("extra_args", "--seed 1", TypeError, "extra_args"),
    ("extra_args", None, TypeError, "extra_args"),
    ("protocol", "0.99.0", ValueError, "protocol"),
    ("protocol", 32, TypeError, "protocol"),
    ("python", "", ValueError, "python"),
    ("python", 3, TypeError, "python"),
    ("env", {"A": 1}, TypeError, "env"),
    ("env", "A=1", TypeError, "env"),
    ("env", {"A=B": "1"}, ValueError, "env"),
    ("transport", "udp", ValueError, "transport"),
]


@pytest.mark.parametrize(ARGS, REFERENCE, ids=map(_id, REFERENCE))
def test_reference_engines_arguments(
    argument: str, value: Any, error: type[Exception], names: str
) -> None:
    kwargs: dict[str, Any] = {argument: value}
    if argument == "start_rank" and value == 65535:
        kwargs["count"] = 2
    with pytest.raises(error, match=names):
        ReferenceEngines(**kwargs)


VLLM: list[tuple[str, Any, type[Exception], str]] = [
    ("model", None, TypeError, "model"),
    ("model", "", ValueError, "model"),
    ("python", None, TypeError, "python"),
    ("python", " ", ValueError, "python"),
    ("extra_args", "--dtype float32", TypeError, "extra_args"),
    ("count", 0, ValueError, "count"),
    ("count", False, TypeError, "count"),
    ("start_rank", -2, ValueError, "start_rank"),
    ("env", {"VLLM_CPU_KVCACHE_SPACE": 1}, TypeError, "env"),
]


@pytest.mark.parametrize(("argument", "value", "error", "names"), VLLM, ids=map(_id, VLLM))
def test_vllm_engines_arguments(
    argument: str, value: Any, error: type[Exception], names: str
) -> None:
    kwargs: dict[str, Any] = {"model": "/models/x", "python": "/usr/bin/python3"}
    kwargs[argument] = value
    model = kwargs.pop("model")
    with pytest.raises(error, match=names):
        VllmEngines(model, **kwargs)


EXTERNAL: list[tuple[str, Any, type[Exception], str]] = [
    ("handshake_address", "127.0.0.1:5000", ValueError, "handshake_address"),
    ("handshake_address", "tcp://127.0.0.1:99999", ValueError, "handshake_address"),
    ("handshake_address", "tcp://127.0.0.1", ValueError, "handshake_address"),
    ("handshake_address", 5000, TypeError, "handshake_address"),
    ("count", 0, ValueError, "count"),
    ("count", 2.0, TypeError, "count"),
    ("start_rank", -1, ValueError, "start_rank"),
    ("advertise_host", 5, TypeError, "advertise_host"),
    ("bind_host", "", ValueError, "bind_host"),
]


@pytest.mark.parametrize(("argument", "value", "error", "names"), EXTERNAL, ids=map(_id, EXTERNAL))
def test_external_engines_arguments(
    argument: str, value: Any, error: type[Exception], names: str
) -> None:
    kwargs: dict[str, Any] = {"handshake_address": "tcp://127.0.0.1:5000", argument: value}
    address = kwargs.pop("handshake_address")
    with pytest.raises(error, match=names):
        ExternalEngines(address, **kwargs)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("attribute", "value", "names"),
    [("faults", "--oov-fatal", "faults"), ("count", 0, "count"), ("model", 3, "model")],
)
async def test_open_client_rechecks_a_changed_source(
    attribute: str, value: Any, names: str
) -> None:
    """A source changed after construction is checked again by open_client."""
    source = RecordingSource()
    setattr(source, attribute, value)
    with pytest.raises((TypeError, ValueError), match=names):
        async with open_client(source):
            pytest.fail("open_client must refuse the source")
    assert not source.spawned


# ---------------------------------------------------------------------- a running client


ADD_ENGINES: list[tuple[str, Any, type[Exception], str]] = [
    ("source", None, TypeError, "source"),
    ("source", "tcp://127.0.0.1:5000", TypeError, "source"),
    ("ready_timeout", "30", TypeError, "ready_timeout"),
    ("ready_timeout", NAN, ValueError, "ready_timeout"),
    ("ready_timeout", -1.0, ValueError, "ready_timeout"),
    ("ready_timeout", INF, ValueError, "ready_timeout"),
]

RUNNING: list[tuple[str, Any, type[Exception], str]] = [
    ("retire_rank", True, TypeError, "rank"),
    ("retire_rank", "0", TypeError, "rank"),
    ("retire_rank", -1, ValueError, "rank"),
    ("call_utility(rank=)", True, TypeError, "rank"),
    ("call_utility(rank=)", 1.0, TypeError, "rank"),
    ("add_request(rank=)", True, TypeError, "rank"),
    ("generate(rank=)", True, TypeError, "rank"),
    ("generate(max_pending=)", 0, ValueError, "max_pending"),
    ("generate(max_pending=)", True, TypeError, "max_pending"),
    ("generate(max_pending=)", 2.5, TypeError, "max_pending"),
    ("abort_requests(rank=)", 7, ValueError, "rank 7"),
    ("abort_requests(rank=)", True, TypeError, "rank"),
]


@pytest.mark.anyio
async def test_running_client_arguments() -> None:
    """``add_engines`` and the rank arguments of a running client: refused before any
    process starts and before anything is sent; the client is unchanged."""
    async with peer_client() as (client, peer):
        for argument, value, error, names in ADD_ENGINES:
            source: Any = RecordingSource(start_rank=1)
            kwargs: dict[str, Any] = {}
            if argument == "source":
                source = value
            else:
                kwargs[argument] = value
            with pytest.raises(error, match=names):
                await client.add_engines(source, **kwargs)
            assert not getattr(source, "spawned", False)
        for entry, value, error, names in RUNNING:
            with pytest.raises(error, match=names):
                await _call_with_rank(client, entry, value)
        assert client.ranks == [0]
        assert not client.dead
        assert client.live_requests == []
        with anyio.fail_after(30):
            assert await client.call_utility("echo", "sentinel") == ["sentinel"]
        assert len(peer.received) == 1, peer.received
        assert isinstance(peer.received[0], UtilityCall)


async def _call_with_rank(client: Any, entry: str, rank: Any) -> None:
    request = make_request([1, 2], max_tokens=2, request_id="r")
    if entry == "retire_rank":
        await client.retire_rank(rank)
    elif entry == "call_utility(rank=)":
        await client.call_utility("echo", 1, rank=rank)
    elif entry == "add_request(rank=)":
        await client.add_request(request, rank=rank)
    elif entry == "generate(rank=)":
        async with client.generate(request, rank=rank):
            pytest.fail("generate must refuse the rank")
    elif entry == "generate(max_pending=)":
        async with client.generate(request, max_pending=rank):
            pytest.fail("generate must refuse max_pending")
    else:
        await client.abort_requests(["r"], rank=rank)


@pytest.mark.anyio
@pytest.mark.parametrize("grace", ["5", NAN])
async def test_issue16_item7_shutdown_grace_refused_before_the_engine_starts(
    grace: Any,
) -> None:
    """Issue 16 item 7, exactly: a real reference-engine source with
    ``shutdown_grace="5"`` or NaN is refused at once (it was accepted, the engine started,
    and at exit "5" left it running and NaN left a zombie)."""

    class Watched(ReferenceEngines):
        spawned = False

        async def spawn(self, handshake_address: str) -> list[EngineProcess]:
            self.spawned = True
            return await super().spawn(handshake_address)

    source = Watched(1, model="echo")
    with pytest.raises((TypeError, ValueError), match="shutdown_grace"):
        async with open_client(source, shutdown_grace=grace):
            pytest.fail("open_client must refuse shutdown_grace")
    assert not source.spawned
