"""Engine death and startup failure with real reference-engine processes.

Death (process exit, ENGINE_CORE_DEAD, an undecodable frame) must reach every pending
stream, utility call and ``get_output`` within 100 ms of becoming observable, and
every later call must raise too, also when no request was ever sent.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import pytest

from trio_vllm import EngineDeadError, EngineStartupError, ProtocolError
from trio_vllm.client import EngineCoreClient, ReferenceEngines, make_request, open_client
from trio_vllm.protocol import EngineCodec, EngineCoreOutputs
from trio_vllm.testing import open_reference_engines

from .conftest import child_pids

if TYPE_CHECKING:
    from collections.abc import Callable

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("frozen_heap")]

# "Promptly" is the 100 ms of the specification, counted from the moment the exit is
# observable (the process's pidfd becomes readable), not from the kill: under load, the
# kernel may take a while to tear a process down. The figures are printed; a test does
# not assert a wall-clock bound that a loaded or descheduled machine can miss. It asserts
# that the death arrives by itself, long before anything but the death could end the
# wait (a late drain once held deaths back 10-13 s): PROMPT_GUARD_S.
PROMPT_S = 0.1
PROMPT_GUARD_S = 5.0


def _watch_exit(pid: int) -> Callable[[], float]:
    """Start a thread that records when ``pid``'s exit becomes observable (pidfd).

    Returns a function giving that time; it joins the thread first, since the client
    can notice the exit (and the test go on) before the watcher thread gets the GIL.
    """
    fd = os.pidfd_open(pid)
    seen: list[float] = []

    def wait() -> None:
        try:
            select.select([fd], [], [])
            seen.append(time.monotonic())
        finally:
            os.close(fd)

    thread = threading.Thread(target=wait, name="test-pidfd-watch", daemon=True)
    thread.start()

    def observed_at() -> float:
        thread.join(timeout=10)
        assert seen, f"the exit of pid {pid} was never observed"
        return seen[0]

    return observed_at


async def _assert_every_call_raises(client: EngineCoreClient) -> None:
    with pytest.raises(EngineDeadError):
        await client.call_utility("get_supported_tasks")
    with pytest.raises(EngineDeadError):
        await client.call_utility_all("is_sleeping")
    with pytest.raises(EngineDeadError):
        await client.add_request(make_request([1]))
    with pytest.raises(EngineDeadError):
        async with client.generate(make_request([1])):
            pytest.fail("must not start")
    with pytest.raises(EngineDeadError):
        await client.get_output()
    with pytest.raises(EngineDeadError):
        await client.abort_requests(["x"])
    assert client.dead


async def test_kill_wakes_every_waiter_promptly() -> None:
    async with open_reference_engines(model="echo") as engines:
        client = engines.client
        (pid,) = client.engine_pids.values()
        raised: dict[str, float] = {}
        killed_at: list[float] = []
        blocking: list[str] = []
        # Stalled, the engine reads and writes nothing: no output or reply can end a
        # waiter before the kill, however late it comes (an --output-delay-ms only held
        # them back a few seconds).
        await engines.control().stall()

        async def stream_waiter() -> None:
            async with client.generate(make_request([1], max_tokens=10_000)) as stream:
                blocking.append("stream")
                with pytest.raises(EngineDeadError) as info:
                    await stream.collect()
            raised["stream"] = time.monotonic()
            assert info.value.rank == 0

        async def utility_waiter() -> None:
            blocking.append("utility")
            with pytest.raises(EngineDeadError):
                await client.call_utility("get_supported_tasks")
            raised["utility"] = time.monotonic()

        async def drain_raw() -> None:
            while True:
                await client.get_output()

        async def raw_waiter() -> None:
            blocking.append("get_output")
            with pytest.raises(EngineDeadError):
                await drain_raw()
            raised["get_output"] = time.monotonic()

        async def dead_waiter() -> None:
            blocking.append("wait_dead")
            await client.wait_dead()
            raised["wait_dead"] = time.monotonic()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for waiter in (stream_waiter, utility_waiter, raw_waiter, dead_waiter):
                    tg.start_soon(waiter)
                # Every waiter is blocked: the request and the call are sent (and stay
                # unanswered), each task reached its wait.
                while not (  # noqa: ASYNC110 - no event for "sent"
                    len(blocking) == 4
                    and client.live_requests
                    and client.pending_utility_calls == 1
                ):
                    await anyio.sleep(0.01)
                await anyio.lowlevel.checkpoint()
                observable = _watch_exit(pid)
                killed_at.append(time.monotonic())
                os.kill(pid, signal.SIGKILL)
        exited_at = observable()
        delays = {k: v - exited_at for k, v in raised.items()}
        print(
            f"exit observable {exited_at - killed_at[0]:.4f} s after SIGKILL; "
            f"waiters raised after (s): {delays} (specified: {PROMPT_S} s)"
        )
        assert set(delays) == {"stream", "utility", "get_output", "wait_dead"}
        assert max(delays.values()) < PROMPT_GUARD_S, delays
        assert client.pending_utility_calls == 0
        error = await client.wait_dead()
        assert "killed by SIGKILL" in str(error)
        await _assert_every_call_raises(client)


async def test_death_before_any_request_is_noticed() -> None:
    async with open_client(ReferenceEngines(model="echo"), ready_timeout=30) as client:
        (pid,) = client.engine_pids.values()
        observable = _watch_exit(pid)
        os.kill(pid, signal.SIGKILL)
        with anyio.fail_after(30):
            error = await client.wait_dead()
        noticed_at = time.monotonic()
        delay = noticed_at - observable()
        print(
            f"death noticed {delay * 1000:.1f} ms after the exit, no request sent "
            f"(specified: {PROMPT_S * 1000:.0f} ms)"
        )
        assert delay < PROMPT_GUARD_S
        assert error.rank == 0
        again = client.dead_error()
        assert isinstance(again, EngineDeadError)
        assert again is not error  # a fresh instance per raise
        assert str(again) == str(error)
        await _assert_every_call_raises(client)
        # The dead engine was reaped right away: not a zombie child of ours.
        assert pid not in child_pids()


async def test_engine_core_dead_frame_fails_streams() -> None:
    engines = ReferenceEngines(model="echo", faults=["--dead-after-steps", "3"])
    async with open_client(engines, ready_timeout=30) as client:
        with anyio.fail_after(30):
            async with client.generate(make_request([1, 2], max_tokens=100)) as stream:
                with pytest.raises(EngineDeadError, match="ENGINE_CORE_DEAD"):
                    await stream.collect()
        await _assert_every_call_raises(client)


async def test_silent_exit_fails_streams() -> None:
    engines = ReferenceEngines(model="echo", faults=["--die-after-steps", "3"])
    async with open_client(engines, ready_timeout=30) as client:
        with anyio.fail_after(30):
            async with client.generate(make_request([1, 2], max_tokens=100)) as stream:
                with pytest.raises(EngineDeadError, match="exited with code 1"):
                    await stream.collect()
        await _assert_every_call_raises(client)


async def test_outputs_before_death_are_delivered_first() -> None:
    engines = ReferenceEngines(model="echo", faults=["--die-after-steps", "5"])
    async with open_client(engines, ready_timeout=30) as client:
        async with client.generate(make_request([4, 5], max_tokens=100)) as stream:
            await client.wait_dead()
            tokens: list[int] = []

            async def consume() -> None:
                async for out in stream:
                    tokens.extend(out.new_token_ids)

            with pytest.raises(EngineDeadError):
                await consume()
        # What reached the stream is a prefix of the 5 steps, in order (os._exit right
        # after a send may drop messages ZeroMQ had not yet written; see the scripted
        # engine test for the exact figure).
        assert tokens == [4, 5, 4, 5, 4][: len(tokens)]


async def test_garbage_frame_is_protocol_error_cause() -> None:
    engines = ReferenceEngines(model="echo", faults=["--garbage-after-steps", "2"])
    async with open_client(engines, ready_timeout=30) as client:
        with anyio.fail_after(30):
            async with client.generate(make_request([1], max_tokens=100)) as stream:
                with pytest.raises(EngineDeadError) as info:
                    await stream.collect()
        assert isinstance(info.value.__cause__, ProtocolError)
        await _assert_every_call_raises(client)


async def test_crash_during_startup_reports_exit_and_output() -> None:
    engines = ReferenceEngines(model="echo", faults=["--crash-on-startup", "no GPU for you"])
    start = time.monotonic()
    with pytest.raises(EngineStartupError) as info:
        async with open_client(engines, ready_timeout=600):
            pytest.fail("startup must fail")
    assert time.monotonic() - start < 30  # noticed at the exit, not at the ready_timeout
    message = str(info.value)
    print(message)
    assert "exited with code 1" in message
    assert "no GPU for you" in message
    assert "EngineCore failed to start." in message
    assert not child_pids()


async def test_startup_timeout_stops_the_engine() -> None:
    engines = ReferenceEngines(model="echo", faults=["--startup-delay", "600"])
    start = time.monotonic()
    with pytest.raises(EngineStartupError) as info:
        async with open_client(engines, ready_timeout=1):
            pytest.fail("startup must time out")
    assert time.monotonic() - start < 30  # ready_timeout and grace, not the 600 s delay
    message = str(info.value)
    assert "did not become ready within 1 s" in message
    assert "rank(s) [0]" in message
    assert "ready_timeout" in message
    assert not child_pids()


async def test_one_of_two_engines_dies() -> None:
    async with open_client(ReferenceEngines(2, model="echo"), ready_timeout=30) as client:
        os.kill(client.engine_pids[1], signal.SIGKILL)
        with anyio.fail_after(30):
            error = await client.wait_dead()
        assert error.rank == 1
        await _assert_every_call_raises(client)


class _NeverQuietSocket:
    """Stands in for an output socket that another engine keeps full: every
    ``receive_nowait`` returns one more (empty) output message from rank 0."""

    def __init__(self) -> None:
        self.frames = [bytes(f) for f in EngineCodec().encode_outputs(EngineCoreOutputs(0))]
        self.taken = 0

    def receive_nowait(self) -> list[bytes]:
        self.taken += 1
        return self.frames


async def test_drain_after_exit_ends_at_its_deadline_on_a_never_quiet_socket() -> None:
    """After an engine exit the receive task reads what the engine sent last, until the
    socket has been quiet for a few ms but at most 30 ms. With data parallelism other
    engines share that socket; one that keeps it full must not hold the death back
    (it checked the deadline only when the socket was empty: a loaded run declared a
    death 10-13 s late, once the other engines' requests had ended)."""
    async with open_client(ReferenceEngines(model="echo"), ready_timeout=60) as client:
        socket = _NeverQuietSocket()
        started = time.monotonic()
        # The socket never goes quiet: only the deadline (30 ms) ends the drain, and
        # without it the drain never ends. How late it ends measures the machine, so
        # the guard is a hang guard; the figure is printed.
        with anyio.fail_after(30):
            await client._drain_after_exit(socket)  # type: ignore[arg-type]
        print(f"drain ended {(time.monotonic() - started) * 1e3:.1f} ms after it began")
        assert socket.taken > 10  # it did drain
        assert not client.dead


class _SlowBacklog:
    """A backlog of ``count`` output messages from rank 0 that takes 2 ms each to come
    out (a loaded machine), then nothing."""

    def __init__(self, count: int) -> None:
        self.frames = [bytes(f) for f in EngineCodec().encode_outputs(EngineCoreOutputs(0))]
        self.left = count

    def receive_nowait(self) -> list[bytes]:
        if not self.left:
            raise anyio.WouldBlock
        time.sleep(0.002)
        self.left -= 1
        return self.frames


async def test_drain_after_exit_handles_the_dead_ranks_whole_backlog() -> None:
    """The 30 ms bound cuts off other engines' traffic only: a backlog from the rank
    whose death was noticed is drained whole even when that takes longer (100 messages,
    200 ms; a cap on the whole drain lost 127 of 1,000 queued outputs under load)."""
    async with open_client(ReferenceEngines(model="echo"), ready_timeout=60) as client:
        client._session.notice_rank(0, "a test's notice")
        socket = _SlowBacklog(100)
        with anyio.fail_after(30):
            await client._drain_after_exit(socket)  # type: ignore[arg-type]
        assert socket.left == 0
