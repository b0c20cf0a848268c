"""ROUTER specifics: ROUTER_MANDATORY errors, send_many, back-off when one peer is full."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest
import zmq

from trio_vllm import UnroutableError
from trio_vllm.transport import AsyncSocket

from ._helpers import Worker, recv_with_timeout, until, wait_for_waiters

pytestmark = pytest.mark.anyio

FILL = b"r" * 16384


async def _router_with_peer(
    ctx: zmq.Context[Any], *, hwm: int = 1000
) -> tuple[AsyncSocket, zmq.Socket[Any]]:
    router = AsyncSocket.create(ctx, zmq.ROUTER, options={zmq.SNDHWM: hwm})
    peer: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.IDENTITY, b"peer")
    peer.setsockopt(zmq.RCVHWM, hwm)
    peer.connect(router.bind_ipc())
    peer.send(b"hello")
    with anyio.fail_after(30):
        assert await router.receive() == [b"peer", b"hello"]
    return router, peer


async def _connect_other_peer(ctx: zmq.Context[Any], router: AsyncSocket) -> zmq.Socket[Any]:
    """A second, idle peer: with one peer full and one not, POLLOUT stays set."""
    other: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    other.setsockopt(zmq.LINGER, 0)
    other.setsockopt(zmq.IDENTITY, b"other")
    endpoint = router.get_option(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    other.connect(endpoint.decode())
    other.send(b"hello")
    with anyio.fail_after(30):
        assert await router.receive() == [b"other", b"hello"]
    return other


async def test_send_to_unknown_identity_raises(ctx: zmq.Context[Any]) -> None:
    router, peer = await _router_with_peer(ctx)
    try:
        with anyio.fail_after(30):
            with pytest.raises(UnroutableError, match="nobody"):
                await router.send([b"nobody", b"x"])
            with pytest.raises(UnroutableError):
                router.send_nowait([b"nobody", b"x"])
            await router.send([b"peer", b"ok"])
            assert recv_with_timeout(peer) == [b"ok"]
    finally:
        router.close()
        peer.close()


async def test_send_many_stops_before_an_unroutable_message(ctx: zmq.Context[Any]) -> None:
    router, peer = await _router_with_peer(ctx)
    try:
        messages = [[b"peer", b"1"], [b"peer", b"2"], [b"ghost", b"3"], [b"peer", b"4"]]
        assert router.send_many(messages) == 2
        with pytest.raises(UnroutableError):
            router.send_many(messages[2:])
        assert router.send_many(messages[3:]) == 1
        got = [recv_with_timeout(peer) for _ in range(3)]
        assert got == [[b"1"], [b"2"], [b"4"]]
    finally:
        router.close()
        peer.close()


async def test_router_mandatory_can_be_turned_off(ctx: zmq.Context[Any]) -> None:
    with AsyncSocket.create(ctx, zmq.ROUTER, router_mandatory=False) as router:
        router.bind_ipc()
        with anyio.fail_after(30):
            await router.send([b"nobody", b"silently dropped"])


async def _fill_peer(router: AsyncSocket) -> int:
    """Queue messages to the peer until its pipe stays full.

    libzmq's I/O thread moves queued messages on into the kernel's socket buffers and
    the peer's pipe; "full" is when it no longer makes room. 15 quiet rounds (0.3 s, not
    3): a loaded machine can leave that thread unscheduled for tens of ms, and room
    appearing later let the "blocked" send below go through.
    """
    filled = 0
    quiet_rounds = 0
    with anyio.fail_after(30):
        while quiet_rounds < 15:
            added = router.send_many([b"peer", FILL] for _ in range(10_000))
            filled += added
            quiet_rounds = quiet_rounds + 1 if added == 0 else 0
            await anyio.sleep(0.02)
    return filled


@pytest.mark.usefixtures("frozen_heap")  # a CPU bound: see tests/conftest.py
async def test_full_peer_backs_off_instead_of_spinning(ctx: zmq.Context[Any]) -> None:
    """A ROUTER send to a full peer waits with little CPU, then completes once it drains.

    With ROUTER_MANDATORY, POLLOUT is socket-wide and stays set while one peer is
    full, so waiting on the fd alone would spin at 100 % CPU.
    """
    router, peer = await _router_with_peer(ctx, hwm=2)
    other = await _connect_other_peer(ctx, router)
    try:
        filled = await _fill_peer(router)
        with pytest.raises(anyio.WouldBlock):
            router.send_nowait([b"peer", b"x"])
        assert router.get_option(zmq.EVENTS) & zmq.POLLOUT, "POLLOUT should stay set"
        cpu0, wall0 = time.process_time(), time.monotonic()
        with anyio.move_on_after(0.5) as scope:
            await router.send([b"peer", b"CANCELLED"])
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        assert scope.cancelled_caught, "the send to a full peer did not block"
        assert cpu < 0.25 * wall, f"blocked send burnt {cpu:.3f} s CPU in {wall:.3f} s"

        drained: list[bytes] = []

        def drain() -> None:
            while True:
                frame = recv_with_timeout(peer)[0]
                drained.append(frame)
                if frame == b"last":
                    return

        worker = Worker(drain).start()
        with anyio.fail_after(10):
            await router.send([b"peer", b"last"])
        worker.join()
    finally:
        router.close()
        peer.close()
        other.close()
    assert drained == [FILL] * filled + [b"last"]


@pytest.mark.usefixtures("frozen_heap")  # a CPU bound: see tests/conftest.py
async def test_backoff_does_not_ping_pong_with_a_waiting_receiver(ctx: zmq.Context[Any]) -> None:
    """A receiver waits on the same ROUTER while a send to a full peer backs off.

    Each wake-up check of one must not cut the other's back-off short, or the two
    tasks wake each other in a loop at full CPU.
    """
    router, peer = await _router_with_peer(ctx, hwm=2)
    other = await _connect_other_peer(ctx, router)
    try:
        await _fill_peer(router)
        assert router.get_option(zmq.EVENTS) & zmq.POLLOUT, "POLLOUT should stay set"
        received: list[list[Any]] = []
        send_outcome: list[str] = []
        async with anyio.create_task_group() as tg:

            async def sender() -> None:
                with anyio.move_on_after(0.6) as scope:
                    await router.send([b"peer", b"CANCELLED"])
                send_outcome.append("cancelled" if scope.cancelled_caught else "sent")

            async def receiver() -> None:
                received.append(await router.receive())

            # The sender first, so that it owns the fd in back-off when the receiver
            # arrives and reads EVENTS (POLLOUT is always set on a ROUTER).
            tg.start_soon(sender)
            await wait_for_waiters(router, 1)
            tg.start_soon(receiver)
            await anyio.sleep(0.02)
            cpu0, wall0 = time.process_time(), time.monotonic()
            await anyio.sleep(0.4)
            cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
            assert cpu < 0.25 * wall, f"send + receive burnt {cpu:.3f} s CPU in {wall:.3f} s"
            await until(lambda: bool(send_outcome))
            assert send_outcome == ["cancelled"]
            # The receiver still works.
            peer.send(b"to the receiver")
            await until(lambda: bool(received))
        assert received == [[b"peer", b"to the receiver"]]
    finally:
        router.close()
        peer.close()
        other.close()
