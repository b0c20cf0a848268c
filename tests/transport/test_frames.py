"""Frames: zero-copy receive of large frames, tracked sends, options, errors."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import zmq

from trio_vllm.transport import AsyncSocket, wait_tracker

pytestmark = pytest.mark.anyio

BIG = bytes(range(256)) * 400  # 102,400 bytes


async def _pair(ctx: zmq.Context[Any], **kwargs: Any) -> tuple[AsyncSocket, AsyncSocket]:
    pull = AsyncSocket.create(ctx, zmq.PULL, **kwargs)
    push = AsyncSocket.create(ctx, zmq.PUSH)
    push.connect(pull.bind_ipc())
    return pull, push


async def test_large_frames_arrive_zero_copy(ctx: zmq.Context[Any]) -> None:
    pull, push = await _pair(ctx)
    try:
        with anyio.fail_after(30):
            await push.send([b"header", BIG, b"small"])
            header, big, small = await pull.receive()
        assert header == b"header"
        assert isinstance(big, zmq.Frame)
        assert memoryview(big) == memoryview(BIG)
        assert small == b"small"
        assert isinstance(small, bytes)
    finally:
        pull.close()
        push.close()


async def test_copy_threshold_none_gives_bytes(ctx: zmq.Context[Any]) -> None:
    pull, push = await _pair(ctx, copy_threshold=None)
    try:
        with anyio.fail_after(30):
            await push.send([b"header", BIG])
            assert await pull.receive() == [b"header", BIG]
    finally:
        pull.close()
        push.close()


async def test_tracked_zero_copy_send(ctx: zmq.Context[Any]) -> None:
    pull, push = await _pair(ctx)
    try:
        payload = bytearray(BIG)
        with anyio.fail_after(10):
            tracker = await push.send_tracked([b"h", payload])
            received = await pull.receive()
            await wait_tracker(tracker)
        assert tracker.done
        assert memoryview(received[1]) == memoryview(BIG)
    finally:
        pull.close()
        push.close()


async def test_receive_batch_respects_max_messages(ctx: zmq.Context[Any]) -> None:
    pull, push = await _pair(ctx)
    try:
        assert push.send_many([b"%d" % i] for i in range(10)) == 10
        with anyio.fail_after(30):
            got: list[list[Any]] = []
            while len(got) < 10:
                batch = await pull.receive_batch(4)
                assert 1 <= len(batch) <= 4
                got.extend(batch)
        assert got == [[b"%d" % i] for i in range(10)]
        with pytest.raises(ValueError, match="max_messages"):
            await pull.receive_batch(0)
    finally:
        pull.close()
        push.close()


async def test_options_through_the_wrapper(ctx: zmq.Context[Any]) -> None:
    with AsyncSocket.create(ctx, zmq.DEALER, options={zmq.IDENTITY: "client-1"}) as dealer:
        assert dealer.get_option(zmq.IDENTITY) == b"client-1"
        dealer.set_option(zmq.SNDHWM, 7)
        assert dealer.get_option(zmq.SNDHWM) == 7
        assert dealer.socket_type == zmq.DEALER
        assert "DEALER" in repr(dealer)
    with AsyncSocket.create(ctx, zmq.SUB) as sub:
        sub.subscribe(b"topic")


async def test_wrapping_a_closed_socket_is_refused(ctx: zmq.Context[Any]) -> None:
    raw: zmq.Socket[Any] = ctx.socket(zmq.PAIR)
    raw.close()
    with pytest.raises(anyio.ClosedResourceError):
        AsyncSocket(raw)


async def test_send_without_peer_waits_and_send_nowait_would_block(
    ctx: zmq.Context[Any],
) -> None:
    with AsyncSocket.create(ctx, zmq.PUSH) as push:
        with pytest.raises(anyio.WouldBlock):
            push.send_nowait([b"x"])
        assert push.send_many([[b"x"]]) == 0
        with anyio.move_on_after(0.05) as scope:
            await push.send([b"x"])
        assert scope.cancelled_caught


async def test_receive_batch_respects_max_bytes(ctx: zmq.Context[Any]) -> None:
    # inproc: a completed send is already in the receiver's queue.
    with AsyncSocket.create(ctx, zmq.PULL) as pull, AsyncSocket.create(ctx, zmq.PUSH) as push:
        pull.bind("inproc://max-bytes")
        push.connect("inproc://max-bytes")
        with anyio.fail_after(30):
            for _ in range(6):
                await push.send([BIG])
            sizes = [len(await pull.receive_batch(256, max_bytes=150_000)) for _ in range(3)]
    # The message that crosses the limit is included: 2 x 102,400 B per batch.
    assert sizes == [2, 2, 2]
