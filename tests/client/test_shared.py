"""Engines shared by several frontends (`open_shared_engines`, `AttachedEngines`).

Real reference-engine processes; the two frontends run in this process (two clients,
each with its own sockets and ``client_index``), which is what the wire sees from two
processes too. The server test (tests/server/test_api_servers.py) runs them in two
processes.
"""

from __future__ import annotations

import os
import pickle
import signal
from typing import TYPE_CHECKING

import anyio
import pytest
import zmq

from trio_vllm import EngineDeadError
from trio_vllm.client import (
    AttachedEngines,
    EngineAttachment,
    ReferenceEngines,
    make_request,
    open_client,
    open_shared_engines,
)
from trio_vllm.testing import EngineControl
from trio_vllm.transport import PrivateIpcDir

if TYPE_CHECKING:
    from collections.abc import Iterator

    from trio_vllm.client import EngineCoreClient

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def control_dir() -> Iterator[PrivateIpcDir]:
    directory = PrivateIpcDir()
    yield directory
    directory.cleanup()


async def _answer(client: EngineCoreClient, tokens: list[int], n: int) -> list[int]:
    request = make_request(tokens, max_tokens=n)
    got: list[int] = []
    async with client.generate(request) as stream:
        async for out in stream:
            got.extend(out.new_token_ids)
    return got


def test_attachment_is_picklable_and_json() -> None:
    attachment = EngineAttachment((0, 1), ("ipc:///a/i0", "ipc:///a/i1"), ("o0", "o1"))
    assert pickle.loads(pickle.dumps(attachment)) == attachment
    assert EngineAttachment.from_json(attachment.to_json()) == attachment
    assert attachment.client_count == 2
    source = attachment.client(1)
    assert isinstance(source, AttachedEngines)
    assert (source.ranks, source.client_index, source.client_count) == ([0, 1], 1, 2)
    assert source.layout().attach == ("ipc:///a/i1", "o1")
    with pytest.raises(ValueError, match="client_index"):
        attachment.client(2)
    with pytest.raises(ValueError, match="not an engine attachment"):
        EngineAttachment.from_json('{"ranks": []}')


async def test_two_frontends_share_one_engine(control_dir: PrivateIpcDir) -> None:
    control_address = control_dir.endpoint("control")
    engines = ReferenceEngines(
        extra_args=["--control-address", control_address, "--step-interval-ms", "5"]
    )
    async with open_shared_engines(engines, clients=2) as shared:
        assert shared.attachment.client_count == 2
        (pid,) = shared.engine_pids.values()
        control = EngineControl(rank=0, address=control_address, pid=pid, context=_context())
        async with (
            open_client(shared.attachment.client(0)) as first,
            open_client(shared.attachment.client(1)) as second,
        ):
            # Every request answered, each on its own frontend, all at once.
            results: dict[tuple[int, int], list[int]] = {}

            async def ask(index: int, client: EngineCoreClient, i: int) -> None:
                results[index, i] = await _answer(client, [10 + index, 20 + i], 6)

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(ask, 0, first, i)
                    tg.start_soon(ask, 1, second, i)
            for (index, i), tokens in results.items():
                assert tokens == ([10 + index, 20 + i] * 3)[:6]  # echo repeats the prompt
            assert len(results) == 8

            # A request left early on either frontend is aborted at the engine.
            for client in (first, second):
                request = make_request([1, 2, 3], max_tokens=100_000)
                async with client.generate(request) as stream:
                    async for _out in stream:
                        break
                await control.wait_idle(within=10)

            # The engine dies: both frontends' streams end, the parent sees it.
            errors: list[BaseException] = []

            async def stream_until_dead(client: EngineCoreClient, streaming: anyio.Event) -> None:
                request = make_request([4, 5], max_tokens=100_000)
                try:
                    async with client.generate(request) as stream:
                        async for _out in stream:
                            streaming.set()
                except EngineDeadError as exc:
                    errors.append(exc)

            events = [anyio.Event(), anyio.Event()]
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream_until_dead, first, events[0])
                tg.start_soon(stream_until_dead, second, events[1])
                for event in events:
                    await event.wait()
                os.kill(pid, signal.SIGKILL)
            assert len(errors) == 2
            dead = await shared.wait_dead()
            assert shared.dead
            assert "killed by SIGKILL" in str(dead)


def _context() -> zmq.Context[zmq.Socket[bytes]]:
    return zmq.Context.instance()


def test_wire_stamps_the_client_index_on_adds_and_utilities() -> None:
    from trio_vllm.client._wire import Wire
    from trio_vllm.protocol import EngineCodec

    wire = Wire.create(profile=None, vllm_version="0.32.0", allow_insecure_serialization=False)
    wire.client_index, wire.client_count = 1, 2
    wire.set_limits({0: {"max_model_len": 256}})
    request = make_request([1, 2], max_tokens=4)
    assert request.client_index == 0
    wire.validate_request(request)
    engine = EngineCodec()
    added = engine.decode_input([bytes(f) for f in wire.encode_add(request)])
    assert added.client_index == 1  # type: ignore[union-attr]
    call = engine.decode_input(
        [bytes(f) for f in wire.encode_utility(wire.client_index, 7, "is_sleeping", [])]
    )
    assert call.client_index == 1  # type: ignore[union-attr]
    assert wire.limits.num_clients == 2


# asyncio here; trio in tests/server/test_api_servers.py (the servers run trio).
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_stopped_shared_engine_is_noticed_by_every_frontend(anyio_backend: str) -> None:
    # Heartbeats (hang_timeout) on an attached client: each frontend's input ROUTER
    # PINGs the engine's connection to it; a SIGSTOPped engine answers none, each
    # frontend drops its own connection and ends its own streams. The parent watches
    # exits only: a stopped engine is not dead to it.
    engines = ReferenceEngines(faults=["--step-interval-ms", "20"])
    async with open_shared_engines(engines, clients=2) as shared:
        (pid,) = shared.engine_pids.values()
        try:
            async with (
                open_client(shared.attachment.client(0), hang_timeout=1.0) as first,
                open_client(shared.attachment.client(1), hang_timeout=1.0) as second,
            ):
                errors: dict[int, EngineDeadError] = {}

                async def stream_until_dead(
                    index: int, client: EngineCoreClient, streaming: anyio.Event
                ) -> None:
                    request = make_request([4, 5], max_tokens=100_000)
                    try:
                        async with client.generate(request) as stream:
                            async for _out in stream:
                                streaming.set()
                    except EngineDeadError as exc:
                        errors[index] = exc

                events = [anyio.Event(), anyio.Event()]
                async with anyio.create_task_group() as tg:
                    tg.start_soon(stream_until_dead, 0, first, events[0])
                    tg.start_soon(stream_until_dead, 1, second, events[1])
                    for event in events:
                        await event.wait()
                    os.kill(pid, signal.SIGSTOP)
                assert sorted(errors) == [0, 1]
                for k, error in errors.items():
                    assert "did not answer heartbeats for 1 s" in str(error)
                    assert shared.attachment.inputs[k] in str(error)  # its own endpoint
                assert first.dead
                assert second.dead
                assert not shared.dead  # stopped, not exited
        finally:
            os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_two_sources_share_the_frontends_addresses(anyio_backend: str) -> None:
    # Sources of one kind: every engine connects to the same N pairs (this was refused:
    # each source's addresses were made anew and compared with the first's).
    sources = [ReferenceEngines(1), ReferenceEngines(1, start_rank=1)]
    async with open_shared_engines(sources, clients=2) as shared:
        assert shared.attachment.ranks == (0, 1)
        async with open_client(shared.attachment.client(1)) as client:
            for rank in (0, 1):
                request = make_request([3, rank], max_tokens=2)
                async with client.generate(request, rank=rank) as stream:
                    assert [t async for out in stream for t in out.new_token_ids] == [3, rank]
