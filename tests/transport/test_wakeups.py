"""Wake-up scenarios: lost edges, several waiters, hand-over, close while waiting."""

from __future__ import annotations

import select
import time
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import zmq

from trio_vllm.transport import AsyncSocket

from ._helpers import Worker, num, recv_with_timeout, unnum, until, wait_for_waiters

pytestmark = pytest.mark.anyio


async def _dealer_with_router_peer(
    ctx: zmq.Context[Any], hwm: int = 1000
) -> tuple[AsyncSocket, zmq.Socket[Any]]:
    peer: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RCVHWM, hwm)
    # inproc: no I/O thread or kernel buffer in between, so no stray command
    # re-signals the fd and hides a lost wake-up.
    endpoint = f"inproc://dealer-peer-{id(peer):x}"
    peer.bind(endpoint)
    dealer = AsyncSocket.create(ctx, zmq.DEALER, options={zmq.IDENTITY: b"dealer", zmq.SNDHWM: hwm})
    dealer.connect(endpoint)
    await dealer.send([b"hello"])
    assert recv_with_timeout(peer) == [b"dealer", b"hello"]
    return dealer, peer


async def _fill_outgoing(sock: AsyncSocket) -> None:
    """Queue messages until the peer's pipe stays full (libzmq keeps draining a while;
    0.3 s without room, not 0.06 s: its I/O thread can go unscheduled that long)."""
    quiet_rounds = 0
    with anyio.fail_after(30):
        while quiet_rounds < 15:
            added = sock.send_many([b"f" * 16384] for _ in range(1000))
            full = added == 0 and not sock.get_option(zmq.EVENTS) & zmq.POLLOUT
            quiet_rounds = quiet_rounds + 1 if full else 0
            await anyio.sleep(0.02)


async def _edge_stolen_scenario(
    ctx: zmq.Context[Any], steal: str, wait: float = 10.0
) -> list[list[Any]]:
    """A task waits on a DEALER; a reply arrives; another call consumes the fd edge.

    The stealing call may succeed or fail (a send that hits the high-water mark
    processes libzmq's commands too). The loop is blocked (time.sleep) between the
    reply's arrival and the stealing call, so the waiting task cannot run before its
    edge is consumed. The waiter gets ``wait`` seconds to be woken.
    """
    dealer, peer = await _dealer_with_router_peer(ctx, hwm=1 if steal == "failed_send" else 1000)
    got: list[list[Any]] = []
    try:
        if steal == "failed_send":
            await _fill_outgoing(dealer)
        async with anyio.create_task_group() as tg:

            async def receiver() -> None:
                got.append(await dealer.receive())

            tg.start_soon(receiver)
            await wait_for_waiters(dealer)
            peer.send_multipart([b"dealer", b"reply"])
            # Block the loop until libzmq signalled the fd for the reply (the waiter
            # blocked on it, so it was not readable before; a fixed 0.1 s alone could
            # end first on a loaded machine, and the control test then saw a wake-up),
            # then 0.1 s more for the commands libzmq sends right after the first.
            readable, _, _ = select.select([dealer.fileno], [], [], 10)
            assert readable, "libzmq never signalled the reply"
            time.sleep(0.1)  # noqa: ASYNC251 - block the loop while libzmq signals the fd
            if steal == "send":
                dealer.send_nowait([b"ping"])
            elif steal == "failed_send":
                with pytest.raises(anyio.WouldBlock):
                    dealer.send_nowait([b"ping"])
            elif steal == "get_option":
                dealer.get_option(zmq.EVENTS)
            elif steal == "set_option":
                dealer.set_option(zmq.SNDHWM, 500)
            else:
                raise AssertionError(steal)
            with anyio.move_on_after(wait):
                await until(lambda: bool(got), within=wait + 1)
            tg.cancel_scope.cancel()
    finally:
        dealer.close()
        peer.close()
    return got


@pytest.mark.parametrize("steal", ["send", "failed_send", "get_option", "set_option"])
async def test_waiter_woken_when_another_call_consumes_the_edge(
    ctx: zmq.Context[Any], steal: str
) -> None:
    with anyio.fail_after(30):
        got = await _edge_stolen_scenario(ctx, steal)
    assert got == [[b"reply"]]


async def test_edge_scenario_hangs_without_the_wakeup_step(
    ctx: zmq.Context[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: with the post-call EVENTS check disabled the waiter really sleeps on.

    Shows that the scenario above provokes the lost-edge hazard rather than passing
    by luck.
    """
    monkeypatch.setattr(AsyncSocket, "_after_call", lambda self: None)
    with anyio.fail_after(10):
        got = await _edge_stolen_scenario(ctx, "send", wait=1.0)  # "never" = 1 s here
    assert got == []


async def test_receive_on_dealer_while_another_task_sends(ctx: zmq.Context[Any]) -> None:
    """A DEALER receives echoes while another task keeps sending on the same socket."""
    n = 3000
    dealer, peer = await _dealer_with_router_peer(ctx)

    def echo() -> None:
        for _ in range(n):
            peer.send_multipart(recv_with_timeout(peer))

    worker = Worker(echo).start()
    received: list[int] = []
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:

                async def sender() -> None:
                    for i in range(n):
                        await dealer.send([num(i)])
                        if i % 7 == 0:
                            await anyio.lowlevel.checkpoint()

                async def receiver() -> None:
                    while len(received) < n:
                        for message in await dealer.receive_batch(16):
                            received.append(unnum(message[0]))

                tg.start_soon(receiver)
                tg.start_soon(sender)
        worker.join()
    finally:
        dealer.close()
        peer.close()
    assert received == list(range(n))


async def test_two_concurrent_receivers(ctx: zmq.Context[Any]) -> None:
    n = 5000
    with AsyncSocket.create(ctx, zmq.PULL) as pull:
        endpoint = pull.bind_ipc()
        push: zmq.Socket[Any] = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDTIMEO, 10_000)
        push.connect(endpoint)

        def send_all() -> None:
            for i in range(n):
                push.send(num(i))
                if i % 50 == 0:
                    time.sleep(0.0005)

        got_a: list[int] = []
        got_b: list[int] = []
        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:

                    async def rx_single(out: list[int]) -> None:
                        while len(got_a) + len(got_b) < n:
                            with anyio.move_on_after(0.2):
                                out.append(unnum((await pull.receive())[0]))

                    async def rx_batch(out: list[int]) -> None:
                        while len(got_a) + len(got_b) < n:
                            with anyio.move_on_after(0.2):
                                out.extend(unnum(m[0]) for m in await pull.receive_batch(8))

                    tg.start_soon(rx_single, got_a)
                    tg.start_soon(rx_batch, got_b)
                    await wait_for_waiters(pull, 2)
                    worker = Worker(send_all).start()
                    await until(lambda: len(got_a) + len(got_b) >= n, within=25)
                    tg.cancel_scope.cancel()
            worker.join()
        finally:
            push.close()
    assert sorted(got_a + got_b) == list(range(n))
    assert got_a == sorted(got_a)
    assert got_b == sorted(got_b)


async def test_parked_waiter_takes_over_when_owner_is_cancelled(ctx: zmq.Context[Any]) -> None:
    with AsyncSocket.create(ctx, zmq.PULL) as pull:
        endpoint = pull.bind_ipc()
        push: zmq.Socket[Any] = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(endpoint)
        got: list[list[Any]] = []
        try:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    owner_scope = anyio.CancelScope()

                    async def owner() -> None:
                        with owner_scope:
                            await pull.receive()
                        assert owner_scope.cancelled_caught

                    async def parked() -> None:
                        got.append(await pull.receive())

                    tg.start_soon(owner)
                    await wait_for_waiters(pull, 1)
                    tg.start_soon(parked)
                    await wait_for_waiters(pull, 2)
                    owner_scope.cancel()
                    await until(lambda: pull.waiting_tasks == 1, within=2)
                    push.send(b"for the parked one")
                    await until(lambda: bool(got))
        finally:
            push.close()
    assert got == [[b"for the parked one"]]


async def test_close_wakes_every_waiter(ctx: zmq.Context[Any]) -> None:
    """Two receivers and a sender block on an unconnected DEALER; close() wakes all three."""
    dealer = AsyncSocket.create(ctx, zmq.DEALER)
    outcomes: list[str] = []

    async def receiver() -> None:
        try:
            await dealer.receive_batch()
        except anyio.ClosedResourceError:
            outcomes.append("receiver closed")

    async def sender() -> None:
        try:
            await dealer.send([b"nowhere to go"])
        except anyio.ClosedResourceError:
            outcomes.append("sender closed")

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(receiver)
            tg.start_soon(receiver)
            tg.start_soon(sender)
            await wait_for_waiters(dealer, 3)
            dealer.close()
    assert sorted(outcomes) == ["receiver closed", "receiver closed", "sender closed"]
    assert dealer.closed
    with pytest.raises(anyio.ClosedResourceError):
        await dealer.receive()
    with pytest.raises(anyio.ClosedResourceError):
        dealer.send_nowait([b"x"])
    dealer.close()  # idempotent


async def test_aclose_and_context_manager(ctx: zmq.Context[Any]) -> None:
    sock = AsyncSocket.create(ctx, zmq.PULL)
    async with sock:
        assert not sock.closed
    assert sock.closed
    sock2 = AsyncSocket.create(ctx, zmq.PUSH)
    await sock2.aclose()
    assert sock2.closed
