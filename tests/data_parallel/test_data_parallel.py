"""Data parallel with real reference-engine processes: balance, abort routing, death of
one rank in both modes, waves, engine events, scale down.

Engine-side facts come from the engines themselves (``dp_counts`` of the counting
engine: every ADD and ABORT id it received), not from the client's bookkeeping.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from trio_vllm import EngineDeadError, EngineStartupError
from trio_vllm.client import EngineCoreClient, ReferenceEngines, make_request, open_client

from .conftest import CountingEngines

if TYPE_CHECKING:
    from collections.abc import Callable

pytestmark = pytest.mark.anyio

LONG = 100_000  # >= 100 s: the engines are paced (conftest.LONG_ARGS)


async def _until(predicate: Callable[[], bool]) -> None:
    """Poll a condition that other tasks make true (kept simple: tests only)."""
    while not predicate():  # noqa: ASYNC110
        await anyio.sleep(0.01)


async def _counts(client: EngineCoreClient) -> dict[int, dict[str, Any]]:
    with anyio.fail_after(30):
        results = await client.call_utility_all("dp_counts")
    return {r["rank"]: r for r in results}


async def test_2000_requests_spread_evenly_and_aborts_reach_only_the_owner() -> None:
    n = 2000
    async with open_client(CountingEngines(4), ready_timeout=60) as client:
        served: dict[str, int] = {}
        aborted: dict[str, int] = {}
        wrong: list[str] = []
        go = anyio.Event()

        async def one(i: int) -> None:
            prompt = [i % 50 + 1]
            abort = i % 10 == 0
            request = make_request(prompt, max_tokens=LONG if abort else 4, request_id=f"r{i}")
            async with client.generate(request) as stream:
                served[request.request_id] = stream.rank
                await go.wait()
                if abort:
                    first = await stream.receive()
                    aborted[request.request_id] = stream.rank
                    if first.new_token_ids[:1] != prompt:
                        wrong.append(request.request_id)
                    return  # leaving the block early aborts on the owner
                if await stream.collect() != prompt * 4:
                    wrong.append(request.request_id)

        with anyio.fail_after(90):
            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
                await _until(lambda: len(served) == n)
                go.set()
        assert not wrong
        assert client.in_flight == dict.fromkeys(range(4), 0)
        counts = await _counts(client)
        for rank in range(4):
            mine = {rid for rid, r in served.items() if r == rank}
            assert abs(len(mine) - n / 4) <= 0.1 * n / 4
            assert sorted(counts[rank]["added"]) == sorted(mine)
            # Each engine got the ABORT of its own aborted requests, and nothing else.
            assert sorted(counts[rank]["aborted"]) == sorted(
                rid for rid, r in aborted.items() if r == rank
            )
        assert len(aborted) == n // 10


async def test_pinned_rank_and_data_parallel_rank_field() -> None:
    async with open_client(CountingEngines(3), ready_timeout=60) as client:
        async with client.generate(make_request([5], max_tokens=2), rank=2) as stream:
            assert stream.rank == 2
            assert await stream.collect() == [5, 5]
        request = make_request([6], max_tokens=2, data_parallel_rank=1, request_id="pin")
        async with client.generate(request) as stream:
            assert stream.rank == 1
            await stream.collect()
        counts = await _counts(client)
        assert "pin" in counts[1]["added"]
        with pytest.raises(ValueError, match="no engine with rank 7"):
            await client.call_utility("dp_counts", rank=7)


async def test_call_utility_all_gathers_results_and_errors() -> None:
    engines = CountingEngines(3, faults=["--fail-utility", "get_weight_version"])
    async with open_client(engines, ready_timeout=60) as client:
        with anyio.fail_after(30):
            results = await client.call_utility_all("get_weight_version", return_exceptions=True)
            assert len(results) == 3
            assert all(type(r).__name__ == "UtilityCallError" for r in results)
            assert [r.rank for r in results] == [0, 1, 2]
            echoes = await client.call_utility_all(
                "collective_rpc", "echo", None, [1], None, return_exceptions=True
            )
        assert echoes == [[[1]]] * 3


async def _start_long(client: EngineCoreClient, tg: Any, n: int, out: dict[str, Any]) -> None:
    async def one(i: int) -> None:
        request = make_request([i + 1], max_tokens=LONG, request_id=f"long{i}")
        try:
            async with client.generate(request) as stream:
                out[request.request_id] = stream.rank
                async for _ in stream:
                    pass
        except EngineDeadError as exc:
            out[request.request_id] = exc

    for i in range(n):
        tg.start_soon(one, i)
    await _until(lambda: len(out) == n)


async def test_killing_one_of_four_ranks_fails_the_client_by_default() -> None:
    async with open_client(CountingEngines(4), ready_timeout=60) as client:
        out: dict[str, Any] = {}
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                await _start_long(client, tg, 8, out)
                os.kill(client.engine_pids[2], signal.SIGKILL)
                error = await client.wait_dead()
        assert error.rank == 2
        assert "engine process died" in str(error)
        assert all(isinstance(v, EngineDeadError) for v in out.values()), out
        with pytest.raises(EngineDeadError):
            await client.call_utility("dp_counts", rank=0)


@pytest.mark.parametrize("on_engine_death", ["fail", "continue"])
async def test_death_is_noticed_while_another_rank_floods_the_output_socket(
    on_engine_death: str,
) -> None:
    """Rank 1 dies while rank 0 keeps the shared output socket full (firehose). After an
    exit the client drains the dead engine's last outputs until the socket is quiet,
    but at most a few ms: a socket that never goes quiet must not delay the death (it
    did, until the other engines' requests ended: 10-13 s in a loaded run)."""
    flood_args = ["--firehose", "1", "--max-model-len", "100000000"]
    sources = [
        ReferenceEngines(1, model="echo", extra_args=flood_args),
        ReferenceEngines(1, model="echo", start_rank=1),
    ]
    async with open_client(sources, ready_timeout=60, on_engine_death=on_engine_death) as client:
        request = make_request([1], max_tokens=90_000_000)
        async with client.generate(request, rank=0) as flood:
            for _ in range(1000):  # the flood is on
                await flood.receive()
            pid = client.engine_pids[1]
            # The flood (90M tokens) never ends, so a drain that waited for it would never
            # end either: the hang guard tells the two apart. How soon the death shows
            # (the drain itself is bounded by 30 ms) measures the machine: printed.
            with anyio.fail_after(30):
                started = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                if on_engine_death == "fail":
                    await client.wait_dead()
                else:
                    while 1 not in client.lost_ranks:  # noqa: ASYNC110
                        await anyio.sleep(0.001)
                elapsed = time.monotonic() - started
            print(f"death noticed {elapsed * 1e3:.1f} ms after SIGKILL under the flood")
            if on_engine_death == "continue":
                await flood.receive()  # rank 0 still serves


async def test_killing_one_of_four_ranks_with_continue_keeps_the_rest() -> None:
    async with open_client(
        CountingEngines(4), ready_timeout=60, on_engine_death="continue"
    ) as client:
        out: dict[str, Any] = {}
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                await _start_long(client, tg, 8, out)
                owners = dict(out)
                os.kill(client.engine_pids[2], signal.SIGKILL)
                event = await client.engine_events.receive()
                assert event.kind == "rank_lost"
                assert event.rank == 2
                assert sorted(event.payload["requests"]) == sorted(
                    rid for rid, r in owners.items() if r == 2
                )
                # The dead rank's streams failed with its rank; the others still run.
                lost = [rid for rid, r in owners.items() if r == 2]
                assert lost
                # The failed streams' tasks get to run.
                await _until(lambda: all(isinstance(out[rid], EngineDeadError) for rid in lost))
                for rid, rank in owners.items():
                    if rank == 2:
                        assert isinstance(out[rid], EngineDeadError)
                        assert out[rid].rank == 2
                    else:
                        assert out[rid] == rank
                assert client.live_ranks == [0, 1, 3]
                assert not client.dead
                # New requests go to the survivors; the dead rank can't be pinned.
                for _ in range(6):
                    async with client.generate(make_request([9], max_tokens=2)) as stream:
                        assert stream.rank != 2
                        assert await stream.collect() == [9, 9]
                with pytest.raises(ValueError, match="no longer serves"):
                    await client.call_utility("dp_counts", rank=2)
                counts = await _counts(client)
                assert sorted(counts) == [0, 1, 3]
                await client.abort_requests(list(owners))
                tg.cancel_scope.cancel()
        assert client.lost_ranks.keys() == {2}


async def test_client_wakes_idle_moe_ranks_with_start_dp_wave() -> None:
    engines = CountingEngines(3, extra_args=["--moe", "--data-parallel-size", "3"])
    async with open_client(engines, ready_timeout=60, waves=True) as client:
        with anyio.fail_after(30):
            await client.add_request(make_request([1], max_tokens=3, request_id="w0"), rank=0)
            # Ranks 1 and 2 had no request: only the START_DP_WAVE the client sent them
            # makes them run a wave, which each ends with wave_complete (no coordinator).
            completed: dict[int, int] = {}
            finished = False
            while len(completed) < 3 or not finished:
                batch = await client.get_output()
                if batch.wave_complete is not None:
                    completed.setdefault(batch.engine_index, batch.wave_complete)
                finished = finished or any(o.finish_reason is not None for o in batch.outputs)
        # Ranks 1 and 2 ran wave 0 only because the client woke them (see the next
        # test). The reference engine has no cross-rank collective, so they end it
        # while rank 0 still works; the client does not restart a wave for that (the
        # request went out with its own START_DP_WAVE).
        assert completed == {0: 0, 1: 0, 2: 0}
        assert client.current_wave == 1
        assert client.waves_started == 1


async def test_without_waves_idle_moe_ranks_stay_idle() -> None:
    engines = CountingEngines(2, extra_args=["--moe", "--data-parallel-size", "2"])
    async with open_client(engines, ready_timeout=60) as client:
        with anyio.fail_after(30):
            await client.add_request(make_request([1], max_tokens=3, request_id="w0"), rank=0)
            ranks: set[int] = set()
            while 0 not in ranks:
                batch = await client.get_output()
                if batch.wave_complete is not None:
                    ranks.add(batch.engine_index)
            with anyio.move_on_after(0.5):
                while True:
                    batch = await client.get_output()
                    if batch.wave_complete is not None:
                        ranks.add(batch.engine_index)
        assert ranks == {0}
        assert client.current_wave is None


async def test_elastic_ep_notice_is_an_event_not_a_reply() -> None:
    async with open_client(CountingEngines(2), ready_timeout=60) as client:
        with anyio.fail_after(30):
            assert await client.call_utility("emit_eep", "RECONFIGURE_FINISHED", rank=1)
            event = await client.engine_events.receive()
        assert (event.kind, event.rank, event.payload) == (
            "elastic_ep",
            1,
            ["RECONFIGURE_FINISHED", 1],
        )
        assert client.pending_utility_calls == 0
        with pytest.raises(anyio.WouldBlock):
            client.engine_events.receive_nowait()
    assert [e async for e in client.engine_events] == []


async def test_retire_rank_aborts_or_drains_and_stops_the_engine() -> None:
    async with open_client(CountingEngines(3), ready_timeout=60) as client:
        pid = client.engine_pids[1]
        with anyio.fail_after(30):
            async with client.generate(
                make_request([4], max_tokens=LONG, request_id="stay"), rank=1
            ) as stream:
                await stream.receive()
                await client.retire_rank(1, drain=False)
                assert stream.aborted
            event = await client.engine_events.receive()
            assert (event.kind, event.rank) == ("rank_retired", 1)
            assert client.live_ranks == [0, 2]
            assert not client.dead
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
            for _ in range(4):
                async with client.generate(make_request([2], max_tokens=2)) as s:
                    assert s.rank in (0, 2)
                    await s.collect()
            # Draining: returns once the rank's request finished by itself.
            async with (
                client.generate(make_request([3], max_tokens=50), rank=2) as s2,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(client.retire_rank, 2)
                assert await s2.collect() == [3] * 50
            assert client.live_ranks == [0]
            with pytest.raises(ValueError, match="last live engine"):
                await client.retire_rank(0)


async def _drain_on(client: EngineCoreClient, rank: int) -> None:
    async with client.generate(make_request([2], max_tokens=LONG), rank=rank) as stream:
        async for _ in stream:
            pass


@pytest.mark.parametrize("mode", ["fail", "continue"])
async def test_engine_core_dead_from_one_of_two_sources(mode: Any) -> None:
    # Two local sources share the ipc endpoints; rank 2 sends ENGINE_CORE_DEAD after
    # a few steps and exits (vLLM's fatal-error path). The frame carries no rank.
    sources = [
        CountingEngines(2),
        CountingEngines(1, start_rank=2, faults=["--dead-after-steps", "3"]),
    ]
    async with open_client(sources, ready_timeout=60, on_engine_death=mode) as client:
        assert client.ranks == [0, 1, 2]
        with anyio.fail_after(30):
            async with client.generate(make_request([1], max_tokens=LONG), rank=0) as s0:
                with pytest.raises(EngineDeadError) as info:
                    await _drain_on(client, 2)
                if mode == "fail":
                    assert client.dead
                    return
                assert info.value.rank == 2
                event = await client.engine_events.receive()
                assert (event.kind, event.rank) == ("rank_lost", 2)
                assert "engine process died" in event.payload["message"]
                assert (await s0.receive()).new_token_ids
                assert client.live_ranks == [0, 1]


@pytest.mark.parametrize("mode", ["fail", "continue"])
async def test_a_rank_that_dies_while_draining_is_a_death(mode: Any) -> None:
    async with open_client(CountingEngines(2), ready_timeout=60, on_engine_death=mode) as client:
        with anyio.fail_after(30):
            async with client.generate(
                make_request([4], max_tokens=LONG, request_id="x"), rank=1
            ) as stream:
                await stream.receive()
                async with anyio.create_task_group() as tg:

                    async def retire() -> None:
                        with pytest.raises(EngineDeadError) as info:
                            await client.retire_rank(1)
                        assert info.value.rank == 1

                    tg.start_soon(retire)
                    await _until(lambda: client.live_ranks == [0])
                    os.kill(client.engine_pids[1], signal.SIGKILL)
                with pytest.raises(EngineDeadError):
                    await stream.collect()  # buffered outputs first, then the error
        assert client.dead == (mode == "fail")
        assert client.lost_ranks.keys() == (set() if mode == "fail" else {1})


async def test_add_engines_to_a_running_client() -> None:
    async with open_client(CountingEngines(2), ready_timeout=60) as client:
        with anyio.fail_after(60):
            async with client.generate(
                make_request([1], max_tokens=LONG, request_id="before"), rank=0
            ) as running:
                await running.receive()
                added = await client.add_engines(CountingEngines(2, start_rank=2))
                assert added == [2, 3]
                assert client.ranks == client.live_ranks == [0, 1, 2, 3]
                assert set(client.engine_pids) == {0, 1, 2, 3}
                assert sorted(client.ready_responses) == [0, 1, 2, 3]
                # The old request still runs; new ones spread over all four.
                assert (await running.receive()).new_token_ids
                ranks = []
                async with (
                    client.generate(make_request([2], max_tokens=LONG)) as a,
                    client.generate(make_request([3], max_tokens=LONG)) as b,
                    client.generate(make_request([4], max_tokens=LONG)) as c,
                ):
                    ranks = sorted([a.rank, b.rank, c.rank])
                    for s in (a, b, c):
                        await s.receive()
                assert ranks == [1, 2, 3]
            counts = await _counts(client)
            assert sorted(counts) == [0, 1, 2, 3]
            with pytest.raises(ValueError, match="already known"):
                await client.add_engines(CountingEngines(1, start_rank=3))
            # A joining engine that fails to start: nothing changes.
            with pytest.raises(EngineStartupError, match="boom"):
                await client.add_engines(
                    CountingEngines(1, start_rank=4, faults=["--crash-on-startup", "boom"])
                )
            assert client.ranks == [0, 1, 2, 3]
            assert not client.dead
            async with client.generate(make_request([5], max_tokens=2)) as s5:
                assert await s5.collect() == [5, 5]


async def test_cancelled_add_engines_stops_them_and_changes_nothing() -> None:
    async with open_client(CountingEngines(1), ready_timeout=60) as client:
        slow = CountingEngines(1, start_rank=1, faults=["--startup-delay", "30"])
        with anyio.fail_after(30):
            with anyio.move_on_after(1.0) as scope:
                await client.add_engines(slow)
            assert scope.cancelled_caught
            assert client.ranks == [0]
            assert set(client.engine_pids) == {0}
            assert not client.dead
            async with client.generate(make_request([8], max_tokens=2)) as s:
                assert await s.collect() == [8, 8]
            # A failed join's ranks stay reserved (a late engine may still connect).
            with pytest.raises(ValueError, match="already known"):
                await client.add_engines(CountingEngines(1, start_rank=1))


async def test_rank_lost_lists_every_request_that_failed_with_the_rank() -> None:
    """Issue 23.4: rank 2 of 3 is SIGKILLed with streams open while new requests keep
    starting: unpinned ones, and ones pinned to rank 2 until the client refuses to
    route there. Requests routed to rank 2 in the moment before its death was noticed
    fail with its EngineDeadError (at their send, or when the death is declared); the
    rank_lost event lists exactly the requests that failed with rank 2's death."""
    async with open_client(
        CountingEngines(3), ready_timeout=60, on_engine_death="continue"
    ) as client:
        out: dict[str, Any] = {}  # request id -> rank, then the EngineDeadError if any
        events: list[Any] = []

        async def one(request_id: str, rank: int | None) -> None:
            request = make_request([7], max_tokens=LONG, request_id=request_id)
            try:
                async with client.generate(request, rank=rank) as stream:
                    out[request_id] = stream.rank
                    async for _ in stream:
                        pass
            except EngineDeadError as exc:
                out[request_id] = exc
            except ValueError:  # pinned to rank 2 after its verdict: refused, not lost
                out[request_id] = None

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                await _start_long(client, tg, 9, out)
                os.kill(client.engine_pids[2], signal.SIGKILL)
                n = 0
                while not events and n < 400:
                    for pinned in (None, 2):
                        tg.start_soon(one, f"new{n}", pinned)
                        n += 1
                    await anyio.sleep(0.001)
                    with contextlib.suppress(anyio.WouldBlock):
                        events.append(client.engine_events.receive_nowait())
                if not events:
                    events.append(await client.engine_events.receive())
                # Every task started has settled: refused, failed, or running elsewhere.
                await _until(lambda: len(out) == 9 + n)
                await _until(lambda: 2 not in [r for r in out.values() if isinstance(r, int)])
                (event,) = events
                assert (event.kind, event.rank) == ("rank_lost", 2)
                failed = {
                    rid for rid, r in out.items() if isinstance(r, EngineDeadError) and r.rank == 2
                }
                assert not [
                    r for r in out.values() if isinstance(r, EngineDeadError) and r.rank != 2
                ]
                assert set(event.payload["requests"]) == failed
                assert {f"long{i}" for i in range(9)} & failed  # rank 2 had some
                print(f"rank_lost: {len(failed)} requests, {n} started after the kill")
                tg.cancel_scope.cancel()
