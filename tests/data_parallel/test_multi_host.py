"""Data parallel over "hosts": engines started on their own, reached over TCP on distinct
loopback addresses (127.0.0.2, 127.0.0.3: each its own handshake, input and output
endpoints, as if on two machines), plus a locally spawned engine, behind one client.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from trio_vllm import EngineDeadError
from trio_vllm.client import ExternalEngines, make_request, open_client

from .conftest import CountingEngines, counting_command

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from anyio.abc import Process

pytestmark = pytest.mark.anyio

LONG = 100_000  # >= 100 s: the engines are paced (conftest.LONG_ARGS)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def _engines_started_by_hand() -> AsyncIterator[Callable[[str, int], Awaitable[Process]]]:
    """Yields ``start(handshake_address, rank)``, which starts a counting engine the way
    an operator would on its host; every one started is killed and reaped on exit
    (shielded)."""
    processes: list[Process] = []

    async def start(address: str, rank: int) -> Process:
        process = await anyio.open_process(
            counting_command(address, rank),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=None,
        )
        processes.append(process)
        return process

    try:
        yield start
    finally:
        with anyio.CancelScope(shield=True):
            for process in processes:
                if process.returncode is None:
                    process.kill()
                await process.aclose()


async def test_engines_on_two_hosts_and_a_local_one() -> None:
    host_a, host_b = "127.0.0.2", "127.0.0.3"
    handshake_a = f"tcp://{host_a}:{_free_port(host_a)}"
    handshake_b = f"tcp://{host_b}:{_free_port(host_b)}"
    async with _engines_started_by_hand() as start:
        # "Host A" runs ranks 0-1, "host B" rank 2, as `vllm serve --headless
        # --data-parallel-start-rank R --data-parallel-address HOST` would.
        processes = [
            await start(address, rank)
            for address, rank in [(handshake_a, 0), (handshake_a, 1), (handshake_b, 2)]
        ]
        sources = [
            ExternalEngines(handshake_a, count=2),
            ExternalEngines(handshake_b, count=1, start_rank=2),
            CountingEngines(1, start_rank=3),
        ]
        async with open_client(sources, ready_timeout=60, on_engine_death="continue") as client:
            assert client.ranks == [0, 1, 2, 3]
            addresses = client.addresses
            assert addresses["handshake"] == handshake_a
            assert addresses["handshake1"] == handshake_b
            assert addresses["input"].startswith(f"tcp://{host_a}:")
            assert addresses["output"].startswith(f"tcp://{host_a}:")
            assert addresses["input1"].startswith(f"tcp://{host_b}:")
            assert addresses["input2"].startswith("ipc://")
            served: dict[str, int] = {}

            async def one(i: int) -> None:
                request = make_request([i % 9 + 1], max_tokens=3, request_id=f"m{i}")
                async with client.generate(request) as stream:
                    served[request.request_id] = stream.rank
                    assert await stream.collect() == [i % 9 + 1] * 3

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for i in range(400):
                        tg.start_soon(one, i)
                counts = {r["rank"]: r for r in await client.call_utility_all("dp_counts")}
            for rank in range(4):
                mine = sorted(rid for rid, r in served.items() if r == rank)
                assert sorted(counts[rank]["added"]) == mine
                assert 80 <= len(mine) <= 120
            # Host B's engine goes away: its dropped connection names rank 2.
            processes[2].kill()
            with anyio.fail_after(30):
                event = await client.engine_events.receive()
                assert (event.kind, event.rank) == ("rank_lost", 2)
                assert "lost the connection" in event.payload["message"]
                assert client.live_ranks == [0, 1, 3]
                results: dict[int, Any] = {}
                for rank in (0, 1, 3):
                    async with client.generate(make_request([7], max_tokens=2), rank=rank) as s:
                        results[rank] = await s.collect()
            assert results == {0: [7, 7], 1: [7, 7], 3: [7, 7]}


async def test_losing_a_host_fails_the_client_by_default_naming_the_rank() -> None:
    hosts = ["127.0.0.2", "127.0.0.3"]
    handshakes = [f"tcp://{h}:{_free_port(h)}" for h in hosts]
    async with _engines_started_by_hand() as start:
        processes = [await start(address, rank) for rank, address in enumerate(handshakes)]
        sources = [
            ExternalEngines(handshakes[0], count=1),
            ExternalEngines(handshakes[1], count=1, start_rank=1),
        ]
        async with open_client(sources, ready_timeout=60) as client:
            with anyio.fail_after(30):
                async with client.generate(make_request([3], max_tokens=LONG), rank=0) as s:
                    await s.receive()
                    processes[1].kill()
                    error = await client.wait_dead()
                    with pytest.raises(EngineDeadError):
                        await s.collect()
            assert error.rank == 1
            assert "lost the connection" in str(error)


async def test_a_host_joins_a_running_client() -> None:
    hosts = ["127.0.0.2", "127.0.0.3"]
    handshakes = [f"tcp://{h}:{_free_port(h)}" for h in hosts]
    async with _engines_started_by_hand() as start:
        await start(handshakes[0], 0)
        async with open_client(
            ExternalEngines(handshakes[0]), ready_timeout=60, on_engine_death="continue"
        ) as client:
            with anyio.fail_after(60):
                joined = await start(handshakes[1], 1)
                assert await client.add_engines(
                    ExternalEngines(handshakes[1], start_rank=1), ready_timeout=30
                ) == [1]
                async with client.generate(make_request([6], max_tokens=2), rank=1) as s:
                    assert await s.collect() == [6, 6]
                # The joined host is watched like the others: its loss names rank 1.
                joined.kill()
                event = await client.engine_events.receive()
                assert (event.kind, event.rank) == ("rank_lost", 1)
                assert client.live_ranks == [0]
