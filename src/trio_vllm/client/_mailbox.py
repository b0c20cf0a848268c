"""The client's one queue primitive: a deque and a wake-up, filled without blocking.

The receive task puts items with a synchronous call (never a checkpoint, never
blocks); consumers await them. `Mailbox` is used as it is for the engine
events and the raw ``get_output`` batches, and extended by
`RequestStream`, which merges into its newest item instead of
queueing once it holds ``max_pending`` (O(1) coalescing, see ``_streams.py``).

Ending: `Mailbox.end` with no error ends iteration (``anyio.EndOfStream``
from `receive`) once the queue is empty; with an error factory every
later call raises a fresh error from it, also once the queue is empty, so items
that arrived before the end are always handed out first.

Waking: a consumer that finds nothing queued parks (on trio as a bare parked task,
rescheduled by the producer; elsewhere on an ``anyio.Event``), and that wait is the
call's checkpoint. The producer wakes it only while it is parked.
"""

from __future__ import annotations

import collections
import sys
import time
from typing import TYPE_CHECKING, Any, Final, Generic, Protocol, TypeVar

import anyio
import anyio.lowlevel

from ._cancel import backend_pending, checkpoint_if_cancelled

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["YIELD_INTERVAL", "Mailbox"]

T = TypeVar("T")

# How long a consumer that finds items buffered may go without yielding to other
# tasks; it still checks for cancellation on every call. A full scheduler pass per
# output was a large part of the raw API's CPU at 1 output per message (bench firehose)
# and most of a lagging stream consumer's (bench sync; docs/performance.md).
YIELD_INTERVAL: Final = 0.001
_monotonic: Final = time.monotonic  # bound once: read on every buffered receive


class _Wakeup(Protocol):
    def set(self) -> None: ...

    def parked(self) -> bool: ...

    def abort(self, _raise_cancel: object) -> object: ...

    def park(self, abort: Callable[[object], object]) -> Awaitable[object]: ...


class _Nobody:
    """The wake-up of a mailbox nobody has waited on yet: nothing to wake."""

    __slots__ = ()

    def set(self) -> None:
        pass

    def parked(self) -> bool:
        return False

    def abort(self, _raise_cancel: object) -> object:  # pragma: no cover (never parked)
        raise AssertionError("nobody is parked on a mailbox's first wake-up")

    def park(self, abort: Callable[[object], object]) -> Awaitable[object]:  # pragma: no cover
        raise AssertionError("a mailbox waits on its backend's wake-up")


_NOBODY: Final = _Nobody()
_NO_ABORT: Final = _NOBODY.abort  # bound once, shared by every mailbox not yet waited on


class _TrioWakeup:
    """Parked trio tasks, rescheduled by `set`: no event object per wake-up and none
    of anyio's dispatch (an `anyio.Event` made and waited per wake-up was a visible part
    of a 4096-stream consumer's time). `set` with nobody parked does nothing: a consumer
    looks at its queue, synchronously, right before it parks. One waiter is the rule
    (one consumer); further ones, if any, wait in a list."""

    __slots__ = ("_lowlevel", "_more", "_task")

    def __init__(self, lowlevel: Any) -> None:
        self._lowlevel = lowlevel
        self._task: object | None = None
        self._more: list[object] = []

    def set(self) -> None:
        task = self._task
        if task is not None:
            self._task = None
            self._lowlevel.reschedule(task)
        if self._more:
            more, self._more = self._more, []
            for task in more:
                self._lowlevel.reschedule(task)

    def parked(self) -> bool:
        """The first waiter is parked and neither woken nor cancelled yet: it will not
        run before something wakes it (`RequestStream`'s listener relies on this)."""
        return self._task is not None

    def abort(self, _raise_cancel: object) -> object:
        """trio's abort callback of the first waiter's park."""
        self._task = None  # only called while this waiter is still parked as _task
        return self._lowlevel.Abort.SUCCEEDED

    def park(self, abort: Callable[[object], object]) -> Awaitable[object]:
        """Register the calling task and return the wait it awaits until `set`: a
        checkpoint (cancellable: then nothing changed).

        A plain function, not a coroutine: the caller awaits trio's own wait in its own
        frame, so a parked consumer keeps no coroutine of ours alive until woken (with
        thousands of streams such objects outlive young collections and fill the older
        generations; see docs/performance.md, issue 14's third pass). ``abort`` is this
        wake-up's `abort`, bound once by the caller and held there (a bound method per
        park is one more object alive while parked; held here it would be a cycle)."""
        lowlevel = self._lowlevel
        if self._task is None:
            self._task = lowlevel.current_task()
            return lowlevel.wait_task_rescheduled(abort)  # type: ignore[no-any-return]
        return self._wait_more()

    async def _wait_more(self) -> None:
        # Apart from park(): a closure's variables are cells made on every call of the
        # function that holds them, and the common path has no use for them.
        lowlevel = self._lowlevel
        task = lowlevel.current_task()
        self._more.append(task)

        def abort(_raise_cancel: object) -> object:
            self._more.remove(task)
            return lowlevel.Abort.SUCCEEDED

        await lowlevel.wait_task_rescheduled(abort)


class _AnyioWakeup:
    """Elsewhere (asyncio): an `anyio.Event`, made anew after each `set`."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = anyio.Event()

    def set(self) -> None:
        self._event.set()

    def parked(self) -> bool:
        # An asyncio task whose wait was cancelled still looks parked until it runs:
        # never claimed, so outputs are always queued here.
        return False

    def abort(self, _raise_cancel: object) -> object:  # pragma: no cover (trio's only)
        raise AssertionError("an anyio wake-up has no abort callback")

    def park(self, abort: Callable[[object], object]) -> Awaitable[object]:
        event = self._event
        if event.is_set():
            event = self._event = anyio.Event()
        return event.wait()


def _wakeup_for_backend() -> _Wakeup:
    # trio is looked up, not imported, as in _cancel.backend_check.
    trio = sys.modules.get("trio")
    if trio is not None and trio.lowlevel.in_trio_task():
        return _TrioWakeup(trio.lowlevel)
    return _AnyioWakeup()


class Mailbox(Generic[T]):
    """An unbounded single-consumer queue fed synchronously by the receive task.

    Cancellation: a cancelled `receive` consumed nothing; the next call returns
    the same item.
    """

    def __init__(self) -> None:
        self._pending: collections.deque[T] = collections.deque()
        # Set by the producer only while _waiting; made for the consumer's backend on
        # its first wait (before that nobody waits, so a set() may do nothing).
        self._wakeup: _Wakeup = _NOBODY
        self._ended = False  # no more items will come (after the queued ones)
        self._error: Callable[[], BaseException] | None = None
        self._yield_due = 0.0  # until then a call that finds items may skip yielding
        # How many consumers are blocked on _wakeup. Only then does a put set it: a
        # consumer always looks at the queue before waiting, and setting an event per
        # item (with nobody waiting) was a large part of the raw API's CPU at 1
        # output/message. A count, not a flag: one consumer leaving its wait (woken or
        # cancelled) must not hide the others still parked from the producer.
        self._waiting = 0
        # The backend's "is a cancellation pending" predicate (_cancel.py), bound on
        # first use; when it answers True the call awaits checkpoint_if_cancelled.
        self._cancel_pending: Callable[[], bool] | None = None
        # The wake-up's abort, bound once (a bound method per park is one more object
        # alive while parked); held here, not by the wake-up: no reference cycle.
        self._abort_park: Callable[[object], object] = _NO_ABORT

    def __len__(self) -> int:
        return len(self._pending)

    # -- producer side (synchronous, never blocks; the client's, not for applications) --

    def put_nowait(self, item: T) -> None:
        """Queue ``item`` (dropped once the mailbox ended) and wake a parked consumer."""
        if not self._ended:
            self._pending.append(item)
            if self._waiting:  # only a waiting consumer needs waking
                self._wakeup.set()

    def put_many(self, items: list[T]) -> None:
        """`put_nowait` of every item of ``items``, in order, with one wake-up check:
        the receive loop's queueing of a receive batch's raw messages (one call per
        batch, not per message)."""
        if not self._ended:
            self._pending.extend(items)
            if self._waiting:
                self._wakeup.set()

    def _notify(self) -> None:
        if self._waiting:
            self._wakeup.set()

    def end(self, error: Callable[[], BaseException] | None = None) -> None:
        """No more items; with ``error``, calls raise ``error()`` once the queue is empty."""
        if error is None:
            self._ended = True
        elif self._error is None:
            self._error = error
        self._wakeup.set()

    # -- consumer side ---------------------------------------------------------------

    def _take(self) -> T:
        return self._pending.popleft()

    def _take_all(self) -> list[T]:
        items = list(self._pending)
        self._pending.clear()
        return items

    def _at_end(self) -> bool:
        return self._ended

    def take_now(self) -> T | None:
        """The fast path of a receive call, for a caller that wraps one (``get_output``):
        the next item when it can be handed out with no await at all (an item buffered,
        this mailbox yielded to other tasks less than `YIELD_INTERVAL` ago, and the
        backend's cancellation predicate says nothing is pending: the call's
        cancellation check, passed); otherwise ``None``, and the caller awaits
        `__anext__` (which checks, yields or waits). For mailboxes whose items are never
        ``None``; a subclass with its own `_take` bookkeeping overrides this.

        One call per batch on ``get_output``'s path (it was two, the check and the take,
        plus the predicate: issue 25)."""
        pending = self._pending
        if pending and _monotonic() < self._yield_due:
            check = self._cancel_pending
            if check is None:
                # The running backend's check (trio's or anyio's cancel state read
                # directly where that is known to be safe; _cancel.py).
                check = self._cancel_pending = backend_pending()
            if not check():
                return pending.popleft()
        return None

    def __aiter__(self) -> Mailbox[T]:
        return self

    async def __anext__(self) -> T:
        # While items are buffered, yield to other tasks at most once per interval
        # (always checking for cancellation): a full scheduler pass per item was most
        # of a lagging consumer's cost. Either way a cancelled call consumed nothing.
        # (`take_now` is this test as a method, for callers that wrap a receive;
        # here it stays inline: this is the per-output path of every stream.)
        if self._pending:
            if _monotonic() < self._yield_due:
                pending = self._cancel_pending
                if pending is None:
                    pending = self._cancel_pending = backend_pending()
                if pending():  # a plain call: no coroutine per output (_cancel.py)
                    await checkpoint_if_cancelled()  # raises if cancelled
                return self._take()
            await anyio.lowlevel.checkpoint()
        while True:
            if self._pending:
                self._yield_due = _monotonic() + YIELD_INTERVAL
                return self._take()
            if self._at_end() or self._error is not None:
                await anyio.lowlevel.checkpoint()
                if self._pending:
                    continue
                if self._at_end():
                    raise StopAsyncIteration
                assert self._error is not None
                raise self._error()
            # Nothing queued: the wait is this call's checkpoint (it yields and is
            # cancellable), so no checkpoint before it: one task switch per wake-up,
            # not two (many stream consumers each wake once per receive batch).
            wakeup = self._wakeup
            if wakeup is _NOBODY:
                wakeup = self._wakeup = _wakeup_for_backend()
                self._abort_park = wakeup.abort
            self._waiting += 1
            try:
                await wakeup.park(self._abort_park)
            finally:
                self._waiting -= 1

    def receive_nowait(self) -> T:
        """The next item if one is queued, without waiting (not a checkpoint).

        Raises ``anyio.WouldBlock`` when none is, ``anyio.EndOfStream`` after the
        last one, or the error the mailbox was closed with.
        """
        if self._pending:
            return self._take()
        if self._at_end():
            raise anyio.EndOfStream
        if self._error is not None:
            raise self._error()
        raise anyio.WouldBlock

    async def receive(self) -> T:
        """The next item; ``anyio.EndOfStream`` after the last one."""
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            raise anyio.EndOfStream from None

    async def receive_batch(self) -> list[T]:
        """Every queued item, in order, waiting for one if none is (never empty).

        One call, one cancellation check and at most one wake-up for however many
        items are queued, where iteration pays them per item. Waits, yields and checks
        for cancellation exactly as ``__anext__`` does; the rest is synchronous, so a
        cancelled call consumed nothing. Raises ``anyio.EndOfStream`` after the last
        item, or the error the mailbox was closed with once nothing is queued.
        """
        try:
            first = await self.__anext__()
        except StopAsyncIteration:
            raise anyio.EndOfStream from None
        if not self._pending:
            return [first]
        items = self._take_all()
        items.insert(0, first)
        return items
