"""An anyio-native wrapper around one pyzmq socket (trio, asyncio, uvloop).

Design in brief (``docs/transport.md`` has the long form): only non-blocking libzmq
calls are made; who waits on the socket's edge-triggered fd, and who is woken after
a call that may have consumed its edge, is `SocketWaits` (``_waits.py``), the base
class. Here are the calls.

* Cancellation contract: every async call takes its one checkpoint *before* it
  touches the queue. The non-blocking libzmq call is atomic, so a task cancelled at
  that checkpoint or while waiting on the fd has neither sent nor received anything;
  once the call succeeds the method returns without another await, so the result
  cannot be dropped. (Checkpointing after success would need a cancel shield, and on
  asyncio a native ``Task.cancel()`` from ``asyncio.timeout`` pierces anyio's shield.)
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import anyio
import anyio.lowlevel
import zmq

from .._exceptions import UnroutableError
from ._endpoints import PrivateIpcDir, is_ipv6_endpoint, normalize_endpoint
from ._waits import BACKOFF_START, SocketWaits

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence
    from types import TracebackType

__all__ = [
    "DEFAULT_BATCH_BYTES",
    "DEFAULT_COPY_THRESHOLD",
    "AsyncSocket",
    "InFrame",
    "OutFrame",
    "wait_tracker",
]

InFrame: TypeAlias = bytes | zmq.Frame
"""A received frame: ``bytes``, or a zero-copy ``zmq.Frame`` for a large frame.

A ``zmq.Frame`` supports the buffer protocol; ``frame.buffer`` is a ``memoryview`` of
it that type-checks (pyzmq's stubs do not declare ``Frame`` a buffer).
"""

OutFrame: TypeAlias = bytes | bytearray | memoryview | zmq.Frame
"""Anything that can be sent as one frame (any object with the buffer protocol)."""

OptionValue: TypeAlias = int | bytes | str

DEFAULT_COPY_THRESHOLD: Final = 65536
"""Frames (after the first of a message) at least this large are received zero-copy.

Below 64 KiB libzmq copies anyway, and a ``zmq.Frame`` costs more than ``bytes``.
"""

DEFAULT_BATCH_BYTES: Final = 256 * 1024
"""``receive_batch`` stops adding messages once a batch holds this many bytes.

Holding megabytes per batch costs more (allocator, cache) than the extra checkpoints.
"""

_NOBLOCK: Final = zmq.NOBLOCK
_POLLIN: Final = zmq.POLLIN
_POLLOUT: Final = zmq.POLLOUT


class AsyncSocket(SocketWaits):
    """An async ZeroMQ socket for anyio (trio, asyncio, uvloop), owning a ``zmq.Socket``.

    Use it from the one event-loop thread that first awaits it. Several tasks may use
    it at once (one receiving while another sends, two receivers, option access while
    a task waits); the wrapper keeps wake-ups from getting lost. Do not touch the
    underlying ``zmq.Socket`` directly: an ``EVENTS`` read or any other call behind
    the wrapper's back can swallow a waiting task's wake-up.

    Cancellation contract for every ``async`` method: if it raises the cancellation
    exception, nothing was sent or received; if it returns, the message went out (or
    was received and is returned). Each call is one checkpoint. The ``*_nowait``
    methods and `send_many` are synchronous and never checkpoints.

    Errors: ``anyio.ClosedResourceError`` after `close` (including for tasks
    waiting when it is called), ``anyio.BrokenResourceError`` if the zmq context was
    terminated under the socket, `trio_vllm.UnroutableError` for a ROUTER send
    to an unknown identity (``ROUTER_MANDATORY`` is on for ROUTER sockets made by
    `create`), other ``zmq.ZMQError`` as raised by pyzmq.

    Args:
        socket: the pyzmq socket to own; the wrapper closes it.
        linger: milliseconds ``close()`` lets unsent messages linger (``zmq.LINGER``).
        copy_threshold: every frame after the first of a message that is at least this
            many bytes is received zero-copy as a ``zmq.Frame`` (buffer protocol); other
            frames are ``bytes``. ``None`` receives everything as ``bytes``. The first
            frame is always ``bytes`` (it is an envelope or header in every protocol
            here, and copying it is the fastest path for small messages).
    """

    def __init__(
        self,
        socket: zmq.Socket[Any],
        *,
        linger: int = 0,
        copy_threshold: int | None = DEFAULT_COPY_THRESHOLD,
    ) -> None:
        if socket.closed:
            raise anyio.ClosedResourceError("the zmq socket is already closed")
        super().__init__(socket)
        self._linger = linger
        self._copy_threshold = copy_threshold
        self._ipc_dir: PrivateIpcDir | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(
        cls,
        context: zmq.Context[Any],
        socket_type: int,
        *,
        options: Mapping[int, OptionValue] | None = None,
        router_mandatory: bool = True,
        linger: int = 0,
        copy_threshold: int | None = DEFAULT_COPY_THRESHOLD,
    ) -> AsyncSocket:
        """Create a socket of ``socket_type`` on ``context`` and wrap it.

        ``options`` are set in order before the socket is wrapped. For a ROUTER socket
        ``ROUTER_MANDATORY`` is set unless ``router_mandatory=False``, so a send to an
        unknown identity raises `UnroutableError` instead of being
        dropped silently. ``LINGER`` is set to ``linger``.
        """
        sock: zmq.Socket[Any] = context.socket(socket_type)
        try:
            sock.setsockopt(zmq.LINGER, linger)
            if socket_type == zmq.ROUTER and router_mandatory:
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            for option, value in (options or {}).items():
                _setsockopt(sock, option, value)
        except BaseException:
            sock.close(linger=0)
            raise
        return cls(sock, linger=linger, copy_threshold=copy_threshold)

    # ------------------------------------------------------------------ properties

    @property
    def closed(self) -> bool:
        """True once `close` was called."""
        return self._closed

    @property
    def socket_type(self) -> int:
        """The ZeroMQ socket type (``zmq.DEALER``, ...)."""
        return int(self._socket.type)

    @property
    def fileno(self) -> int:
        """The socket's ``ZMQ_FD`` (edge-triggered; for diagnostics only)."""
        return self._fd

    # ------------------------------------------------------------------ options

    def get_option(self, option: int) -> int | bytes:
        """``getsockopt`` through the wrapper, waking waiters whose event became ready.

        Raises:
            anyio.ClosedResourceError: the socket was closed.
        """
        self._check_open()
        try:
            value: int | bytes = self._socket.getsockopt(option)
        except zmq.ZMQError as exc:
            raise self._translate(exc) from exc
        finally:
            self._after_call()
        return value

    def set_option(self, option: int, value: OptionValue) -> None:
        """``setsockopt`` through the wrapper (``str`` values are UTF-8 encoded).

        Raises:
            anyio.ClosedResourceError: the socket was closed.
        """
        self._check_open()
        try:
            _setsockopt(self._socket, option, value)
        except zmq.ZMQError as exc:
            raise self._translate(exc) from exc
        finally:
            self._after_call()
        if option == zmq.LINGER and isinstance(value, int):
            self._linger = value

    def subscribe(self, topic: bytes = b"") -> None:
        """Subscribe a SUB socket to ``topic`` (``b""``: everything)."""
        self.set_option(zmq.SUBSCRIBE, topic)

    # ------------------------------------------------------------------ endpoints

    def bind(self, endpoint: str) -> str:
        """Bind and return the real endpoint (``ZMQ_LAST_ENDPOINT``).

        ``tcp://host:0`` and ``tcp://host:*`` bind a free port, and the returned string
        names it. An IPv6 literal host is bracketed and ``IPV6=1`` is set first.
        """
        self._check_open()
        endpoint = normalize_endpoint(endpoint, bind=True)
        try:
            if is_ipv6_endpoint(endpoint):
                self._socket.setsockopt(zmq.IPV6, 1)
            self._socket.bind(endpoint)
            last = self._socket.getsockopt(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            raise self._translate(exc) from exc
        finally:
            self._after_call()
        assert isinstance(last, bytes)
        return last.decode()

    def bind_ipc(self, name: str | None = None) -> str:
        """Bind to an ``ipc://`` path in a private temporary directory; return the endpoint.

        The directory (mode 0700) is created on first use and removed, with the socket
        files in it, when this socket is closed.
        """
        self._check_open()
        if self._ipc_dir is None:
            self._ipc_dir = PrivateIpcDir()
        return self.bind(self._ipc_dir.endpoint(name))

    def connect(self, endpoint: str) -> str:
        """Connect and return the endpoint as used (IPv6 bracketed, ``IPV6=1`` set)."""
        self._check_open()
        endpoint = normalize_endpoint(endpoint, bind=False)
        try:
            if is_ipv6_endpoint(endpoint):
                self._socket.setsockopt(zmq.IPV6, 1)
            self._socket.connect(endpoint)
        except zmq.ZMQError as exc:
            raise self._translate(exc) from exc
        finally:
            self._after_call()
        return endpoint

    # ------------------------------------------------------------------ receiving

    async def receive(self) -> list[InFrame]:
        """Receive one multipart message, waiting if none is queued.

        Cancellation: if cancelled, no message was dequeued.

        Raises:
            anyio.ClosedResourceError: the socket was closed (also while waiting).
        """
        await self._begin_receive()
        backoff: float | None = None
        while True:
            try:
                message = self._recv_message()
            except zmq.Again:
                backoff = await self._wait(_POLLIN, backoff)
            except zmq.ZMQError as exc:
                self._after_call()
                raise self._translate(exc) from exc
            else:
                break
        self._after_call()
        return message

    async def receive_batch(
        self, max_messages: int = 256, *, max_bytes: int = DEFAULT_BATCH_BYTES
    ) -> list[list[InFrame]]:
        """Receive between 1 and ``max_messages`` messages: all that are queued, in order.

        Drains with non-blocking calls and waits on the fd only when nothing is queued,
        so a busy socket costs one checkpoint per batch, not per message. The batch also
        ends once it holds ``max_bytes`` of frames (the message that crosses the limit
        is included), which keeps large messages from piling up in memory.

        Cancellation: if cancelled, no message was dequeued.

        Raises:
            anyio.ClosedResourceError: the socket was closed (also while waiting).
            ValueError: ``max_messages < 1``.
        """
        if max_messages < 1:
            raise ValueError("max_messages must be at least 1")
        await self._begin_receive()
        backoff: float | None = None
        while True:
            batch = self._drain(max_messages, max_bytes)
            if batch:
                break
            backoff = await self._wait(_POLLIN, backoff)
        self._after_call()
        return batch

    def receive_nowait(self) -> list[InFrame]:
        """Receive one message if one is queued; not a checkpoint.

        Raises:
            anyio.WouldBlock: nothing is queued.
            anyio.ClosedResourceError: the socket was closed.
        """
        self._check_open()
        try:
            message = self._recv_message()
        except zmq.Again:
            raise anyio.WouldBlock from None
        except zmq.ZMQError as exc:
            raise self._translate(exc) from exc
        finally:
            # Failed calls process libzmq's commands too and can eat a waiter's edge.
            self._after_call()
        return message

    # ------------------------------------------------------------------ sending

    async def send(self, frames: Sequence[OutFrame], *, copy: bool = True) -> None:
        """Send one multipart message, waiting while the high-water mark is reached.

        With ``copy=False`` frames of 64 KiB and more are sent zero-copy: the buffer is
        shared with libzmq until it has been sent, so do not mutate it (use
        `send_tracked` to learn when it is safe).

        Cancellation: if cancelled, the message was not queued and will never be sent.

        Raises:
            trio_vllm.UnroutableError: ROUTER with ``ROUTER_MANDATORY`` and no peer has
                the identity in ``frames[0]``.
            anyio.ClosedResourceError: the socket was closed (also while waiting).
        """
        await self._checkpoint()
        await self._send_blocking(frames, copy=copy, track=False)
        self._after_call()

    async def send_tracked(self, frames: Sequence[OutFrame]) -> zmq.MessageTracker:
        """Send zero-copy and return a tracker; ``await wait_tracker(t)`` before reusing buffers.

        Same waiting, cancellation and errors as `send`. Frames below pyzmq's
        copy threshold are copied anyway and their tracker is done at once.
        """
        await self._checkpoint()
        tracker = await self._send_blocking(frames, copy=False, track=True)
        self._after_call()
        assert tracker is not None
        return tracker

    def send_nowait(self, frames: Sequence[OutFrame], *, copy: bool = True) -> None:
        """Send one message if it can go without waiting; not a checkpoint.

        Raises:
            anyio.WouldBlock: the high-water mark is reached (for a ROUTER: that peer's),
                and nothing was queued.
            trio_vllm.UnroutableError: ROUTER to an unknown identity.
            anyio.ClosedResourceError: the socket was closed.
        """
        self._check_open()
        try:
            self._socket.send_multipart(frames, _NOBLOCK, copy=copy)
        except zmq.Again:
            raise anyio.WouldBlock from None
        except zmq.ZMQError as exc:
            raise self._translate(exc, frames) from exc
        finally:
            self._after_call()

    def send_many(self, messages: Iterable[Sequence[OutFrame]], *, copy: bool = True) -> int:
        """Send messages in order until one would block; return how many were sent.

        The hot path for a ROUTER fanning out to several peers: no checkpoint, one
        wake-up check for the whole call. It stops before the first message that
        cannot go now (high-water mark, or an error); if that is the very first
        message, the error is raised (`UnroutableError`,
        ``anyio.ClosedResourceError``, ...) but ``anyio.WouldBlock`` is not: the
        return value is then 0. Call again with the rest (``messages[n:]``) to see
        the error, or ``await send(...)`` to wait for room. Pass a sequence: from a
        one-shot iterator the message that could not go has already been taken.
        """
        self._check_open()
        sent = 0
        send = self._socket.send_multipart
        try:
            for frames in messages:
                try:
                    send(frames, _NOBLOCK, copy=copy)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    if sent:
                        break
                    raise self._translate(exc, frames) from exc
                sent += 1
        finally:
            self._after_call()
        return sent

    # ------------------------------------------------------------------ closing

    def close(self, linger: int | None = None) -> None:
        """Close the socket now; idempotent, synchronous and not a checkpoint.

        Every task waiting in this socket is woken with ``anyio.ClosedResourceError``
        (``anyio.notify_closing`` runs before the fd goes away, so no waiter hangs).
        Queued outgoing messages linger for ``linger`` ms (default: the ``linger``
        given at construction). A private ipc directory is removed.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._wake_for_close()
        finally:
            self._socket.close(linger=self._linger if linger is None else linger)
            if self._ipc_dir is not None:
                self._ipc_dir.cleanup()

    async def aclose(self) -> None:
        """Close the socket (see `close`), then checkpoint."""
        self.close()
        await anyio.lowlevel.checkpoint()

    async def __aenter__(self) -> AsyncSocket:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __enter__(self) -> AsyncSocket:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"fd={self._fd}"
        return f"<AsyncSocket type={self._socket_type_name()} {state}>"

    # ------------------------------------------------------------------ internals

    def _socket_type_name(self) -> str:
        try:
            return zmq.SocketType(int(self._socket.type)).name
        except Exception:
            return "?"

    def _translate(
        self, exc: zmq.ZMQError, frames: Sequence[OutFrame] | None = None
    ) -> BaseException:
        if self._closed or exc.errno == zmq.ENOTSOCK:
            return anyio.ClosedResourceError()
        if exc.errno == zmq.ETERM:
            return anyio.BrokenResourceError("the zmq context was terminated")
        if exc.errno == errno.EHOSTUNREACH and frames:
            first = frames[0]
            identity = first.bytes if isinstance(first, zmq.Frame) else bytes(first)
            return UnroutableError(f"no connected peer has the identity {identity!r}")
        return exc

    def _recv_message(self) -> list[InFrame]:
        frame: zmq.Frame = self._socket.recv(_NOBLOCK, copy=False)
        first: bytes = frame.bytes
        if not frame.more:
            return [first]
        return self._recv_rest(first)

    def _recv_rest(self, first: bytes) -> list[InFrame]:
        """The frames after ``first`` of a multipart message (all already queued)."""
        sock = self._socket
        message: list[InFrame] = [first]
        threshold = self._copy_threshold
        while True:
            frame: zmq.Frame = sock.recv(_NOBLOCK, copy=False)
            if threshold is None or len(frame) < threshold:
                message.append(frame.bytes)
            else:
                message.append(frame)
            if not frame.more:
                return message

    def _drain(self, max_messages: int, max_bytes: int) -> list[list[InFrame]]:
        # The hot loop, inlined. The first frame comes as a zmq.Frame and is copied out:
        # Frame.more is a field read, where getsockopt(RCVMORE) (what recv_multipart
        # does) makes pyzmq build a SocketOption enum per call.
        sock = self._socket
        recv = sock.recv
        batch: list[list[InFrame]] = []
        append = batch.append
        nbytes = 0
        try:
            while True:
                frame: zmq.Frame = recv(_NOBLOCK, copy=False)
                first: bytes = frame.bytes
                if frame.more:
                    message = self._recv_rest(first)
                    nbytes += sum(map(len, message))
                    append(message)
                else:
                    nbytes += len(first)
                    append([first])
                if len(batch) >= max_messages or nbytes >= max_bytes:
                    break
        except zmq.Again:
            pass
        except zmq.ZMQError as exc:
            if not batch:
                self._after_call()
                raise self._translate(exc) from exc
            # Deliver what was dequeued; a persistent error shows up on the next call.
        return batch

    async def _send_blocking(
        self, frames: Sequence[OutFrame], *, copy: bool, track: bool
    ) -> zmq.MessageTracker | None:
        backoff: float | None = None
        while True:
            try:
                return self._socket.send_multipart(frames, _NOBLOCK, copy=copy, track=track)
            except zmq.Again:
                backoff = await self._wait(_POLLOUT, backoff)
            except zmq.ZMQError as exc:
                self._after_call()
                raise self._translate(exc, frames) from exc


def _setsockopt(sock: zmq.Socket[Any], option: int, value: OptionValue) -> None:
    if isinstance(value, str):
        sock.setsockopt_string(option, value)
    else:
        sock.setsockopt(option, value)


async def wait_tracker(tracker: zmq.MessageTracker, *, max_interval: float = 0.005) -> None:
    """Wait until libzmq is done with a zero-copy send, without blocking the thread.

    ``tracker.wait()`` would block the event loop, so this polls ``tracker.done`` with a
    growing sleep (50 us up to ``max_interval``). Cancellation only stops the waiting;
    the message was already sent.
    """
    await anyio.lowlevel.checkpoint()
    interval = BACKOFF_START
    while not tracker.done:
        await anyio.sleep(interval)
        interval = min(interval * 2, max_interval)
