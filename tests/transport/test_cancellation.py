"""The cancellation contract: cancelled means nothing happened, completed means delivered."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import zmq

from trio_vllm.transport import AsyncSocket

from ._helpers import Worker, num, recv_with_timeout, unnum, until, wait_for_waiters

pytestmark = pytest.mark.anyio

N_RANDOM = 20_000
FILL = b"f" * 16384


def _bursty_sender(push: zmq.Socket[Any], n: int, seed: int) -> None:
    """Send 0..n-1 in bursts with short pauses, so the receiver often has to wait."""
    rng = random.Random(seed)
    i = 0
    while i < n:
        for _ in range(rng.randint(1, 40)):
            if i == n:
                break
            push.send(num(i))
            i += 1
        time.sleep(rng.uniform(0, 0.0003))


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
    """20,000 messages, every receive under a random 0-0.4 ms deadline."""
    rng = random.Random(1234)
    received: list[int] = []
    cancelled = 0
    with AsyncSocket.create(ctx, zmq.PULL) as pull:
        push = _raw_push(ctx, pull.bind_ipc())
        worker = Worker(lambda: _bursty_sender(push, N_RANDOM, 99)).start()
        try:
            with anyio.fail_after(60):
                while len(received) < N_RANDOM:
                    with anyio.move_on_after(rng.uniform(0, 0.0004)) as scope:
                        if mode == "receive":
                            received.append(unnum((await pull.receive())[0]))
                        else:
                            batch = await pull.receive_batch(rng.randint(1, 64))
                            received.extend(unnum(m[0]) for m in batch)
                    cancelled += scope.cancelled_caught
            worker.join()
        finally:
            push.close()
    assert received == list(range(N_RANDOM)), "a message was lost, duplicated or reordered"
    assert cancelled > 100, f"only {cancelled} receives were cancelled; the test is too gentle"


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_native_asyncio_timeouts_lose_nothing(ctx: zmq.Context[Any], loop: str) -> None:
    """asyncio.timeout (a native Task.cancel) around each receive, on asyncio and uvloop.

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
    timeouts = 0

    async def main() -> None:
        nonlocal timeouts
        rng = random.Random(77)
        with AsyncSocket.create(ctx, zmq.PULL) as pull:
            push = _raw_push(ctx, pull.bind_ipc())
            worker = Worker(lambda: _bursty_sender(push, n, 5)).start()
            try:
                async with asyncio.timeout(60):
                    while len(received) < n:
                        try:
                            async with asyncio.timeout(rng.uniform(0, max_deadline)):
                                batch = await pull.receive_batch(rng.randint(1, 32))
                                received.extend(unnum(m[0]) for m in batch)
                                await asyncio.sleep(0)
                        except TimeoutError:
                            timeouts += 1
                worker.join()
            finally:
                push.close()

    anyio.run(main, backend="asyncio", backend_options=options)
    assert received == list(range(n))
    assert timeouts > 50


async def test_random_cancellation_of_sends_under_backpressure(ctx: zmq.Context[Any]) -> None:
    """Sends under a high-water mark of 5, each under a random 0-0.4 ms deadline.

    Exactly the sends that completed arrive, in order: no cancelled send goes out
    later, no completed send is lost.
    """
    rng = random.Random(4321)
    completed: list[int] = []
    cancelled = 0
    arrived: list[int] = []
    with AsyncSocket.create(ctx, zmq.PUSH, options={zmq.SNDHWM: 5}) as push:
        pull: zmq.Socket[Any] = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.RCVHWM, 5)
        pull.connect(push.bind_ipc())

        def slow_receiver() -> None:
            pause = random.Random(8)
            while True:
                frame = recv_with_timeout(pull, 20_000)[0]
                if frame == b"end":
                    return
                arrived.append(unnum(frame))
                if pause.random() < 0.02:
                    time.sleep(0.001)

        worker = Worker(slow_receiver).start()
        try:
            with anyio.fail_after(60):
                for i in range(N_RANDOM):
                    with anyio.move_on_after(rng.uniform(0, 0.0004)) as scope:
                        await push.send([num(i)])
                        completed.append(i)
                    cancelled += scope.cancelled_caught
                await push.send([b"end"])
                worker.join()
        finally:
            pull.close()
    assert arrived == completed
    assert cancelled > 100, f"only {cancelled} sends were cancelled; the test is too gentle"


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
