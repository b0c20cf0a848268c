"""Shared helpers for the transport tests."""

from __future__ import annotations

import struct
import threading
from typing import TYPE_CHECKING, Any

import anyio
import zmq

if TYPE_CHECKING:
    from collections.abc import Callable

    from trio_vllm.transport import AsyncSocket

_U64 = struct.Struct("<Q")


def num(i: int) -> bytes:
    return _U64.pack(i)


def unnum(frame: Any) -> int:
    value: int = _U64.unpack(bytes(frame))[0]
    return value


async def until(predicate: Callable[[], object], within: float = 5.0) -> None:
    """Poll ``predicate`` until it is true; fail after ``within`` seconds.

    For state outside the event loop (another thread, libzmq), which has no event to
    wait on.
    """
    with anyio.fail_after(within):
        while not predicate():  # noqa: ASYNC110 - external state, nothing to wait on
            await anyio.sleep(0.0005)


async def wait_for_waiters(sock: AsyncSocket, count: int = 1, within: float = 5.0) -> None:
    """Return once ``count`` tasks are blocked inside ``sock``."""
    await until(lambda: sock.waiting_tasks >= count, within)


def recv_with_timeout(sock: zmq.Socket[Any], timeout_ms: int = 5000) -> list[bytes]:
    """A blocking receive on a raw test-side socket that cannot hang."""
    if not sock.poll(timeout_ms, zmq.POLLIN):
        raise TimeoutError("nothing arrived on the raw peer socket")
    frames: list[bytes] = sock.recv_multipart()
    return frames


class Worker:
    """A thread running ``fn``; ``join()`` re-raises what it raised."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self._exc: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self._fn()
        except BaseException as exc:
            self._exc = exc

    def start(self) -> Worker:
        self._thread.start()
        return self

    def join(self, timeout: float = 30.0) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("worker thread did not finish")
        if self._exc is not None:
            raise self._exc
