"""Waiting on a zmq socket's edge-triggered ``ZMQ_FD`` without losing wake-ups.

`SocketWaits` is the base of `AsyncSocket`: the half that decides which task waits
on the fd and who is woken when, apart from the half that makes libzmq calls
(``_socket.py``). ``docs/transport.md`` has the long form:

* Only non-blocking libzmq calls are made. When a call raises ``zmq.Again`` the task
  waits for the socket's edge-triggered ``ZMQ_FD`` through ``anyio.wait_readable``.
* One task at a time owns the fd (``self._owner``); every other waiter parks on an
  ``anyio.Event``. When the owner stops waiting (woken, cancelled, closed) it wakes
  every parked waiter, which retry their call and elect a new owner.
* Any libzmq call may process the socket's command queue and thereby consume the
  fd's edge that a waiting task relies on. So after every successful call (and every
  option access) made while someone waits, ``EVENTS`` is re-read (`_after_call`) and
  the waiters whose event is ready are woken: the owner through
  ``anyio.notify_closing(fd)`` (cheaper than a cancel scope per wait; the owner tells
  it from a real close by the socket's closed flag), parked waiters by setting their
  event.
"""

from __future__ import annotations

import contextlib
from typing import Any, Final

import anyio
import anyio.lowlevel
import zmq

__all__ = ["BACKOFF_START", "SocketWaits"]

_EVENTS: Final = zmq.EVENTS
_POLLIN: Final = zmq.POLLIN
_POLLOUT: Final = zmq.POLLOUT

# Back-off when a call fails with EAGAIN although EVENTS says the direction is ready
# (a ROUTER_MANDATORY send to one full peer: POLLOUT is socket-wide). Waiting on the fd
# would return at once and spin, so wait on the fd with a growing timeout instead.
BACKOFF_START: Final = 50e-6
_BACKOFF_MAX: Final = 0.01


class _Owner:
    """The task currently blocked in ``wait_readable`` on the fd."""

    __slots__ = ("mask", "woken")

    def __init__(self, mask: int) -> None:
        self.mask = mask
        self.woken = False


class _Parked:
    """A task waiting for the owner to leave or for its event to become ready."""

    __slots__ = ("event", "mask")

    def __init__(self, mask: int) -> None:
        self.mask = mask
        self.event = anyio.Event()


class SocketWaits:
    """The fd-waiting state of one zmq socket: its owner task, its parked tasks, and
    the checkpoints of the calls (see the module documentation). `AsyncSocket`
    subclasses it; nothing else should."""

    def __init__(self, socket: zmq.Socket[Any]) -> None:
        self._socket = socket
        self._fd = int(socket.getsockopt(zmq.FD))
        self._closed = False
        self._owner: _Owner | None = None
        self._parked: list[_Parked] = []

    @property
    def waiting_tasks(self) -> int:
        """How many tasks are blocked in this socket right now (owner plus parked)."""
        return (self._owner is not None) + len(self._parked)

    def _check_open(self) -> None:
        if self._closed:
            raise anyio.ClosedResourceError

    def _wake_for_close(self) -> None:
        """The socket is closing (``_closed`` is set): wake every waiter, before the fd
        goes away, so they raise ``ClosedResourceError``."""
        if self._owner is not None:
            # RuntimeError: no event loop running here (teardown from a finalizer);
            # the owner's loop is gone, so there is no one left to wake.
            with contextlib.suppress(RuntimeError):
                anyio.notify_closing(self._fd)
        self._wake_all_parked()

    def _events(self) -> int:
        try:
            return int(self._socket.getsockopt(_EVENTS))
        except zmq.ZMQError:
            # Closed or terminated: wake everyone so they see the error themselves.
            return _POLLIN | _POLLOUT

    def _notify(self, events: int) -> None:
        """Wake the waiters whose event is in ``events`` (an EVENTS reading)."""
        owner = self._owner
        if owner is not None and owner.mask & events and not owner.woken:
            # notify_closing is the cheap way to end another task's wait_readable
            # (a cancel scope per wait costs more than the wait); the owner tells
            # this wake-up from a real close by self._closed.
            owner.woken = True
            anyio.notify_closing(self._fd)
        if self._parked:
            still: list[_Parked] = []
            for parked in self._parked:
                if parked.mask & events:
                    parked.event.set()
                else:
                    still.append(parked)
            self._parked = still

    def _after_call(self) -> None:
        # Any call (successful or not) may have consumed the edge a waiter needs;
        # re-read EVENTS while anyone waits. Parked waiters exist only while there is
        # an owner, so one check suffices.
        if self._owner is not None:
            self._notify(self._events())

    def _wake_all_parked(self) -> None:
        parked, self._parked = self._parked, []
        for waiter in parked:
            waiter.event.set()

    async def _wait(self, mask: int, backoff: float | None) -> float | None:
        """Wait until the ``mask`` direction may be ready; the caller then retries.

        ``backoff`` is None on a first wait. The return value is the back-off to pass
        next time: None after a real wake-up, a growing delay when EVENTS claimed
        readiness but the call failed anyway (so the caller never spins).

        Cancellation: nothing is consumed here, so a cancelled wait changes nothing.
        """
        if self._owner is not None:
            # The call that just failed may have processed the command that was to
            # wake the owner or a parked task: re-read EVENTS and pass it on.
            events = self._events()
            self._notify(events)
            if backoff is None and events & mask:
                return BACKOFF_START
            # In back-off, EVENTS already claimed readiness in vain: wake this task
            # only when the owner leaves, or a busy peer task would ping-pong with it.
            parked = _Parked(mask if backoff is None else 0)
            self._parked.append(parked)
            try:
                await parked.event.wait()
            finally:
                if not parked.event.is_set():
                    self._parked.remove(parked)
            self._check_open()
            return None

        if backoff is None:
            # EVENTS first: the fd only signals new commands, and this read processes
            # them. If the direction is already ready, retry without waiting.
            if self._events() & mask:
                return BACKOFF_START
            await self._own_fd(mask)
            return None
        # A back-off owner (mask 0) is not woken by EVENTS readings, for the same
        # reason as above; its deadline and the fd wake it.
        with anyio.move_on_after(backoff):
            await self._own_fd(0)
        return min(backoff * 2, _BACKOFF_MAX)

    async def _own_fd(self, mask: int) -> None:
        """Wait on the fd as its owner until it fires, a matching EVENTS reading wakes
        us, or the socket closes (ClosedResourceError). Parked tasks are woken after."""
        self._owner = _Owner(mask)
        try:
            await anyio.wait_readable(self._fd)
        except anyio.ClosedResourceError:
            if self._closed:
                raise
            # Otherwise it was _notify's wake-up call.
        finally:
            self._owner = None
            self._wake_all_parked()
        self._check_open()

    async def _begin_receive(self) -> None:
        """The one checkpoint of a receive.

        When nothing is queued and no other task waits, the wait on the fd is the
        checkpoint (it always yields and is cancellable), which saves a second yield
        and a failing receive per wait cycle. Otherwise it is `_checkpoint`.
        """
        self._check_open()
        if self._owner is None and not self._events() & _POLLIN:
            await self._own_fd(_POLLIN)
        else:
            await self._checkpoint()

    async def _checkpoint(self) -> None:
        """The one checkpoint of a call, taken before anything is dequeued or queued.

        The non-blocking call that follows either succeeds and returns without another
        await (so nothing can cancel it after the fact), or fails with ``Again`` and
        waits cancellably. Checkpointing after success instead would need a shield,
        and on asyncio a native ``Task.cancel()`` (``asyncio.timeout``) pierces anyio's
        shield and would lose the message.
        """
        self._check_open()
        await anyio.lowlevel.checkpoint_if_cancelled()
        await anyio.lowlevel.checkpoint()
        self._check_open()
