"""What the blocking facades share: one call into the event-loop thread, and the
close-once shell of their streams.

`SyncClient` (trio_vllm/sync.py) and `SyncLLM` (trio_vllm/llm/_sync.py) both run an
event loop in a background thread behind an anyio blocking portal and hand out blocking
streams (`SyncRequestStream`, `SyncRequestOutputStream`). The rules live here once:

* `call_in_loop`: a call from another thread runs as a task in the loop; an exception in
  the calling thread while it waits (``KeyboardInterrupt``) cancels that task, and a
  call cut short by the portal stopping raises the owner's death error.
* `BlockingStream`: a stream is closed at most once, from any thread; the owner forgets
  it; a stream dropped unfinished is closed by its finalizer, except in the loop
  thread (a portal call there would deadlock; closing the owner cleans it up anyway).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    import weakref
    from collections.abc import Awaitable, Callable
    from types import TracebackType
    from typing import Self

    import anyio.from_thread

__all__ = ["BlockingStream", "StreamOwner", "call_in_loop", "close_streams"]

T = TypeVar("T")


def call_in_loop(
    portal: anyio.from_thread.BlockingPortal,
    func: Callable[..., Awaitable[T]],
    args: tuple[object, ...],
    *,
    loop_thread_id: int | None,
    owner: str,
    closed_error: Callable[[], BaseException],
    dead_error: Callable[[], BaseException | None],
) -> T:
    """Run ``func(*args)`` in the loop thread and wait for its result.

    Raises ``RuntimeError`` from the loop thread itself (it would wait on itself),
    ``closed_error()`` if the portal stopped before the call started, and
    ``dead_error()`` (when not ``None``) if the portal's stop cancelled it. Any other
    exception while waiting cancels the call in the loop (a no-op once it finished) and
    propagates, so the call completes or is cancelled with nothing changed.
    """
    if threading.get_ident() == loop_thread_id:
        raise RuntimeError(f"{owner} methods cannot be called from its own event loop")
    try:
        future = portal.start_task_soon(func, *args)
    except RuntimeError:
        # The portal stopped between the caller's check and the call: closed.
        raise closed_error() from None
    try:
        return future.result()
    except concurrent.futures.CancelledError:
        # Cancelled by close() stopping the portal: report it as the client does.
        error = dead_error()
        if error is not None:
            raise error from None
        raise
    except BaseException:
        future.cancel()  # e.g. KeyboardInterrupt: the call is cancelled in the loop
        raise


class StreamOwner(Protocol):
    """What a `BlockingStream` needs of the facade that made it."""

    @property
    def _loop_thread_id(self) -> int | None: ...

    @property
    def _streams(self) -> weakref.WeakSet[BlockingStream]: ...

    def _streams_need_closing(self) -> bool:
        """False once the owner closed: its own exit cleaned every stream up."""
        ...


class BlockingStream:
    """The close-once shell of a blocking stream over an async context manager
    entered through the portal (``context``); see the module documentation.

    Subclasses implement ``close`` with `_close_once`.
    """

    def __init__(
        self, owner: StreamOwner, context: contextlib.AbstractContextManager[object]
    ) -> None:
        self._owner = owner
        self._context = context
        self._closed = False
        self._lock = threading.Lock()
        owner._streams.add(self)

    def _close_once(self) -> bool:
        """Mark the stream closed and forget it in the owner. True for the one call
        that must then exit ``context`` (the first, while the owner is still open)."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        self._owner._streams.discard(self)
        return self._owner._streams_need_closing()

    def close(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # Best effort for a stream dropped unfinished (e.g. ``break`` in a for loop).
        # Never from the event-loop thread: a portal call there would deadlock, and
        # closing the owner cleans such streams up anyway.
        if self._closed or threading.get_ident() == self._owner._loop_thread_id:
            return
        with contextlib.suppress(Exception):
            self.close()


def close_streams(streams: weakref.WeakSet[BlockingStream]) -> None:
    """Close every stream still open (aborting its request); errors are ignored, as the
    owner's own exit that follows cleans up too."""
    for stream in list(streams):
        with contextlib.suppress(Exception):
            stream.close()
