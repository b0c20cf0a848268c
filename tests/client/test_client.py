"""The client against real reference-engine processes, on trio and asyncio.

Covers the semantics of ARCHITECTURE.md: streams in order, abort on early exit
(verified on the engine), independence of concurrent callers, bounded buffering,
utilities, the raw API, and duplicate ids refused before sending.
"""

from __future__ import annotations

import anyio
import pytest

from trio_vllm import UtilityCallError
from trio_vllm.client import (
    EngineCoreClient,
    ReferenceEngines,
    make_request,
    new_request_id,
    open_client,
)
from trio_vllm.testing import open_reference_engines

pytestmark = pytest.mark.anyio

# A context so long that an un-aborted request keeps the engine busy for minutes.
LONG = ["--max-model-len", "1000000", "--num-gpu-blocks", "1000000"]


def echo_tokens(prompt: list[int], n: int) -> list[int]:
    """What the echo model produces: the prompt, cycled."""
    return [prompt[i % len(prompt)] for i in range(n)]


async def echo(client: EngineCoreClient, *args: object, rank: int | None = None) -> object:
    """The reference engine's worker ``echo`` through ``collective_rpc``: ``[list(args)]``."""
    return await client.call_utility("collective_rpc", "echo", None, list(args), None, rank=rank)


async def _engine_is_idle(client: EngineCoreClient, probe_s: float = 8) -> bool:
    """True if the engine has no running request: a ``wait`` pause completes at once.

    A request that was not aborted would keep the pause waiting (minutes with LONG).
    """
    with anyio.move_on_after(probe_s):
        await client.pause_scheduler("wait", False)
        await client.resume_scheduler()
        return True
    return False


async def test_stream_delivers_outputs_in_order() -> None:
    async with open_client(ReferenceEngines(model="echo"), ready_timeout=30) as client:
        assert client.vllm_version == "0.32.0"
        prompt = [1, 5, 7, 9, 11]
        async with client.generate(make_request(prompt, max_tokens=12)) as stream:
            outputs = [out async for out in stream]
        assert [t for out in outputs for t in out.new_token_ids] == echo_tokens(prompt, 12)
        assert all(out.finish_reason is None for out in outputs[:-1])
        assert outputs[-1].finish_reason == 1  # LENGTH
        assert stream.finished
        assert not stream.aborted
        assert client.live_requests == []


async def test_many_concurrent_streams_are_independent() -> None:
    async with open_client(ReferenceEngines(model="echo"), ready_timeout=30) as client:
        results: dict[int, list[int]] = {}

        async def run(i: int) -> None:
            prompt = [i + 1, i + 2, i + 3]
            async with client.generate(make_request(prompt, max_tokens=20 + i)) as stream:
                results[i] = await stream.collect()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in range(20):
                    tg.start_soon(run, i)
        for i in range(20):
            assert results[i] == echo_tokens([i + 1, i + 2, i + 3], 20 + i)
        assert client._in_flight == {0: 0}


async def test_slow_consumer_does_not_block_others_and_is_coalesced() -> None:
    async with open_client(ReferenceEngines(model="echo"), ready_timeout=30) as client:
        slow_request = make_request([3, 4], max_tokens=300)
        fast_request = make_request([8, 9, 10], max_tokens=300)
        async with (
            client.generate(slow_request, max_pending=4) as slow,
            client.generate(fast_request) as fast,
        ):
            with anyio.fail_after(30):
                # The fast stream completes while the slow one is not read at all.
                assert await fast.collect() == echo_tokens([8, 9, 10], 300)
                while not slow.finished:  # noqa: ASYNC110 - polling a flag, no event exists
                    await anyio.sleep(0.01)
            assert len(slow._pending) <= 4  # bounded buffer
            assert slow.coalesced > 0
            outputs = [out async for out in slow]
        assert len(outputs) <= 4
        # Nothing lost: the coalesced deltas concatenate to the exact sequence.
        assert [t for out in outputs for t in out.new_token_ids] == echo_tokens([3, 4], 300)
        assert outputs[-1].finish_reason == 1


@pytest.mark.parametrize("how", ["break", "exception", "cancel"])
async def test_leaving_generate_early_aborts_on_the_engine(how: str) -> None:
    engines = ReferenceEngines(model="echo", extra_args=LONG)
    async with open_client(engines, ready_timeout=30) as client:
        request = make_request([1, 2, 3], max_tokens=900_000)
        with anyio.fail_after(30):
            if how == "break":
                async with client.generate(request) as stream:
                    async for _ in stream:
                        break
            elif how == "exception":

                async def consume() -> None:
                    async with client.generate(request) as stream:
                        async for _ in stream:
                            raise KeyError(stream)

                with pytest.raises(KeyError) as info:
                    await consume()
                stream = info.value.args[0]
            else:
                with anyio.CancelScope() as scope:
                    async with client.generate(request) as stream:
                        async for _ in stream:
                            scope.cancel()
                assert scope.cancelled_caught
        assert stream.aborted
        assert client.live_requests == []
        assert client._in_flight == {0: 0}
        assert await _engine_is_idle(client)
        # The id is free again, and the engine still works.
        async with client.generate(
            make_request([4], max_tokens=2, request_id=request.request_id)
        ) as s:
            assert await s.collect() == [4, 4]


async def test_unaborted_request_keeps_engine_busy() -> None:
    """Control for the test above: the idle probe does detect a running request."""
    engines = ReferenceEngines(model="echo", extra_args=LONG)
    async with open_client(engines, ready_timeout=30) as client:
        await client.add_request(make_request([1, 2, 3], max_tokens=900_000))
        await client.get_output()
        assert not await _engine_is_idle(client, probe_s=1.5)
        await client.abort_requests(client.live_requests)


async def test_duplicate_live_id_is_refused_before_sending() -> None:
    async with open_client(ReferenceEngines(model="echo"), ready_timeout=30) as client:
        request = make_request([1, 2], max_tokens=50)
        async with client.generate(request) as stream:
            with pytest.raises(ValueError, match="already live"):
                async with client.generate(make_request([3], request_id=request.request_id)):
                    pytest.fail("must not start")
            with pytest.raises(ValueError, match="already live"):
                await client.add_request(make_request([3], request_id=request.request_id))
            # The original stream is unaffected (a duplicate ADD would kill the engine).
            assert await stream.collect() == echo_tokens([1, 2], 50)


async def test_invalid_request_is_refused_before_sending() -> None:
    async with open_client(ReferenceEngines(model="echo"), ready_timeout=30) as client:
        request = make_request([1, 2])
        request.sampling_params.top_p = 5.0  # type: ignore[union-attr]
        with pytest.raises(ValueError, match="top_p"):
            await client.add_request(request)
        assert client.live_requests == []
        too_long = make_request(list(range(1, 2100)), max_tokens=1)
        with pytest.raises(ValueError, match="maximum context length is 2048"):
            async with client.generate(too_long):
                pytest.fail("must not start")
        assert await client.call_utility("get_supported_tasks")


async def test_raw_api_add_get_abort() -> None:
    async with open_client(ReferenceEngines(model="echo"), ready_timeout=30) as client:
        with pytest.raises(anyio.WouldBlock):
            client.get_output_nowait()  # no request sent yet: an idle engine sends nothing
        ids = [new_request_id("raw") for _ in range(3)]
        for i, rid in enumerate(ids):
            # Each add_request is a checkpoint: outputs of the first may already be queued
            # by the time the last is sent (the echo engine answers within a millisecond).
            await client.add_request(make_request([10 + i], max_tokens=5, request_id=rid))
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        finished: set[str] = set()
        with anyio.fail_after(30):
            while len(finished) < 3:
                batch = await client.get_output()
                for out in batch.outputs:
                    tokens[out.request_id].extend(out.new_token_ids)
                    if out.finish_reason is not None:
                        finished.add(out.request_id)
        assert tokens == {rid: [10 + i] * 5 for i, rid in enumerate(ids)}
        assert client.live_requests == []
        # Abort a long raw request: it is finished locally and on the engine.
        rid = new_request_id("long")
        await client.add_request(make_request([1], max_tokens=1500, request_id=rid))
        await client.abort_requests([rid])
        assert client.live_requests == []


def test_ready_timeout_default_follows_vllm_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from trio_vllm.client._client import DEFAULT_READY_TIMEOUT, _default_ready_timeout

    monkeypatch.delenv("VLLM_ENGINE_READY_TIMEOUT_S", raising=False)
    assert _default_ready_timeout() == DEFAULT_READY_TIMEOUT == 600
    monkeypatch.setenv("VLLM_ENGINE_READY_TIMEOUT_S", "42.5")
    assert _default_ready_timeout() == 42.5


async def test_utilities() -> None:
    engines = ReferenceEngines(model="echo", faults=["--fail-utility", "reset_mm_cache"])
    async with open_client(engines, ready_timeout=30) as client:
        assert "generate" in await client.get_supported_tasks()
        assert await echo(client, 1, "two", [3]) == [[1, "two", [3]]]
        assert await client.is_sleeping() is False
        assert await client.reset_prefix_cache() is True
        assert await client.get_weight_version() == "default"
        assert await client.call_utility_all("collective_rpc", "echo", None, [7], None) == [[[7]]]
        assert await client.collective_rpc("echo", args=[8]) == [[8]]
        with pytest.raises(UtilityCallError, match="injected failure") as info:
            await client.reset_mm_cache()
        assert info.value.method == "reset_mm_cache"
        with pytest.raises(UtilityCallError, match="no_such_method"):
            await client.call_utility("no_such_method")
        await client.sleep(level=1)
        assert await client.is_sleeping() is True
        assert await client.wake_up() is True
        assert client.pending_utility_calls == 0


async def test_cancelled_utility_call_leaves_nothing_and_late_reply_is_dropped() -> None:
    async with open_reference_engines(model="echo") as engines:
        client = engines.client
        # Stalled, the engine cannot answer before the deadline, however slow the
        # machine (an --output-delay-ms reply could beat a descheduled deadline).
        await engines.control().stall()
        with anyio.move_on_after(0.05) as scope:
            await echo(client, "late")
        assert scope.cancelled_caught
        assert client.pending_utility_calls == 0
        await engines.control().unstall()
        # The late reply arrives while the next call waits; it must not be mistaken.
        with anyio.fail_after(30):
            assert await echo(client, "next") == [["next"]]
        assert client.pending_utility_calls == 0


async def test_cancelling_one_caller_does_not_affect_others() -> None:
    engines = ReferenceEngines(model="echo", faults=["--output-delay-ms", "20"])
    async with open_client(engines, ready_timeout=30) as client:
        results: list[object] = []

        async def victim_stream() -> None:
            with anyio.move_on_after(0.1):
                async with client.generate(make_request([1], max_tokens=1000)) as stream:
                    await stream.collect()

        async def victim_call() -> None:
            with anyio.move_on_after(0.01):
                await echo(client, "victim")

        async def survivor() -> None:
            async with client.generate(make_request([2, 3], max_tokens=30)) as stream:
                results.append(await stream.collect())
            results.append(await echo(client, "ok"))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(survivor)
                for _ in range(3):
                    tg.start_soon(victim_stream)
                    tg.start_soon(victim_call)
        assert results == [echo_tokens([2, 3], 30), [["ok"]]]
        assert client.live_requests == []
        assert client.pending_utility_calls == 0
        assert not client.dead


async def test_routing_spreads_over_ranks() -> None:
    # LONG: the raw request and d below run for minutes, so neither can finish before
    # the routing and the abort look at them.
    engines = ReferenceEngines(2, model="echo", extra_args=LONG)
    async with open_client(engines, ready_timeout=30) as client:
        assert client.ranks == [0, 1]
        assert set(client.engine_pids) == {0, 1}
        async with (
            client.generate(make_request([1], max_tokens=30)) as a,
            client.generate(make_request([2], max_tokens=30)) as b,
        ):
            assert {a.rank, b.rank} == {0, 1}
            assert await a.collect() == [1] * 30
            assert await b.collect() == [2] * 30
        assert await client.collective_rpc("echo", args=["x"]) == [["x"], ["x"]]
        assert await echo(client, "y", rank=1) == [["y"]]
        async with client.generate(make_request([3], max_tokens=2), rank=1) as c:
            assert c.rank == 1
            assert await c.collect() == [3, 3]
        with pytest.raises(ValueError, match="no engine with rank 5"):
            await echo(client, rank=5)
        # Every request left the per-rank load exactly once.
        await client.add_request(make_request([1], max_tokens=900_000, request_id="a"))
        async with client.generate(make_request([1], max_tokens=900_000)) as d:
            assert d.rank == 1  # rank 0 has the raw request in flight
            await client.abort_requests(["a", d.request_id])
            assert d.aborted
        assert client._in_flight == {0: 0, 1: 0}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_asyncio_native_timeout_on_utility_call() -> None:
    """``asyncio.timeout`` cancels with ``Task.cancel()``, not an anyio scope."""
    import asyncio

    async with open_reference_engines(model="echo") as engines:
        client = engines.client
        await engines.control().stall()  # nothing can come back before the timeouts
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await echo(client, "late")
        assert client.pending_utility_calls == 0

        async def consume() -> None:
            async with client.generate(make_request([1], max_tokens=1000)) as stream:
                await stream.collect()

        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await consume()
        assert client.live_requests == []
        await engines.control().unstall()
        assert await echo(client, "next") == [["next"]]


async def test_deferred_utility_reply_out_of_order() -> None:
    """A ``wait`` pause is answered only when the running request is done; calls made
    meanwhile are answered first. Replies are matched by call id, not by order.

    The running request is a long prefill, one token per step and no stats: it stays
    running for ~15 s on an idle machine (longer under load) and sends nothing meanwhile.
    (A decoding request floods the output socket with one message per step; under load
    the client then drains a growing backlog before each reply, which made this flaky.)
    """
    silent_prefill = [*LONG, "--max-num-batched-tokens", "1", "--disable-log-stats"]
    engines = ReferenceEngines(model="echo", extra_args=silent_prefill)
    async with open_client(engines, ready_timeout=30) as client:
        order: list[str] = []

        async def pause() -> None:
            await client.pause_scheduler("wait", False)
            order.append("pause")

        with anyio.fail_after(30):
            prompt = [1, 2] * 499_000
            async with client.generate(make_request(prompt, max_tokens=1000)) as stream:
                # Wait until the request runs: reset_prefix_cache() refuses (False) while
                # a request is running. (A reply does not mean a step ran since the ADD:
                # the engine drains all queued input, answering calls, before stepping.)
                while await client.call_utility("reset_prefix_cache") is not False:  # noqa: ASYNC110 - polls the engine, nothing to wait on
                    await anyio.sleep(0.01)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(pause)
                    await anyio.sleep(0.05)
                    assert client.pending_utility_calls == 1, order  # the pause waits
                    assert await echo(client, "quick") == [["quick"]]
                    order.append("quick")
                    assert await client.get_weight_version() == "default"
                    order.append("version")
                    assert order == ["quick", "version"]
                    # Ending the request lets the pause complete.
                    await client.abort_requests([stream.request_id])
        assert order == ["quick", "version", "pause"]
        assert await client.is_scheduler_paused() is True
        await client.resume_scheduler()
        assert await client.is_scheduler_paused() is False


@pytest.mark.parametrize(
    "anyio_backend", [pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")]
)
async def test_uvloop_smoke() -> None:
    async with open_client(ReferenceEngines(model="echo"), ready_timeout=30) as client:
        async with client.generate(make_request([1, 5, 7], max_tokens=6)) as stream:
            assert await stream.collect() == [1, 5, 7, 1, 5, 7]
        assert await echo(client, "uv") == [["uv"]]
        with anyio.move_on_after(0.01):
            async with client.generate(make_request([2], max_tokens=100_000 // 100)) as s:
                await s.collect()
        assert client.live_requests == []
