"""Fault matrix: every reference-engine fault crossed with every operation in flight.

Run-time faults are injected through the engines' control sockets (or a signal) while
all of these are in flight at once, each in its own task:

* ``stream``: iterating a long ``generate`` stream;
* ``get_output``: consuming ``get_output`` batches of a long raw request;
* ``utility``: a utility call the engine holds open (``pause_scheduler`` in ``wait``
  mode does not reply while a request runs);
* ``utility_all``: the same through ``call_utility_all`` (both engines in the DP
  variants);
* ``wait_dead``: a task waiting for the client's death.

Each fault has its documented outcome and time bound (docs/client.md, "Death
semantics"; docs/reliability.md): the outcome is asserted, the delays are printed;
every test runs under a hard deadline, so a hang fails instead of blocking CI.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from trio_vllm import (
    EngineDeadError,
    EngineStartupError,
    ProtocolError,
    ReferenceEngines,
    UtilityCallError,
    make_request,
    open_client,
)
from trio_vllm.testing import (
    assert_engine_idle,
    assert_no_inflight_requests,
    open_reference_engines,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from trio_vllm import EngineCoreClient
    from trio_vllm.testing import ReferenceEngineSet

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90), pytest.mark.usefixtures("frozen_heap")]

# The documented bound for death to reach every waiter once the exit is observable.
# The delays are measured and printed, not asserted against it: a wall-clock bound
# measures the machine (a descheduled test process, a loaded CI box) as much as the
# client, and a flaky test lands nothing. What is asserted is that the death arrives by
# itself, long before anything else could end the waits (the deaths a drain once held
# back arrived 10-13 s late): HANG_GUARD_S. The client's CPU cost is load-independent
# and asserted an order of magnitude above its measured 27-51 ms (a cost growing with
# the square of the streams would show), CPU_GUARD_MS.
DEATH_BOUND_S = 0.1
HANG_GUARD_S = 5.0
CPU_GUARD_MS = 1000.0
LONG = 900_000
ENGINE_ARGS = ("--max-model-len", "1000000")
OPS = ("stream", "get_output", "utility", "utility_all", "wait_dead")


@dataclass
class InFlight:
    """The operations in flight and what became of each."""

    client: EngineCoreClient
    outcome: dict[str, BaseException | str] = field(default_factory=dict)
    at: dict[str, float] = field(default_factory=dict)
    started: dict[str, anyio.Event] = field(default_factory=dict)

    def _record(self, name: str, result: BaseException | str) -> None:
        self.outcome[name] = result
        self.at[name] = time.monotonic()

    async def _run(
        self, name: str, body: Callable[[anyio.Event], Awaitable[str]], event: anyio.Event
    ) -> None:
        try:
            result: BaseException | str = await body(event)
        except (EngineDeadError, UtilityCallError, ProtocolError) as exc:
            result = exc
        finally:
            event.set()
        self._record(name, result)

    async def stream(self, started: anyio.Event) -> str:
        async with self.client.generate(make_request([1, 2], max_tokens=LONG), rank=0) as s:
            await s.receive()
            started.set()
            async for _ in s:
                pass
        return "finished"

    async def get_output(self, started: anyio.Event) -> str:
        request = make_request([3], max_tokens=LONG)
        await self.client.add_request(request, rank=0)
        try:
            while True:
                batch = await self.client.get_output()
                if any(o.request_id == request.request_id for o in batch.outputs):
                    started.set()
        finally:
            if request.request_id in self.client.live_requests and not self.client.dead:
                with anyio.CancelScope(shield=True):
                    await self.client.abort_requests([request.request_id])

    async def utility(self, started: anyio.Event) -> str:
        started.set()
        await self.client.call_utility("pause_scheduler", "wait", False, rank=0)
        return "replied"

    async def utility_all(self, started: anyio.Event) -> str:
        started.set()
        await self.client.call_utility_all("pause_scheduler", "wait", False)
        return "replied"

    async def wait_dead(self, started: anyio.Event) -> str:
        started.set()
        raise await self.client.wait_dead()

    async def start(self, tg: anyio.abc.TaskGroup, ops: tuple[str, ...] = OPS) -> None:
        """Start ``ops`` and return once each is under way: the requests are streaming,
        then (so that the pause cannot hold them back) the utility calls are sent."""
        with anyio.fail_after(30):
            for phase in (("stream", "get_output"), ("utility", "utility_all", "wait_dead")):
                for name in phase:
                    if name in ops:
                        event = self.started[name] = anyio.Event()
                        tg.start_soon(self._run, name, getattr(self, name), event)
                for name in phase:
                    if name in ops:
                        await self.started[name].wait()
            # Every utility call is pending on rank 0, which holds the pause while its
            # requests run. (With two engines, rank 1 runs nothing and answers its part
            # of utility_all at once: counting that part too made this wait hang
            # whenever the answer beat the first look, as on a loaded machine.)
            expected = ("utility" in ops) + ("utility_all" in ops)
            while self.client.pending_utility_calls < expected:  # noqa: ASYNC110
                await anyio.sleep(0.005)
        await anyio.sleep(0.05)


def _assert_all_dead(inflight: InFlight, t0: float, bound: float) -> dict[str, float]:
    delays = {name: inflight.at[name] - t0 for name in inflight.outcome}
    for name, outcome in inflight.outcome.items():
        assert isinstance(outcome, EngineDeadError), f"{name}: {outcome!r}"
    assert max(delays.values()) < bound, delays
    return delays


async def _assert_every_call_raises(client: EngineCoreClient) -> None:
    with anyio.fail_after(30):
        with pytest.raises(EngineDeadError):
            await client.call_utility("get_supported_tasks")
        with pytest.raises(EngineDeadError):
            await client.add_request(make_request([1]))
        with pytest.raises(EngineDeadError):
            async with client.generate(make_request([1])):
                pytest.fail("must not start")
        with pytest.raises(EngineDeadError):
            await client.abort_requests(["x"])
    assert client.pending_utility_calls == 0


async def _inject_and_wait(
    engines: ReferenceEngineSet, fault: str, rank: int
) -> tuple[InFlight, float]:
    client = engines.client
    inflight = InFlight(client)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await inflight.start(tg)
            control = engines.control(rank)
            if fault == "sigkill":
                t0 = time.monotonic()
                control.send_signal(signal.SIGKILL)
            elif fault == "exit":
                await control.kill(code=3)  # os._exit(3) ~50 ms after the reply
                t0 = time.monotonic()
            elif fault == "dead_frame":
                await control.send_engine_dead()
                t0 = time.monotonic()
            else:
                assert fault == "garbage"
                await control.send_garbage()
                t0 = time.monotonic()
    return inflight, t0


@pytest.mark.parametrize("count", [1, 2], ids=["1-engine", "dp2"])
@pytest.mark.parametrize("fault", ["sigkill", "exit", "dead_frame", "garbage"])
async def test_death_faults_reach_every_operation(fault: str, count: int) -> None:
    """die (SIGKILL, or exit with a code), ENGINE_CORE_DEAD, a garbage frame: every
    operation in flight raises EngineDeadError by itself (delays printed), and so does every
    later call. In the DP variants the fault hits rank 1 while the single-rank
    operations run on rank 0: one engine's death kills the whole client."""
    async with open_reference_engines(count=count, model="echo", extra_args=ENGINE_ARGS) as engines:
        client = engines.client
        rank = count - 1
        inflight, t0 = await _inject_and_wait(engines, fault, rank)
        delays = _assert_all_dead(inflight, t0, HANG_GUARD_S)
        print(
            f"{fault} x{count}: ms after injection",
            {k: round(v * 1e3, 1) for k, v in delays.items()},
            f"(specified: {DEATH_BOUND_S * 1e3:.0f} ms after the exit is observable)",
        )
        error = await client.wait_dead()
        if fault == "sigkill":
            assert "killed by SIGKILL" in str(error)
            assert error.rank == rank
        elif fault == "exit":
            assert "exited with code 3" in str(error)
            assert error.rank == rank
        elif fault == "dead_frame":
            assert "ENGINE_CORE_DEAD" in str(error)
        else:
            assert isinstance(error.__cause__, ProtocolError)
            assert "EngineCoreOutputs" in str(error.__cause__)
        await _assert_every_call_raises(client)


@pytest.mark.parametrize("count", [1, 2], ids=["1-engine", "dp2"])
async def test_stall_blocks_only_until_the_callers_deadline(count: int) -> None:
    """A stalled engine (alive, reading and writing nothing) cannot be told from a slow
    one: every operation waits, and its caller's deadline cancels it cleanly. Nothing is
    left pending; after the engine resumes, the client works and the cancelled
    streams' requests were aborted on the engine."""
    async with open_reference_engines(count=count, model="echo", extra_args=ENGINE_ARGS) as engines:
        client = engines.client
        for control in engines.controls:
            await control.stall()
        outcomes: dict[str, str] = {}

        async def with_deadline(name: str, call: Callable[[], Awaitable[Any]]) -> None:
            start = time.monotonic()
            with anyio.move_on_after(0.5) as scope:
                await call()
            # A call that ignored its deadline would wait for the stalled engine: the
            # group's fail_after ends the test then. How late past 0.5 s it returned
            # measures the machine; printed.
            print(f"{name}: {time.monotonic() - start:.3f} s for a 0.5 s deadline")
            outcomes[name] = "cancelled" if scope.cancelled_caught else "returned"

        async def stream() -> None:
            async with client.generate(make_request([1], max_tokens=LONG)) as s:
                await s.receive()

        async def raw() -> None:
            await client.get_output()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(with_deadline, "stream", stream)
                tg.start_soon(with_deadline, "get_output", raw)
                tg.start_soon(
                    with_deadline, "utility", lambda: client.call_utility("get_supported_tasks")
                )
                tg.start_soon(with_deadline, "utility_all", lambda: client.is_sleeping())
        assert outcomes == dict.fromkeys(
            ["stream", "get_output", "utility", "utility_all"], "cancelled"
        )
        assert not client.dead
        assert_no_inflight_requests(client)
        for control in engines.controls:
            assert (await control.status()).stalled
            await control.unstall()
        with anyio.fail_after(30):
            assert "generate" in await client.get_supported_tasks()
            async with client.generate(make_request([4, 5], max_tokens=4)) as s:
                assert await s.collect() == [4, 5, 4, 5]
        # The stream cancelled while stalled was aborted once the engine read again;
        # the late replies of the cancelled utility calls were dropped.
        await assert_engine_idle(engines, within=5)
        assert client.pending_utility_calls == 0


@pytest.mark.parametrize("count", [1, 2], ids=["1-engine", "dp2"])
async def test_failing_utility_fails_only_that_call(count: int) -> None:
    """An injected utility failure raises UtilityCallError with the engine's message
    for that call (and for call_utility_all, naming the failing rank); every other
    operation in flight (a stream, a raw request read through get_output, a pending
    utility call, a wait_dead) carries on, and the client stays alive."""
    async with open_reference_engines(count=count, model="echo", extra_args=ENGINE_ARGS) as engines:
        client = engines.client
        failing_rank = count - 1
        await engines.control(failing_rank).fail_utility("get_weight_version")
        raw = make_request([8, 9], max_tokens=LONG)
        raw_tokens: list[int] = []
        dead_waiter_done = False

        async def read_raw() -> None:
            while True:
                for out in (await client.get_output()).outputs:
                    if out.request_id == raw.request_id:
                        raw_tokens.extend(out.new_token_ids)

        async def wait_dead() -> None:
            nonlocal dead_waiter_done
            await client.wait_dead()
            dead_waiter_done = True

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(read_raw)
                tg.start_soon(wait_dead)
                await client.add_request(raw, rank=0)
                async with client.generate(make_request([6, 7], max_tokens=LONG), rank=0) as s:
                    await s.receive()
                    # A utility the engine holds open while the stream runs.
                    pending = anyio.Event()
                    paused: list[object] = []

                    async def pause() -> None:
                        pending.set()
                        paused.append(
                            await client.call_utility("pause_scheduler", "wait", False, rank=0)
                        )

                    tg.start_soon(pause)
                    await pending.wait()
                    with pytest.raises(UtilityCallError, match="injected failure") as info:
                        await client.call_utility("get_weight_version", rank=failing_rank)
                    assert info.value.rank == failing_rank
                    assert info.value.method == "get_weight_version"
                    with pytest.raises(UtilityCallError) as info:
                        await client.get_weight_version()
                    assert info.value.rank == failing_rank
                    # Everything else is unaffected.
                    assert "generate" in await client.get_supported_tasks()
                    for _ in range(3):
                        assert (await s.receive()).new_token_ids
                    seen = len(raw_tokens)
                    while len(raw_tokens) < seen + 3:  # noqa: ASYNC110 - fed by read_raw
                        await anyio.sleep(0.005)
                    assert client.pending_utility_calls == 1  # the pause, still held
                    assert not paused
                await client.abort_requests([raw.request_id])
                # Both requests gone: the held pause completes.
                while not paused:  # noqa: ASYNC110 - fed by pause()
                    await anyio.sleep(0.005)
                tg.cancel_scope.cancel()
            assert not client.dead
            assert not dead_waiter_done
            await engines.control(failing_rank).unfail_utility("get_weight_version")
            assert await client.get_weight_version() == "default"
            await client.resume_scheduler()
        assert client.pending_utility_calls == 0
        await assert_engine_idle(engines, within=5)


async def test_slow_start_within_ready_timeout() -> None:
    start = time.monotonic()
    engines = ReferenceEngines(model="echo", faults=["--startup-delay", "1.5"])
    with anyio.fail_after(30):
        async with open_client(engines, ready_timeout=20) as client:
            ready = time.monotonic() - start
            assert "generate" in await client.get_supported_tasks()
    assert ready >= 1.5


async def test_slow_start_past_ready_timeout() -> None:
    """EngineStartupError within ready_timeout plus the shutdown grace, naming the
    rank still loading; the process is stopped."""
    engines = ReferenceEngines(model="echo", faults=["--startup-delay", "60"])
    start = time.monotonic()
    with anyio.fail_after(30), pytest.raises(EngineStartupError) as info:
        async with open_client(engines, ready_timeout=1, shutdown_grace=1):
            pytest.fail("startup must time out")
    elapsed = time.monotonic() - start
    assert elapsed < 30, elapsed  # not the 60 s of the startup delay (timeout + grace: 2 s)
    assert "did not become ready within 1 s" in str(info.value)
    assert "rank(s) [0]" in str(info.value)


async def test_slow_start_cancelled_by_the_caller() -> None:
    """The caller's own deadline during a slow start: cancelled cleanly and promptly."""
    engines = ReferenceEngines(model="echo", faults=["--startup-delay", "60"])
    start = time.monotonic()
    with anyio.move_on_after(1) as scope:
        async with open_client(engines, ready_timeout=30, shutdown_grace=1):
            pytest.fail("startup must not complete")
    assert scope.cancelled_caught
    assert time.monotonic() - start < 30  # not the 60 s of the startup delay


@pytest.mark.parametrize("count", [1, 2], ids=["1-engine", "dp2"])
async def test_crash_at_startup(count: int) -> None:
    engines = ReferenceEngines(count, model="echo", faults=["--crash-on-startup", "out of cheese"])
    start = time.monotonic()
    with anyio.fail_after(60), pytest.raises(EngineStartupError) as info:
        async with open_client(engines, ready_timeout=600):
            pytest.fail("startup must fail")
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "exited with code 1" in message
    assert "out of cheese" in message
    assert elapsed < 30, elapsed  # noticed at the exit, not at the 600 s ready_timeout


@pytest.mark.parametrize(
    "fault", ["--die-after-steps", "--dead-after-steps", "--garbage-after-steps"]
)
async def test_startup_flag_faults_mid_stream(fault: str) -> None:
    """The same faults set at startup (after N steps) instead of at run time."""
    engines = ReferenceEngines(model="echo", faults=[fault, "5"])
    async with open_client(engines, ready_timeout=30) as client:
        with anyio.fail_after(30):
            async with client.generate(make_request([1], max_tokens=100)) as stream:
                with pytest.raises(EngineDeadError):
                    await stream.collect()
        await _assert_every_call_raises(client)


# ---------------------------------------------------------------------- 1,000 streams


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=100)
    return {
        "min": ordered[0] * 1e3,
        "p50": q[49] * 1e3,
        "p90": q[89] * 1e3,
        "p99": q[98] * 1e3,
        "max": ordered[-1] * 1e3,
    }


@dataclass
class KillFigures:
    """Delays after the SIGKILL call, in ms."""

    streams: dict[str, float]  # distribution over the streams' EngineDeadError
    dead: float  # until the client itself was dead (wait_dead returned)
    cpu: float  # CPU time this process used until the last stream raised
    gc_pauses: list[tuple[int, float]]  # (generation, ms) of each collection in the window

    def describe(self) -> str:
        dist = ", ".join(f"{k} {v:.1f}" for k, v in self.streams.items())
        pauses = ", ".join(f"gen{g} {ms:.1f}" for g, ms in self.gc_pauses) or "none"
        return (
            f"client dead after {self.dead:.1f} ms; EngineDeadError in every stream after "
            f"[{dist}] ms; {self.cpu:.1f} ms of CPU; GC pauses [{pauses}] ms; load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
        )


class _GCPauses:
    """Collector passes while active, as (generation, ms)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._start = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], (time.perf_counter() - self._start) * 1e3))

    def __enter__(self) -> _GCPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc_info: object) -> None:
        gc.callbacks.remove(self._callback)


async def _kill_with_open_streams(n: int, *, quiet: bool) -> KillFigures:
    """Open ``n`` streams (each consumer has its first output), optionally let the
    engine go quiet (stalled, every buffered output consumed), SIGKILL it, and measure."""
    async with open_reference_engines(
        model="echo", extra_args=(*ENGINE_ARGS, "--max-num-seqs", str(n + 24))
    ) as engines:
        client = engines.client
        raised_at: list[float] = []
        cpu_at: list[float] = []
        wrong: list[BaseException] = []
        consumed = 0
        receiving = 0
        all_receiving = anyio.Event()

        async def consumer(i: int) -> None:
            nonlocal receiving, consumed
            try:
                async with client.generate(make_request([i % 200 + 1], max_tokens=LONG)) as s:
                    await s.receive()
                    receiving += 1
                    if receiving == n:
                        all_receiving.set()
                    async for _ in s:
                        consumed += 1
            except EngineDeadError:
                raised_at.append(time.monotonic())
                cpu_at.append(time.process_time())
            except BaseException as exc:  # pragma: no cover - reported below
                wrong.append(exc)
                raise

        dead_at: list[float] = []

        async def watch_death() -> None:
            await client.wait_dead()
            dead_at.append(time.monotonic())

        # A hang guard: opening 1,000 streams took over 60 s on a loaded machine.
        with anyio.fail_after(150), contextlib.ExitStack() as stack:
            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(consumer, i)
                tg.start_soon(watch_death)
                await all_receiving.wait()
                if quiet:
                    await engines.control().stall()
                    before = -1
                    while consumed != before:  # until every buffered output is consumed
                        before = consumed
                        await anyio.sleep(0.3)
                else:
                    await anyio.sleep(0.3)
                gc_pauses = stack.enter_context(_GCPauses())
                cpu0 = time.process_time()
                t0 = time.monotonic()
                os.kill(engines.control().pid, signal.SIGKILL)
        assert not wrong
        assert len(raised_at) == n
        assert client.live_requests == []
        return KillFigures(
            streams=_quantiles([t - t0 for t in raised_at]),
            dead=(dead_at[0] - t0) * 1e3,
            cpu=(max(cpu_at) - cpu0) * 1e3,
            gc_pauses=gc_pauses.pauses,
        )


@pytest.mark.timeout(200)
async def test_sigkill_with_1000_waiting_streams() -> None:
    """1,000 open streams whose consumers wait for their next output when the engine is
    SIGKILLed: every one raises EngineDeadError (specified: within 100 ms of the kill
    call, when the exit becomes observable at the latest; the distribution is printed).

    Asserted: the client's own cost, under CPU_GUARD_MS of CPU from the kill to the last
    stream's error, and no stream later than HANG_GUARD_S (wall-clock bounds tighter
    than that measure the machine)."""
    figures = await _kill_with_open_streams(1000, quiet=True)
    print("1000 waiting streams:", figures.describe())
    assert figures.cpu < CPU_GUARD_MS, figures.describe()
    assert figures.streams["max"] < HANG_GUARD_S * 1e3, figures.describe()


@pytest.mark.timeout(200)
async def test_sigkill_with_1000_busy_streams() -> None:
    """1,000 streams receiving as fast as the engine produces (the client saturated)
    when the engine is SIGKILLed: every one raises EngineDeadError once the outputs it
    had already received are consumed (nothing lost), and none hangs. The
    figures are printed; docs/reliability.md has measured ones."""
    # Every stream first consumes what had reached the client (up to the sockets'
    # high-water marks of 1,000-output messages): how long that takes is the client's
    # throughput on this machine (10-20 s on a loaded one). The setup's fail_after is
    # the hang guard; the figures are printed.
    figures = await _kill_with_open_streams(1000, quiet=False)
    print("1000 busy streams:", figures.describe())
