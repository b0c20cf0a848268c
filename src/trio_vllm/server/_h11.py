"""An HTTP/1.1 server on h11 over non-blocking sockets: ``trio-vllm serve``'s default on trio.

Why not hypercorn's trio worker (still there: ``--http-server hypercorn``): for every ASGI
``http.response.body`` it runs its generic protocol stack (an h11 event, a send lock, a
shielded cancel scope, a timer reset and ``send_all``): ~40 us a send above the socket
(docs/performance.md), more than the rest of a streamed token's path. This server does
what ``trio-vllm serve`` needs of HTTP/1.1 and no more: h11 parses every request and
writes every response head and end (so its state machine decides keep-alive and
framing), and the hot path, a chunk of an SSE body, is framed here with the same bytes
h11's chunked writer makes and written with one ``send`` on the socket.

Behaviour kept from hypercorn's worker, as the server tests check it:

* keep-alive, with a connection closed once it has been idle (no request in flight,
  a request head still incomplete included: slowloris) for ``keep_alive_timeout``
  seconds, and after ``keep_alive_max_requests`` requests;
* ``http.disconnect`` reaches the app as soon as the client goes away while a response
  is in flight (the app's watcher calls ``receive()`` after the body, which then reads
  the socket), and also once the response is complete;
* or, without a task per request: an app may instead register a callback with the
  scope's ``WATCH_DISCONNECT`` extension (`_DisconnectWatch`: one epoll set of such
  sockets for the whole server, watched by one task, the peer's FIN or reset waking
  it), as ``trio-vllm serve``'s generation endpoints do;
* a malformed request gets 400 (431 for an oversized head) and the connection closes;
* on ``shutdown_trigger``: the listener closes, idle connections close, a connection
  with a request in flight closes after its response, and what is still running after
  ``graceful_timeout`` is cancelled.

Cancellation: cancelling `serve_h11` closes the listener and every connection at once.
Every task (one per connection) is owned by its nursery; none outlives the call.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import select
import socket as _stdlib_socket
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import h11
import trio
from trio.lowlevel import wait_readable, wait_writable

from ._http import SEND_NOWAIT, WATCH_DISCONNECT

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from anyio.abc import TaskStatus

__all__ = ["serve_h11"]

logger = logging.getLogger("trio_vllm.server")
access_logger = logging.getLogger("trio_vllm.server.access")

_MAX_RECV = 65536
_MAX_HEAD = 16 * 1024  # an incomplete head larger than this gets 431 (as hypercorn)
# What a client may send beyond the request being answered (a pipelined next request)
# before the server stops reading until the response is done.
_MAX_AHEAD = 64 * 1024
_LINGER_SECONDS = 2.0
_LINGER_BYTES = 16 * 1024 * 1024
_ASGI = {"version": "3.0", "spec_version": "2.3"}
_DISCONNECT = {"type": "http.disconnect"}
_EMPTY_BODY = {"type": "http.request", "body": b"", "more_body": False}
_SERVER = (b"server", b"trio-vllm")
_REASONS = {int(s): s.phrase.encode() for s in HTTPStatus}
_END = h11.EndOfMessage()  # events are immutable: one for every response


class _Date:
    """The ``date`` header's value, made at most once a second."""

    __slots__ = ("second", "value")

    def __init__(self) -> None:
        self.second = -1
        self.value = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second = now
            self.value = formatdate(now, usegmt=True).encode()
        return self.value


_DATE = _Date()


class _DisconnectWatch:
    """The sockets whose apps asked to hear of the client going away (the
    ``WATCH_DISCONNECT`` extension), in one epoll set (peer FIN, reset or error; not
    data: a pipelined next request stays in the kernel until its turn), watched by one
    task for the whole server: per request two ``epoll_ctl`` calls, instead of a task
    waiting in ``receive()`` and its cancellation."""

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.watched: dict[int, tuple[_Connection, Callable[[], object]]] = {}

    def watch(self, conn: _Connection, callback: Callable[[], object]) -> int:
        fd = conn.sock.fileno()
        if fd in self.watched:
            raise RuntimeError("the disconnect of this exchange is watched already")
        self.epoll.register(fd, select.EPOLLRDHUP)  # EPOLLHUP and EPOLLERR implied
        self.watched[fd] = (conn, callback)
        return fd

    def unwatch(self, fd: int) -> None:
        if self.watched.pop(fd, None) is not None:
            with contextlib.suppress(OSError):
                self.epoll.unregister(fd)

    async def run(self) -> None:
        """Call each watched socket's callback once its client has gone. Cancellation:
        stops watching (the sockets stay registered until unwatched)."""
        poll = self.epoll.poll
        while True:
            await wait_readable(self.epoll)
            for fd, _ in poll(0):
                self.gone(fd)

    def gone(self, fd: int) -> None:
        """The client of the watched socket ``fd`` went away: call back (once)."""
        entry = self.watched.get(fd)
        if entry is None:
            return
        self.unwatch(fd)
        conn, callback = entry
        conn.broken = True  # as a read that saw the end would mark it
        try:
            callback()
        except Exception:
            logger.exception("error in a disconnect callback")

    def close(self) -> None:
        self.watched.clear()
        self.epoll.close()


class _Server:
    """What the connections share: the app, the limits, and shutdown's state."""

    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        keep_alive_timeout: float,
        keep_alive_max_requests: int,
        access_log: bool,
    ) -> None:
        self.app = app
        self.keep_alive_timeout = keep_alive_timeout
        self.keep_alive_max_requests = keep_alive_max_requests
        self.access_log = access_log
        self.closing = False
        # None: not served by serve_h11 (or no epoll here): apps use receive()
        self.disconnects: _DisconnectWatch | None = None
        self.idle: set[_Connection] = set()  # connections waiting for a request head
        self.open = 0
        self.all_closed = trio.Event()

    def begin_shutdown(self) -> None:
        self.closing = True
        for conn in list(self.idle):
            conn.idle_scope.cancel()


class _Connection:
    """One client connection: requests one after the other (h11 keeps the order)."""

    def __init__(self, server: _Server, sock: _stdlib_socket.socket) -> None:
        self.server = server
        self.sock = sock
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        self.idle_scope = trio.CancelScope()
        self.broken = False  # a send failed or the peer went away
        self.linger = False  # closing while the client may still be sending
        self.reader_scope: trio.CancelScope | None = None  # receive() waiting on recv
        # Bytes of a response that send_nowait could not write: they go out first.
        self.backlog = b""
        try:
            client: tuple[str, int] | None = sock.getpeername()[:2]
        except OSError:
            client = None
        self.client = client
        self.local = sock.getsockname()[:2]

    # -------------------------------------------------------------- reading

    async def read_more(self) -> int:
        """Feed the socket's next bytes to h11; how many (0: EOF or a reset).

        The socket is read at once when it has bytes (no scheduler pass: the callers
        wait elsewhere), else when it becomes readable. Cancellation: nothing read."""
        data = await self.recv()
        if not data:
            self.broken = True
        self.h11.receive_data(data)
        return len(data)

    async def recv(self) -> bytes:
        sock = self.sock
        while True:
            try:
                return sock.recv(_MAX_RECV)
            except BlockingIOError:
                await wait_readable(sock)
            except OSError:
                return b""

    async def next_event(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                await self.read_more()
                continue
            return event

    # -------------------------------------------------------------- writing

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Write the backlog, then everything, or mark the connection broken (no
        exception: the app learns of a gone client from ``receive()``, as with
        hypercorn). Cancelled, nothing of ``data`` is written unless the connection
        is broken (a part of the backlog may be, the rest stays)."""
        if self.broken:
            return
        backlog = self.backlog
        if backlog:
            self.backlog = b""
            data = backlog + data
        sock = self.sock
        try:
            # Written at once if the kernel takes it all (the common case): no
            # scheduler pass per write (trio's socket send makes one), the task that
            # writes has just woken anyway.
            try:
                sent = sock.send(data)
            except BlockingIOError:
                sent = 0
            if sent < len(data):
                view = memoryview(data)[sent:]
                while view:
                    try:
                        await wait_writable(sock)
                    except trio.Cancelled:
                        out = len(data) - len(view)
                        if out < len(backlog):
                            self.backlog = bytes(view[: len(backlog) - out])
                        elif out > len(backlog):
                            # Part of a message is out: the connection's next bytes
                            # would no longer frame; it can only be closed.
                            self.broken = True
                        raise
                    with contextlib.suppress(BlockingIOError):
                        view = view[sock.send(view) :]
        except OSError:
            self.gone()

    def send_nowait(self, data: bytes) -> bool:
        """Write ``data`` now if the socket takes it all; else keep the rest as the
        backlog (`send_all` writes it first) and return ``False``. Never waits."""
        if self.broken:
            return True
        if self.backlog:
            self.backlog += data
            return False
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.gone()
            return True
        if sent < len(data):
            self.backlog = data[sent:]
            return False
        return True

    def gone(self) -> None:
        """A send failed: the client went away."""
        self.broken = True
        self.backlog = b""
        scope = self.reader_scope
        if scope is not None:  # the app's watcher: the client is gone
            scope.cancel()
        disconnects = self.server.disconnects
        if disconnects is not None:  # or the app's WATCH_DISCONNECT callback
            disconnects.gone(self.sock.fileno())

    # -------------------------------------------------------------- serving

    async def serve(self) -> None:
        server = self.server
        requests = 0
        try:
            while not server.closing:
                server.idle.add(self)
                self.idle_scope = trio.CancelScope(
                    deadline=trio.current_time() + server.keep_alive_timeout
                )
                event: Any = None
                try:
                    with self.idle_scope:
                        event = await self.next_event()
                except h11.RemoteProtocolError as exc:
                    await self._protocol_error(exc)
                    return
                finally:
                    server.idle.discard(self)
                if event is None or not isinstance(event, h11.Request):
                    return  # idle too long, shutting down, or the client closed
                requests += 1
                keep = await self._cycle(event, requests >= server.keep_alive_max_requests)
                if not keep:
                    return
                self.h11.start_next_cycle()
                # One scheduler pass per request: reads and writes that complete at
                # once do not yield, and a client pipelining requests must not hold
                # the loop. (Before the loop's test: shutdown may begin during it.)
                await trio.lowlevel.checkpoint()
        finally:
            try:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(_stdlib_socket.SHUT_WR)
                if self.linger and not self.broken:
                    await self._linger()
            finally:
                self.sock.close()

    async def _linger(self) -> None:
        """Read and drop what the client still sends before closing: closing with
        unread bytes resets the connection, and a reset can destroy the error answer
        (400, 413, 431) before the client reads it (a lingering close, as nginx's)."""
        left = _LINGER_BYTES
        with trio.move_on_after(_LINGER_SECONDS):
            while left > 0:
                data = await self.recv()
                if not data:
                    return
                left -= len(data)

    async def _protocol_error(self, exc: h11.RemoteProtocolError) -> None:
        self.linger = True
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        status = exc.error_status_hint
        body = f"{status} {exc}".encode()
        try:
            data = self.h11.send(
                h11.Response(
                    status_code=status,
                    reason=_REASONS.get(status, b""),
                    headers=[
                        (b"content-type", b"text/plain; charset=utf-8"),
                        (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close"),
                        (b"date", _DATE.get()),
                        _SERVER,
                    ],
                )
            )
            assert data is not None
            data += self.h11.send(h11.Data(data=body)) or b""
            data += self.h11.send(_END) or b""
        except h11.LocalProtocolError:
            return
        await self.send_all(data)

    async def _cycle(self, request: h11.Request, last: bool) -> bool:
        """Run the app on one request; whether the connection can take another."""
        exchange = _Exchange(self, request, last or self.server.closing)
        try:
            try:
                await self.server.app(exchange.scope, exchange.receive, exchange.send)
            finally:
                exchange.unwatch()  # before the socket can close (its fd be reused)
        except Exception:
            logger.exception("error in the ASGI app")
            if not exchange.head_sent:
                await exchange.send({"type": "http.response.start", "status": 500, "headers": []})
                await exchange.send({"type": "http.response.body", "body": b""})
            self.broken = True
        if self.h11.their_state is h11.SEND_BODY:  # the client may still be sending
            self.linger = True
        if not exchange.complete:
            # The app returned without finishing its response (or died in it): the
            # client cannot tell where it ends, so the connection goes.
            return False
        if self.server.access_log:
            access_logger.info(
                '%s - "%s %s HTTP/%s" %d',
                f"{self.client[0]}:{self.client[1]}" if self.client else "-",
                request.method.decode("latin-1"),
                request.target.decode("latin-1"),
                request.http_version.decode("latin-1"),
                exchange.status,
            )
        if self.broken or self.server.closing:
            return False
        # The request's body the app did not read: read it to its end (keep-alive) if
        # it is small, otherwise close.
        h = self.h11
        if h.their_state is h11.SEND_BODY:
            self.linger = True
            skipped = 0
            while True:
                event = await self.next_event_or_none()
                if event is None or isinstance(event, h11.ConnectionClosed):
                    return False
                if isinstance(event, h11.Data):
                    skipped += len(event.data)
                    if skipped > _MAX_AHEAD:
                        return False
                elif isinstance(event, h11.EndOfMessage):
                    break
        return h.our_state is h11.DONE and h.their_state is h11.DONE

    async def next_event_or_none(self) -> Any:
        try:
            return await self.next_event()
        except h11.RemoteProtocolError:
            return None


class _Exchange:
    """One request and its response: the ASGI ``scope``, ``receive`` and ``send``."""

    __slots__ = (
        "chunked",
        "complete",
        "conn",
        "head_only",
        "head_sent",
        "headers",
        "last",
        "request_done",
        "scope",
        "status",
        "watched",
    )

    def __init__(self, conn: _Connection, request: h11.Request, last: bool) -> None:
        self.conn = conn
        self.last = last
        self.watched = -1  # the fd watch_disconnect registered
        target = request.target
        path, _, query = target.partition(b"?")
        raw_path = path
        self.scope: dict[str, Any] = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": request.http_version.decode("ascii"),
            "method": request.method.decode("ascii"),
            "scheme": "http",
            "path": unquote(path.decode("latin-1")),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": list(request.headers),
            "client": conn.client,
            "server": conn.local,
            "extensions": {SEND_NOWAIT: self.send_nowait}
            if conn.server.disconnects is None
            else {WATCH_DISCONNECT: self.watch_disconnect, SEND_NOWAIT: self.send_nowait},
        }
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_sent = False
        self.chunked = False
        self.complete = False
        self.request_done = False
        self.head_only = request.method == b"HEAD"  # h11 sends no body bytes for it

    def watch_disconnect(self, callback: Callable[[], object]) -> Callable[[], None]:
        """The ``WATCH_DISCONNECT`` extension: ``callback()`` once the client goes away
        (from the server's watcher task), until the returned ``stop()`` is called or
        the exchange ends. One watch per exchange."""
        disconnects = self.conn.server.disconnects
        assert disconnects is not None
        if self.conn.broken:  # gone already (the body's end may have shown it)
            callback()
            return self.unwatch
        self.watched = disconnects.watch(self.conn, callback)
        return self.unwatch

    def unwatch(self) -> None:
        fd = self.watched
        if fd >= 0:
            self.watched = -1
            disconnects = self.conn.server.disconnects
            if disconnects is not None:
                disconnects.unwatch(fd)

    async def receive(self) -> dict[str, Any]:
        """The request body, then ``http.disconnect`` once the client goes away (or
        once the response is complete). Cancellation: nothing is lost; the bytes a
        cancelled read got are h11's to hand out next time."""
        conn = self.conn
        if not self.request_done:
            h = conn.h11
            if h.they_are_waiting_for_100_continue and not self.head_sent:
                data = h.send(
                    h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
                )
                if data:
                    await conn.send_all(data)
            try:
                event = await conn.next_event()
            except h11.RemoteProtocolError:
                conn.broken = True
                self.request_done = True
                return _DISCONNECT
            if isinstance(event, h11.Data):
                return {"type": "http.request", "body": bytes(event.data), "more_body": True}
            self.request_done = True
            if isinstance(event, h11.EndOfMessage):
                return _EMPTY_BODY
            conn.broken = True  # ConnectionClosed in the body
            return _DISCONNECT
        # After the body: wait for the client to go away, reading (and keeping for
        # h11) whatever it sends meanwhile, up to _MAX_AHEAD bytes.
        ahead = 0
        while not (self.complete or conn.broken):
            with trio.CancelScope() as scope:
                conn.reader_scope = scope  # a failed send cancels it: the client is gone
                try:
                    if ahead > _MAX_AHEAD:  # read no more; a failed send still wakes us
                        await trio.sleep_forever()
                    got = await conn.read_more()
                    if not got:
                        break
                    ahead += got
                finally:
                    conn.reader_scope = None
        return _DISCONNECT

    async def send(self, message: dict[str, Any]) -> None:
        """``http.response.start`` is kept and goes out with the first body bytes;
        each ``http.response.body`` is one socket write (after what `send_nowait`
        left: an empty body writes just that). A send after the client went away does
        nothing (the app learns of it from ``receive()``)."""
        kind = message["type"]
        conn = self.conn
        if kind == "http.response.body":
            body = message.get("body", b"")
            more = message.get("more_body", False)
            if more and self.chunked and not self.complete:  # the hot path: an SSE chunk
                if body:
                    await conn.send_all(b"%x\r\n%b\r\n" % (len(body), body))
                elif conn.backlog:
                    await conn.send_all(b"")
                return
            data = self._body(body, more)
            if data or conn.backlog:
                await conn.send_all(data)
        elif kind == "http.response.start":
            if self.head_sent:
                raise RuntimeError("http.response.start sent twice")
            self.status = int(message["status"])
            self.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", ())]
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    def send_nowait(self, body: bytes) -> bool:
        """The ``SEND_NOWAIT`` extension: `send` of a body with ``more_body``, without
        waiting (what the socket does not take now is the connection's backlog)."""
        if self.chunked and not self.complete:  # the hot path, as in send
            return not body or self.conn.send_nowait(b"%x\r\n%b\r\n" % (len(body), body))
        data = self._body(body, True)
        return not data or self.conn.send_nowait(data)

    def _body(self, body: bytes, more: bool) -> bytes:
        """The bytes an ``http.response.body`` message writes (with the head, if it is
        the first), and the state it leaves; ``b""`` for none."""
        conn = self.conn
        h = conn.h11
        if self.complete:
            return b""
        if self.chunked:  # so the end: the chunks with more_body are send's
            self.complete = True
            end = h.send(_END) or b""
            return (b"%x\r\n%b\r\n" % (len(body), body) + end) if body else end
        if not self.head_sent:
            self.head_sent = True
            headers = self.headers
            if more and not self.head_only:
                if h.their_http_version == b"1.1":
                    headers.append((b"transfer-encoding", b"chunked"))
                    self.chunked = True
            elif not more:
                headers.append((b"content-length", str(len(body)).encode()))
            if self.last or conn.server.closing:
                headers.append((b"connection", b"close"))
            headers.append((b"date", _DATE.get()))
            headers.append(_SERVER)
            try:
                head = h.send(
                    h11.Response(
                        status_code=self.status,
                        headers=headers,
                        reason=_REASONS.get(self.status, b""),
                    )
                )
            except h11.LocalProtocolError:
                conn.broken = True
                self.complete = True
                return b""
            assert head is not None
            if self.chunked:
                return (head + b"%x\r\n%b\r\n" % (len(body), body)) if body else head
            data = head
        else:
            data = b""
        if body and not self.head_only:
            data += h.send(h11.Data(data=body)) or b""
        if not more:
            self.complete = True
            data += h.send(_END) or b""
        return data


async def serve_h11(
    app: Callable[..., Awaitable[None]],
    sock: _stdlib_socket.socket,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    graceful_timeout: float = 30.0,
    keep_alive_timeout: float = 5.0,
    keep_alive_max_requests: int = 1000,
    access_log: bool = False,
    task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI ``app`` on the listening socket ``sock`` (adopted: closed when
    this returns) until ``shutdown_trigger`` returns, then drain (module docstring).

    Runs on trio only. Cancellation: closes the listener and every connection now.
    """
    server = _Server(app, keep_alive_timeout, keep_alive_max_requests, access_log)
    sock.setblocking(False)
    try:
        async with trio.open_nursery() as nursery:
            if hasattr(select, "epoll"):
                server.disconnects = _DisconnectWatch()
                nursery.start_soon(server.disconnects.run)
            accepting = trio.CancelScope()
            nursery.start_soon(_accept_loop, sock, server, nursery, accepting)
            task_status.started()
            if shutdown_trigger is None:
                await trio.sleep_forever()
            else:
                await shutdown_trigger()
            accepting.cancel()
            sock.close()
            server.begin_shutdown()
            with trio.move_on_after(graceful_timeout):
                while server.open:
                    await server.all_closed.wait()
            nursery.cancel_scope.cancel()
    finally:
        sock.close()
        if server.disconnects is not None:
            server.disconnects.close()


async def _accept_loop(
    listener: _stdlib_socket.socket,
    server: _Server,
    nursery: trio.Nursery,
    accepting: trio.CancelScope,
) -> None:
    """Accept every connection waiting, then wait for more. All of a burst at once:
    one accept per scheduler pass (trio's ``accept``, hypercorn's loop) admits a burst
    of N clients over N passes, each as long as every running stream's work, so the
    last of them waited for all (issue 25: TTFT p99 at concurrency 256)."""
    with accepting:
        while True:
            try:
                client, _ = listener.accept()
            except BlockingIOError:
                await wait_readable(listener)
                continue
            except OSError as exc:
                if exc.errno in _ACCEPT_CAPACITY_ERRNOS:  # out of descriptors: back off
                    logger.error("accept: %s; retrying in 100 ms", exc)
                    await trio.sleep(0.1)
                    continue
                raise
            client.setblocking(False)
            with contextlib.suppress(OSError):  # not TCP (a Unix socket), or reset
                client.setsockopt(_stdlib_socket.IPPROTO_TCP, _stdlib_socket.TCP_NODELAY, 1)
            server.open += 1
            nursery.start_soon(_run_connection, server, client)


async def _run_connection(server: _Server, sock: _stdlib_socket.socket) -> None:
    try:
        await _Connection(server, sock).serve()
    finally:
        server.open -= 1
        if not server.open:
            server.all_closed.set()
            server.all_closed = trio.Event()


_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
