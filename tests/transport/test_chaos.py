"""Many tasks on one DEALER at once, everything under random cancellation."""

from __future__ import annotations

import random
import threading
from typing import Any

import anyio
import pytest
import zmq

from trio_vllm.transport import AsyncSocket

from ._helpers import Worker, num, unnum, until

pytestmark = pytest.mark.anyio

SENDERS = 3
PER_SENDER = 3000
# Times the echo peer stops; each stop ends only once a send and a receive were
# cancelled during it, so at least this many of each happen on any machine.
HOLDS = 60


async def test_concurrent_senders_receivers_and_option_access(ctx: zmq.Context[Any]) -> None:
    """3 senders, 2 receivers and an option-poking task share one DEALER.

    An echo ROUTER (a thread) returns every message. Every operation runs under a
    random 0-0.4 ms deadline. Exactly the completed sends come back, each once,
    and nothing hangs.

    How often a random deadline wins depends on the machine, so the echo is also held
    `HOLDS` times: while it is, the DEALER's queue fills and nothing comes back, so a
    send and a receive must end by cancellation before it is let go. The senders go on
    past their 3,000 messages until the holds are done.
    """
    rng = random.Random(2024)
    peer: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.SNDHWM, 0)
    dealer = AsyncSocket.create(
        ctx, zmq.DEALER, options={zmq.IDENTITY: b"d", zmq.SNDHWM: 3, zmq.RCVHWM: 0}
    )
    endpoint = dealer.bind_ipc()
    peer.setsockopt(zmq.RCVHWM, 3)
    peer.connect(endpoint)
    running = threading.Event()
    running.set()
    echoed = 0

    def echo() -> None:
        nonlocal echoed
        while True:
            if not running.wait(60) or not peer.poll(20_000):
                raise TimeoutError("echo peer starved")
            frames = peer.recv_multipart()
            if frames[1] == b"stop":
                return
            peer.send_multipart(frames)
            echoed += 1

    worker = Worker(echo).start()
    completed: list[int] = []
    received: list[int] = []
    cancelled = {"send": 0, "receive": 0}
    senders_done = 0
    holds_done = False
    try:
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:

                async def sender(base: int) -> None:
                    nonlocal senders_done
                    i = base
                    while i < base + PER_SENDER or not holds_done:
                        with anyio.move_on_after(rng.uniform(0, 0.0004)) as scope:
                            await dealer.send([num(i)])
                            completed.append(i)
                        cancelled["send"] += scope.cancelled_caught
                        i += 1
                    senders_done += 1

                async def receiver(batch: bool) -> None:
                    while True:
                        with anyio.move_on_after(rng.uniform(0, 0.0004)) as scope:
                            if batch:
                                messages = await dealer.receive_batch(rng.randint(1, 16))
                                received.extend(unnum(m[0]) for m in messages)
                            else:
                                received.append(unnum((await dealer.receive())[0]))
                        cancelled["receive"] += scope.cancelled_caught

                async def poker() -> None:
                    while True:
                        dealer.get_option(zmq.EVENTS)
                        dealer.set_option(zmq.SNDHWM, rng.choice([2, 3, 4]))
                        await anyio.sleep(rng.uniform(0, 0.002))

                async def holder() -> None:
                    nonlocal holds_done
                    for _ in range(HOLDS):
                        target = echoed + rng.randint(1, 200)
                        await until(lambda target=target: echoed >= target, 60)
                        running.clear()
                        before = dict(cancelled)
                        await until(
                            lambda before=before: all(cancelled[k] > before[k] for k in cancelled),
                            60,
                        )
                        running.set()
                    holds_done = True

                tg.start_soon(receiver, True)
                tg.start_soon(receiver, False)
                tg.start_soon(poker)
                tg.start_soon(holder)
                for k in range(SENDERS):
                    tg.start_soon(sender, k * 1_000_000)
                await until(lambda: senders_done == SENDERS, within=100)
                await until(lambda: len(received) >= len(completed), within=20)
                await anyio.sleep(0.1)  # anything extra (a duplicate) would show up now
                tg.cancel_scope.cancel()
            await dealer.send([b"stop"])
            worker.join()
    finally:
        running.set()
        dealer.close()
        peer.close()
    print(f"{len(completed)} sends, cancelled: {cancelled}")
    assert len(received) == len(set(received)), "a message was received twice"
    assert sorted(received) == sorted(completed), (
        "a completed send was lost or a cancelled one went out"
    )
    assert cancelled["send"] >= HOLDS
    assert cancelled["receive"] >= HOLDS
