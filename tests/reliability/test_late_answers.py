"""Issue 16 class (a): late answers on every handshake path (startup, join, retire).

An engine may answer after the client gave up on it: its ready response arrives after
the startup or an ``add_engines`` timed out or was cancelled, its utility reply after its
rank was retired. The client must treat such a message as a late word from a rank that
is no longer part of it: dropped, never a death of the whole client (docs/data-parallel.md
promises that a failed join changes nothing). And while a join waits, the client's own
death must end it at once (issue 16 item 3), not after the joining engine's load time.

The engines are scripted peers (``_scripted.py``) that hold their ready response until
the test releases it, and reference engines with ``--startup-delay``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from trio_vllm import (
    EngineCoreOutput,
    EngineDeadError,
    EngineStartupError,
    ReferenceEngines,
    TrioVllmError,
    open_client,
)
from trio_vllm.protocol import UtilityCall
from trio_vllm.protocol.codec import ENGINE_CORE_DEAD

from ._scripted import ScriptedPeer, ScriptedSource, kill, scripted_client

if TYPE_CHECKING:
    from trio_vllm import EngineCoreClient

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def _still_fine(client: EngineCoreClient, *, ranks: list[int]) -> None:
    """Give a late message time to kill the client (it did within milliseconds), then
    check that the client is alive and serves ``ranks``."""
    with anyio.move_on_after(1.0):
        await client.wait_dead()
    assert not client.dead, client.dead_error()
    assert client.live_ranks == ranks
    with anyio.fail_after(30):
        assert await client.call_utility("echo", "still here", rank=ranks[0]) == ["still here"]


class Outcome:
    """What a background call ended with; ``done`` is set when it ended."""

    def __init__(self) -> None:
        self.value: Any = None
        self.done = anyio.Event()

    def set(self, value: Any) -> None:
        self.value = value
        self.done.set()

    async def wait(self, seconds: float) -> None:
        with anyio.move_on_after(seconds):
            await self.done.wait()


# ---------------------------------------------------------------------- startup


async def test_startup_answer_after_the_timeout() -> None:
    """Rank 0 answers, rank 1 only after ``ready_timeout``: a clean EngineStartupError
    naming rank 1, and the late answer (to closed sockets) disturbs nothing."""
    release = anyio.Event()
    peers = [ScriptedPeer(rank=0), ScriptedPeer(rank=1, hold_ready=release)]
    source = ScriptedSource(2)
    # Rank 1 answers only when released below: without the timeout this would hang.
    with anyio.fail_after(30), pytest.raises(EngineStartupError, match="1"):
        async with scripted_client(peers, source, ready_timeout=0.5):
            pytest.fail("startup must time out")
    release.set()
    await anyio.sleep(0.1)  # the late answer goes to sockets that are gone


async def test_startup_reference_engine_too_slow() -> None:
    """A real engine still loading (``--startup-delay``) at ``ready_timeout``: the error
    names the timeout, the process is stopped and reaped (it would answer later)."""
    source = ReferenceEngines(1, model="echo", faults=["--startup-delay", "600"])
    # The timeout, the grace and a loaded machine's spawn, not the engine's 600 s: a
    # hang guard.
    with anyio.fail_after(60), pytest.raises(EngineStartupError, match=r"within 0\.5 s"):
        async with open_client(source, ready_timeout=0.5, shutdown_grace=1):
            pytest.fail("startup must time out")


# ---------------------------------------------------------------------- join


async def _join_gives_up(how: str) -> None:
    release = anyio.Event()
    late = ScriptedPeer(rank=1, hold_ready=release)
    joining = ScriptedSource(start_rank=1)
    try:
        async with (
            scripted_client([ScriptedPeer(rank=0)], ScriptedSource()) as client,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(late.serve, joining)
            if how == "timeout":
                # The peer holds its answer for ever: any timeout gives up on it. 3 s,
                # so that its handshake (in this process) got the metadata first even
                # on a loaded machine (asserted below).
                with pytest.raises(EngineStartupError):
                    await client.add_engines(joining, ready_timeout=3)
            else:
                with anyio.CancelScope() as scope:

                    async def cancel_once_it_has_its_metadata() -> None:
                        await late.got_metadata.wait()
                        scope.cancel()  # the engine is about to answer

                    tg.start_soon(cancel_once_it_has_its_metadata)
                    await client.add_engines(joining, ready_timeout=30)
                    pytest.fail("the join must wait for the held answer")
                assert scope.cancelled_caught
            assert late.got_metadata.is_set()
            release.set()  # the ready response now reaches the input socket
            with anyio.fail_after(30):
                await late.answered.wait()
            await _still_fine(client, ranks=[0])
            tg.cancel_scope.cancel()
    finally:
        late.close()  # a context left to the collector blocks in term()


async def test_join_answer_after_the_timeout() -> None:
    """Issue 16 item 1: the joining engine answers after ``add_engines`` timed out."""
    await _join_gives_up("timeout")


async def test_join_answer_after_cancellation() -> None:
    """Issue 16 item 1: ``add_engines`` cancelled while its engine was about to answer."""
    await _join_gives_up("cancel")


@pytest.mark.parametrize("death", ["dead_frame", "process_exit"])
async def test_join_ends_at_the_clients_death(death: str) -> None:
    """Issue 16 item 3: rank 0 dies while a join waits for a slow engine (ready_timeout
    30 s): ``add_engines`` raises at once, not when the joining engine is ready."""
    never = anyio.Event()
    rank0 = ScriptedPeer(rank=0)
    slow = ScriptedPeer(rank=1, hold_ready=never)
    source = ScriptedSource(processes=death == "process_exit")
    joining = ScriptedSource(start_rank=1)
    try:
        async with (
            scripted_client([rank0], source) as client,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(slow.serve, joining)
            outcome = Outcome()

            async def join() -> None:
                try:
                    outcome.set(await client.add_engines(joining, ready_timeout=30))
                except TrioVllmError as exc:
                    outcome.set(exc)

            tg.start_soon(join)
            with anyio.fail_after(30):
                await slow.got_metadata.wait()
            if death == "dead_frame":
                rank0.queue_outputs([[ENGINE_CORE_DEAD]], settle=0.01)
            else:
                kill(source.processes[0])
            died = time.monotonic()
            with anyio.fail_after(15):
                await client.wait_dead()
            await outcome.wait(15)
            tg.cancel_scope.cancel()
    finally:
        slow.close()
    # 15 s: a hang guard well below the join's 30 s (a loaded machine's delays are not
    # the client's).
    assert outcome.done.is_set(), "add_engines did not end within 15 s of the client's death"
    assert isinstance(outcome.value, (EngineDeadError, EngineStartupError)), outcome.value
    assert time.monotonic() - died < 15


# ---------------------------------------------------------------------- retire


async def _pending_call_on(client: EngineCoreClient, rank: int, outcome: Outcome) -> None:
    try:
        outcome.set(await client.call_utility("echo", "late", rank=rank))
    except TrioVllmError as exc:
        outcome.set(exc)


async def test_retire_fails_the_calls_pending_on_the_rank() -> None:
    """Issue 16 item 4: a utility call in flight on a stalled rank that is retired ends
    (EngineDeadError for that rank) instead of waiting for a process that is gone."""
    stalled = ScriptedPeer(rank=1)
    stalled.reply_utilities = False
    async with scripted_client([ScriptedPeer(rank=0), stalled], ScriptedSource(2)) as client:
        outcome = Outcome()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_pending_call_on, client, 1, outcome)
            await stalled.wait_for(1)
            assert client.pending_utility_calls == 1
            with anyio.fail_after(30):
                await client.retire_rank(1)
            await outcome.wait(10)
            tg.cancel_scope.cancel()
        assert outcome.done.is_set(), "the call on the retired rank still waits"
        assert isinstance(outcome.value, EngineDeadError), outcome.value
        assert client.pending_utility_calls == 0
        await _still_fine(client, ranks=[0])


async def test_retired_rank_answers_late() -> None:
    """The retired rank answers the call pending on it after the retirement, and sends
    an output: both are dropped (the call already failed), the client stays alive."""
    stalled = ScriptedPeer(rank=1)
    stalled.reply_utilities = False
    async with scripted_client([ScriptedPeer(rank=0), stalled], ScriptedSource(2)) as client:
        outcome = Outcome()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_pending_call_on, client, 1, outcome)
            (call,) = await stalled.wait_for(1)
            assert isinstance(call, UtilityCall)
            with anyio.fail_after(30):
                await client.retire_rank(1)
            await stalled.reply(call, ["late"])
            await stalled.send([EngineCoreOutput("gone", new_token_ids=[1])])
            await outcome.wait(10)
            tg.cancel_scope.cancel()
        assert outcome.done.is_set()
        assert isinstance(outcome.value, EngineDeadError), outcome.value
        await _still_fine(client, ranks=[0])
