"""What the blocking facades share: the event-loop thread, one call into it, and the
close-once shell of their streams.

`SyncClient` and `SyncLLM` each run an event loop in a background thread behind an
anyio blocking portal, with `open_client` (and for `SyncLLM` the text frontend) entered
in it, and hand out blocking streams (`SyncRequestStream`, `SyncRequestOutputStream`).
The rules live here once, in `LoopThread`:

* `LoopThread.enter`: the thread and its portal start, the facade's async context
  manager is entered in the loop; if that fails, everything is closed and the thread
  joined before the exception propagates.
* `LoopThread.call`: a call from another thread runs as a task in the loop; an
  exception in the calling thread while it waits (``KeyboardInterrupt``) cancels that
  task, and a call cut short by the portal stopping raises the client's death error.
* `LoopThread.open_stream`: a per-request context manager is entered and later exited
  by one loop task; interrupted while waiting for the entry, the calling thread cancels
  it there (a request already sent is aborted), as `LoopThread.call` does.
* `LoopThread.close`: every open stream is closed (aborting its request), the context
  manager exits (engines stopped), the portal stops and the thread is joined; the
  streams' own later closes then do nothing.
* `BlockingStream`: a stream is closed at most once, from any thread; the loop forgets
  it; a stream dropped unfinished is closed by its finalizer, except in the loop
  thread (a portal call there would deadlock; closing the facade cleans it up anyway).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import weakref
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import anyio.from_thread

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from types import TracebackType
    from typing import Self

    from ..client import EngineCoreClient

__all__ = ["BlockingStream", "LoopThread", "StreamHome", "call_in_loop"]

T = TypeVar("T")
C = TypeVar("C")


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


def _stop_portal(portal: anyio.from_thread.BlockingPortal) -> None:
    with contextlib.suppress(RuntimeError):  # already stopped
        portal.call(portal.stop, True)


class LoopThread(Generic[C]):
    """One facade's event-loop thread: ``C`` is what its async context manager yields
    (the `EngineCoreClient`, or the `LLM` over it). See the module documentation.

    ``owner`` names the facade in errors; ``client_of`` finds the engine-core client in
    ``C``, whose death error is what calls raise once it is dead or closed.
    """

    def __init__(
        self, owner: str, backend: str, client_of: Callable[[C], EngineCoreClient]
    ) -> None:
        self.owner = owner
        self._backend = backend
        self._client_of = client_of
        self._exit_stack: contextlib.ExitStack | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._value: C | None = None
        self._client: EngineCoreClient | None = None
        self.thread_id: int | None = None
        self.streams: weakref.WeakSet[BlockingStream] = weakref.WeakSet()
        self._close_lock = threading.Lock()
        self._used = False

    def enter(self, make_context: Callable[[], contextlib.AbstractAsyncContextManager[C]]) -> C:
        """Make the context (in the calling thread, before the loop thread starts: what
        can fail fast does), start the thread, enter the context in its loop and return
        what it yields.

        Raises ``RuntimeError`` on a second call, and whatever making or entering the
        context raised, after the thread was joined."""
        if self._used:
            raise RuntimeError(f"a {self.owner} can be entered only once")
        self._used = True
        context = make_context()
        stack = contextlib.ExitStack()
        try:
            portal = stack.enter_context(
                anyio.from_thread.start_blocking_portal(self._backend, name="trio-vllm-sync")
            )
            self.thread_id = portal.call(threading.get_ident)
            # Runs after the context exited (or failed to enter), before the portal's own
            # exit: cancels whatever portal task is left, e.g. a startup or a generate()
            # whose caller was interrupted, so that joining the thread cannot hang.
            stack.callback(_stop_portal, portal)
            value = stack.enter_context(portal.wrap_async_context_manager(context))
        except BaseException:
            stack.close()
            raise
        self._exit_stack = stack
        self._portal = portal
        self._value = value
        self._client = self._client_of(value)
        return value

    def close(self) -> None:
        """Close open streams (aborting their requests), exit the context (engines
        stopped) and join the thread. Idempotent; blocks until done. ``RuntimeError``
        from the loop thread itself."""
        if threading.get_ident() == self.thread_id:
            raise RuntimeError(f"a {self.owner} cannot be closed from its own event loop")
        with self._close_lock:
            stack, self._exit_stack = self._exit_stack, None
            if stack is None:
                return
            try:
                # Errors are ignored: the context's own exit that follows cleans up too.
                for stream in list(self.streams):
                    with contextlib.suppress(Exception):
                        stream.close()
            finally:
                self._portal = None
                stack.close()

    @property
    def is_open(self) -> bool:
        """Entered and not closed (streams closed after that need no portal call)."""
        return self._portal is not None

    @property
    def portal(self) -> anyio.from_thread.BlockingPortal:
        """The portal into the loop; ``RuntimeError`` while not open."""
        if self._portal is None:
            raise RuntimeError(f"the {self.owner} is not open (use it as a context manager)")
        return self._portal

    @property
    def value(self) -> C:
        """What the context yielded (also once closed: it is dead then); ``RuntimeError``
        before it was entered."""
        if self._value is None:
            raise RuntimeError(f"the {self.owner} is not open (use it as a context manager)")
        return self._value

    @property
    def dead(self) -> bool:
        """True until entered, and once the client died or the facade closed."""
        return self._client is None or self._portal is None or self._client.dead

    def call(self, func: Callable[..., Awaitable[T]], *args: object) -> T:
        """Run ``func(*args)`` in the loop thread and wait (see `call_in_loop`)."""
        portal = self._portal
        if portal is None:
            raise self.closed_error()
        return call_in_loop(
            portal,
            func,
            args,
            loop_thread_id=self.thread_id,
            owner=self.owner,
            closed_error=self.closed_error,
            dead_error=self._dead_error,
        )

    def closed_error(self) -> Exception:
        """What a call raises when the facade is not open: the client's death error once
        it was open, else ``RuntimeError``."""
        dead = None if self._client is None else self._client.dead_error()
        if dead is not None:
            return dead  # closed after it was open: what every call raises from then on
        return RuntimeError(f"the {self.owner} is not open (use it as a context manager)")

    def _dead_error(self) -> Exception | None:
        if self._client is not None and self._client.dead:
            return self.closed_error()
        return None

    def open_stream(
        self, context: contextlib.AbstractAsyncContextManager[T]
    ) -> tuple[contextlib.AbstractContextManager[T], T]:
        """Enter a per-request async context manager through the portal: (its blocking
        wrapper, what it yielded), for a `BlockingStream`. An exception in the calling
        thread while it waits (``KeyboardInterrupt``) cancels the entry in the loop (an
        entry that completed meanwhile is exited: its request aborted) and propagates."""
        wrapped = _HeldContext(self.portal, context)
        return wrapped, wrapped.__enter__()


class _HeldContext(contextlib.AbstractContextManager[T]):
    """An async context manager entered and exited by one loop task (a task group opened
    on entry must be left by the task that opened it), driven from another thread: what
    ``portal.wrap_async_context_manager`` does, except that an entry the calling thread
    stops waiting for is cancelled rather than left open until the facade closes."""

    def __init__(
        self,
        portal: anyio.from_thread.BlockingPortal,
        context: contextlib.AbstractAsyncContextManager[T],
    ) -> None:
        self._portal = portal
        self._context = context
        self._entered: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._task: concurrent.futures.Future[bool | None] | None = None
        self._exit: anyio.Event | None = None
        self._exc_info: tuple[
            type[BaseException] | None, BaseException | None, TracebackType | None
        ] = (None, None, None)

    async def _run(self) -> bool | None:
        exit_event = self._exit = anyio.Event()
        try:
            value = await self._context.__aenter__()
        except BaseException as exc:
            self._entered.set_exception(exc)
            raise
        self._entered.set_result(value)
        try:
            await exit_event.wait()
        finally:
            # Also when cancelled (the entry's waiter was interrupted, the portal stops).
            result = await self._context.__aexit__(*self._exc_info)
        return result

    def __enter__(self) -> T:
        task = self._task = self._portal.start_task_soon(self._run)
        try:
            return self._entered.result()
        except BaseException:
            task.cancel()  # interrupted: cancel the entry (a no-op once the task ended)
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._task is not None  # entered
        assert self._exit is not None
        self._exc_info = (exc_type, exc, tb)
        self._portal.call(self._exit.set)
        return self._task.result()


class StreamHome(Protocol):
    """What a `BlockingStream` needs of the `LoopThread` it belongs to."""

    @property
    def thread_id(self) -> int | None: ...

    @property
    def streams(self) -> weakref.WeakSet[BlockingStream]: ...

    @property
    def is_open(self) -> bool: ...


class BlockingStream:
    """The close-once shell of a blocking stream over an async context manager
    entered through the portal (``context``); see the module documentation.

    Subclasses implement ``close`` with `_close_once`.
    """

    def __init__(
        self, loop: StreamHome, context: contextlib.AbstractContextManager[object]
    ) -> None:
        self._loop = loop
        self._context = context
        self._closed = False
        self._lock = threading.Lock()
        loop.streams.add(self)

    def _close_once(self) -> bool:
        """Mark the stream closed and forget it in the loop. True for the one call
        that must then exit ``context`` (the first, while the facade is still open)."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        self._loop.streams.discard(self)
        return self._loop.is_open

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
        # closing the facade cleans such streams up anyway.
        if self._closed or threading.get_ident() == self._loop.thread_id:
            return
        with contextlib.suppress(Exception):
            self.close()
