"""The cancellation contract: cancelled means nothing happened, completed means delivered."""

from __future__ import annotations

import asyncio
import itertools
import math
import queue
import random
import time
from typing import TYPE_CHECKING, Any, TypeAlias

import anyio
import anyio.lowlevel
import pytest
import zmq

from trio_vllm.transport import AsyncSocket

from ._helpers import Worker, num, recv_with_timeout, unnum, until, wait_for_waiters

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

pytestmark = pytest.mark.anyio

N_RANDOM = 20_000
FILL = b"f" * 16384
# The random-cancellation tests make sure of at least this many cancellations that do
# not depend on the machine's speed (those that race are counted, not relied on).
QUOTA = 200
# After this many cancellations in a row the next receive runs without a deadline, so a
# machine on which the deadlines always win still makes progress.
MAX_STREAK = 20


class _PacedSender:
    """Sends 0, 1, 2, ... from a thread, only as many as the receiver has granted.

    Between bursts the receiver knows that nothing is on the way, so a receive it
    starts then must park, and can end only by being cancelled. Inside a burst the
    messages go in runs of 1-8 with pauses of up to 0.3 ms, so receives park there too.
    """

    def __init__(self, push: zmq.Socket[Any], seed: int) -> None:
        self.granted = 0
        self._grants: queue.SimpleQueue[int] = queue.SimpleQueue()
        rng = random.Random(seed)

        def run() -> None:
            sent = 0
            while (count := self._grants.get(timeout=30)) > 0:
                end = sent + count
                while sent < end:
                    for _ in range(min(rng.randint(1, 8), end - sent)):
                        push.send(num(sent))
                        sent += 1
                    time.sleep(rng.uniform(0, 0.0003))

        self._worker = Worker(run).start()

    def grant(self, count: int) -> None:
        self.granted += count
        self._grants.put(count)

    def finish(self) -> None:
        """Stop the thread; re-raise what it raised."""
        self._grants.put(0)
        self._worker.join()


async def _until_parked(sock: AsyncSocket) -> None:
    """Return once a task is blocked in ``sock`` (in-loop state: no sleep needed)."""
    with anyio.fail_after(30):
        while not sock.waiting_tasks:
            await anyio.lowlevel.checkpoint()


Take: TypeAlias = "Callable[[], Awaitable[object]]"
Pause: TypeAlias = "Callable[[], Awaitable[None]]"


async def _anyio_cancel_parked(sock: AsyncSocket, take: Take, before_cancel: Pause) -> bool:
    """Start ``take``, let it park in ``sock``, await ``before_cancel``, cancel it; True if
    the cancellation ended it (False: it completed first)."""
    completed = False

    async def run() -> None:
        nonlocal completed
        await take()
        completed = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await _until_parked(sock)
        await before_cancel()
        tg.cancel_scope.cancel()
    return not completed


async def _anyio_deadline(take: Take, seconds: float | None) -> bool:
    """``take`` under ``anyio.move_on_after(seconds)``; True if the deadline ended it."""
    with anyio.move_on_after(math.inf if seconds is None else seconds) as scope:
        await take()
    return scope.cancelled_caught


async def _native_cancel_parked(sock: AsyncSocket, take: Take, before_cancel: Pause) -> bool:
    """As `_anyio_cancel_parked`, with a native ``Task.cancel()``."""
    task = asyncio.ensure_future(take())
    await _until_parked(sock)
    await before_cancel()
    task.cancel()
    await asyncio.wait([task])
    if task.cancelled():
        return True
    task.result()
    return False


async def _native_deadline(take: Take, seconds: float | None) -> bool:
    """``take`` under ``asyncio.timeout(seconds)``, which cancels natively; a yield after
    the receive lets the timeout also fire just after a message was taken."""
    try:
        async with asyncio.timeout(seconds):
            await take()
            await asyncio.sleep(0)
    except TimeoutError:
        return True
    return False


async def _paced_receives(
    pull: AsyncSocket,
    push: zmq.Socket[Any],
    take: Take,
    received: list[int],
    *,
    cancel_parked: Callable[[AsyncSocket, Take, Pause], Awaitable[bool]],
    deadline: Callable[[Take, float | None], Awaitable[bool]],
    max_deadline: float,
    n: int,
    seed: int,
) -> tuple[int, int, int]:
    """Receive ``0..n-1`` through ``take`` from a `_PacedSender`, cancelling as the
    random-cancellation tests describe; return (bursts, raced receives, their
    cancellations)."""
    # Bursts from their own generator: the same bursts on every machine, however the
    # races (which draw deadlines) went.
    bursts_rng, rng = random.Random(seed), random.Random(seed + 1)
    sender = _PacedSender(push, seed + 2)
    bursts = raced = raced_cancelled = 0

    async def nothing() -> None:
        pass

    try:
        while sender.granted < n:
            # Nothing is on the way: the receive parks, and only the cancel can end it.
            ended_by_cancel = await cancel_parked(pull, take, nothing)
            assert ended_by_cancel, "a receive returned though nothing was sent"
            assert len(received) == sender.granted
            assert pull.waiting_tasks == 0, "a cancelled receive left a waiter behind"
            bursts += 1
            count = min(bursts_rng.randint(1, 40), n - sender.granted)
            pause = bursts_rng.uniform(0, 0.0003)

            async def grant(count: int = count, pause: float = pause) -> None:
                sender.grant(count)
                await anyio.sleep(pause)

            # Parked when the burst is granted; cancelled at once or a little later: the
            # cancel races the first messages.
            raced += 1
            raced_cancelled += await cancel_parked(pull, take, grant)
            streak = 0
            while len(received) < sender.granted:
                raced += 1
                cancelled = await deadline(
                    take, None if streak >= MAX_STREAK else rng.uniform(0, max_deadline)
                )
                raced_cancelled += cancelled
                streak = streak + 1 if cancelled else 0
            assert len(received) == sender.granted, "a message came twice or was never sent"
    finally:
        sender.finish()
    return bursts, raced, raced_cancelled


def _taker(pull: AsyncSocket, mode: str, received: list[int], seed: int) -> Take:
    rng = random.Random(seed)

    async def take() -> None:
        if mode == "receive":
            received.append(unnum((await pull.receive())[0]))
        else:
            batch = await pull.receive_batch(rng.randint(1, 64))
            received.extend(unnum(m[0]) for m in batch)

    return take


def _raw_push(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    push: zmq.Socket[Any] = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDTIMEO, 20_000)
    push.connect(endpoint)
    return push


@pytest.mark.parametrize("mode", ["receive", "receive_batch"])
async def test_random_cancellation_of_receives_loses_nothing(
    ctx: zmq.Context[Any], mode: str
) -> None:
    """20,000 messages in bursts the receiver paces, receives cancelled all the way.

    The sender sends only what the receiver granted, so before each burst the receiver
    knows that nothing is on the way. There, every time, a receive parked on the fd is
    cancelled (it must return nothing and leave no waiter); a second one parks, the
    burst is granted and it is cancelled at once or up to 0.3 ms later (racing the
    first messages). The rest of the burst is taken under random 0-0.4 ms deadlines
    that race the sender's pauses. How many of the races end in a cancellation is the
    machine's business (a fast idle one drains a burst in one ``receive_batch``); the
    parked cancellations are made sure of, one per burst, whatever the machine.
    """
    received: list[int] = []
    with AsyncSocket.create(ctx, zmq.PULL) as pull:
        push = _raw_push(ctx, pull.bind_ipc())
        try:
            with anyio.fail_after(120):
                bursts, raced, raced_cancelled = await _paced_receives(
                    pull,
                    push,
                    _taker(pull, mode, received, 7),
                    received,
                    cancel_parked=_anyio_cancel_parked,
                    deadline=_anyio_deadline,
                    max_deadline=0.0004,
                    n=N_RANDOM,
                    seed=1234,
                )
        finally:
            push.close()
    print(f"{bursts} parked receives cancelled; {raced_cancelled} of {raced} raced ones")
    assert received == list(range(N_RANDOM)), "a message was lost, duplicated or reordered"
    assert bursts >= QUOTA  # by construction: a burst is at most 40 messages


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_native_asyncio_timeouts_lose_nothing(ctx: zmq.Context[Any], loop: str) -> None:
    """The paced test above with native cancellation: ``asyncio.timeout`` and
    ``Task.cancel()``, on asyncio and uvloop.

    A native cancel pierces anyio's cancel shields, so a socket that checkpointed after
    dequeuing would drop messages here. uvloop's timers have 1 ms granularity (a
    0.4 ms timeout fires at the very first yield, so no receive could ever complete),
    so there the deadlines are drawn from 0-3 ms instead.
    """
    options: dict[str, Any] = {}
    max_deadline = 0.0004
    if loop == "uvloop":
        max_deadline = 0.003
        uvloop = pytest.importorskip("uvloop")
        options["loop_factory"] = uvloop.new_event_loop
    n = N_RANDOM // 2
    received: list[int] = []
    counts: tuple[int, int, int] = (0, 0, 0)

    async def main() -> None:
        nonlocal counts
        with AsyncSocket.create(ctx, zmq.PULL) as pull:
            push = _raw_push(ctx, pull.bind_ipc())
            try:
                async with asyncio.timeout(120):
                    counts = await _paced_receives(
                        pull,
                        push,
                        _taker(pull, "receive_batch", received, 5),
                        received,
                        cancel_parked=_native_cancel_parked,
                        deadline=_native_deadline,
                        max_deadline=max_deadline,
                        n=n,
                        seed=77,
                    )
            finally:
                push.close()

    anyio.run(main, backend="asyncio", backend_options=options)
    bursts, raced, raced_cancelled = counts
    print(f"{bursts} parked receives cancelled; {raced_cancelled} of {raced} raced ones")
    assert received == list(range(n))
    assert bursts >= QUOTA


class _PacedReceiver:
    """Receives from ``pull`` in a thread, only as many messages as granted; `finish`
    lets it read to the final ``b"end"``. While it waits for a grant the sender's queue
    fills up, so a send then blocks for good: only a cancellation can end it."""

    def __init__(self, pull: zmq.Socket[Any]) -> None:
        self.arrived: list[int] = []
        self._grants: queue.SimpleQueue[int] = queue.SimpleQueue()

        def run() -> None:
            while True:
                count = self._grants.get(timeout=30)
                for _ in itertools.count() if count < 0 else range(count):
                    frame = recv_with_timeout(pull, 20_000)[0]
                    if frame == b"end":
                        return
                    self.arrived.append(unnum(frame))

        self._worker = Worker(run).start()

    def grant(self, count: int) -> None:
        self._grants.put(count)

    def finish(self) -> None:
        self._grants.put(-1)

    def join(self) -> None:
        self._worker.join()


async def test_random_cancellation_of_sends_under_backpressure(ctx: zmq.Context[Any]) -> None:
    """Sends under a high-water mark of 5, each under a random 0-0.4 ms deadline, to a
    receiver that reads only 1-40 messages after each send that was cancelled.

    While the receiver waits the queue fills, so every such round ends in a cancelled
    send whatever the machine's speed; the test goes on until there were `QUOTA` of
    them. Exactly the sends that completed arrive, in order: no cancelled send goes out
    later, no completed send is lost.
    """
    rng = random.Random(4321)
    completed: list[int] = []
    rounds = streak = 0
    with AsyncSocket.create(ctx, zmq.PUSH, options={zmq.SNDHWM: 5}) as push:
        pull: zmq.Socket[Any] = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.RCVHWM, 5)
        pull.connect(push.bind_ipc())
        receiver = _PacedReceiver(pull)
        try:
            with anyio.fail_after(120):
                i = 0
                while rounds < QUOTA:
                    # A long deadline after a streak: progress where tiny ones always win.
                    seconds = 0.05 if streak >= MAX_STREAK else rng.uniform(0, 0.0004)
                    with anyio.move_on_after(seconds) as scope:
                        await push.send([num(i)])
                        completed.append(i)
                    i += 1
                    streak = streak + 1 if scope.cancelled_caught else 0
                    if scope.cancelled_caught:
                        rounds += 1
                        receiver.grant(rng.randint(1, 40))
                receiver.finish()
                await push.send([b"end"])
                receiver.join()
        finally:
            receiver.finish()
            pull.close()
    print(f"{len(completed)} of {i} sends completed, {rounds} cancelled")
    assert receiver.arrived == completed
    assert completed, "no send ever went through"


async def test_cancelled_blocked_send_never_goes_out(ctx: zmq.Context[Any]) -> None:
    with AsyncSocket.create(ctx, zmq.PUSH, options={zmq.SNDHWM: 1}) as push:
        pull: zmq.Socket[Any] = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.RCVHWM, 1)
        pull.connect(push.bind_ipc())
        try:
            # The peer must be connected before the queue can fill.
            await push.send([b"first"])
            assert recv_with_timeout(pull) == [b"first"]
            # Fill until the queue stays full: libzmq keeps moving messages into the
            # kernel's socket buffer for a while after the first WouldBlock.
            # A failed non-blocking send does not always process libzmq's commands;
            # an EVENTS read does, so consult it too before calling the queue full.
            # 0.3 s without room, not 0.06 s: the I/O thread can go unscheduled that
            # long on a loaded machine, and room appearing later unblocks the send.
            filled = 0
            quiet_rounds = 0
            with anyio.fail_after(30):
                while quiet_rounds < 15:
                    added = 0
                    while True:
                        try:
                            push.send_nowait([FILL])
                        except anyio.WouldBlock:
                            break
                        added += 1
                    filled += added
                    full = added == 0 and not push.get_option(zmq.EVENTS) & zmq.POLLOUT
                    quiet_rounds = quiet_rounds + 1 if full else 0
                    await anyio.sleep(0.02)
            with anyio.move_on_after(0.2) as scope:
                await push.send([b"CANCELLED"])
            assert scope.cancelled_caught, "the send did not block at the high-water mark"
            drained: list[bytes] = []

            def drain() -> None:
                while True:
                    frame = recv_with_timeout(pull)[0]
                    drained.append(frame)
                    if frame == b"after":
                        return

            worker = Worker(drain).start()
            with anyio.fail_after(10):
                await push.send([b"after"])
            worker.join()
        finally:
            pull.close()
    assert b"CANCELLED" not in drained
    assert drained == [FILL] * filled + [b"after"]


async def test_cancel_before_receive_leaves_message_queued(ctx: zmq.Context[Any]) -> None:
    with AsyncSocket.create(ctx, zmq.PULL) as pull:
        push = _raw_push(ctx, pull.bind_ipc())
        try:
            push.send(b"keep me")
            await until(lambda: pull.get_option(zmq.EVENTS) & zmq.POLLIN)
            with anyio.CancelScope() as scope:
                scope.cancel()
                await pull.receive()
            assert scope.cancelled_caught
            with anyio.CancelScope() as scope:
                scope.cancel()
                await pull.receive_batch()
            assert scope.cancelled_caught
            assert pull.receive_nowait() == [b"keep me"]
            with pytest.raises(anyio.WouldBlock):
                pull.receive_nowait()
        finally:
            push.close()


async def test_cancel_while_waiting_then_receive(ctx: zmq.Context[Any]) -> None:
    with AsyncSocket.create(ctx, zmq.PULL) as pull:
        push = _raw_push(ctx, pull.bind_ipc())
        try:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(pull.receive)
                    await wait_for_waiters(pull)
                    tg.cancel_scope.cancel()
                assert pull.waiting_tasks == 0
                push.send(b"next")
                assert await pull.receive() == [b"next"]
        finally:
            push.close()


async def test_receive_batch_is_a_checkpoint_even_when_messages_wait(
    ctx: zmq.Context[Any],
) -> None:
    """A tight receive_batch loop on a busy socket still lets other tasks run."""
    ticks = 0
    with AsyncSocket.create(ctx, zmq.PULL) as pull:
        push = _raw_push(ctx, pull.bind_ipc())
        try:
            for i in range(2000):
                push.send(num(i))
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:

                    async def ticker() -> None:
                        nonlocal ticks
                        while True:
                            ticks += 1
                            await anyio.lowlevel.checkpoint()

                    tg.start_soon(ticker)
                    got = 0
                    while got < 2000:
                        got += len(await pull.receive_batch(10))
                    tg.cancel_scope.cancel()
        finally:
            push.close()
    assert ticks >= 50


async def test_cancelled_receive_on_idle_socket_leaves_no_waiter(ctx: zmq.Context[Any]) -> None:
    """On an idle socket the fd wait is the receive's checkpoint: cancellable at once."""
    with AsyncSocket.create(ctx, zmq.PULL) as pull:
        push = _raw_push(ctx, pull.bind_ipc())
        try:
            with anyio.fail_after(30):
                for receive in (pull.receive, pull.receive_batch):
                    with anyio.CancelScope() as scope:
                        scope.cancel()
                        await receive()
                    assert scope.cancelled_caught
                    assert pull.waiting_tasks == 0
                    with anyio.move_on_after(0.01) as scope:
                        await receive()
                    assert scope.cancelled_caught
                    assert pull.waiting_tasks == 0
                push.send(b"later")
                assert await pull.receive_batch() == [[b"later"]]
        finally:
            push.close()
