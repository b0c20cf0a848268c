"""The h11 HTTP/1.1 server (``server/_h11.py``) on its own, with small ASGI apps: no
engine, raw sockets, so every byte on the wire is checked.

The server tests that go through `serving` (test_api, test_lifetimes, test_batched_sends,
test_process, ...) run it too: it is the default on trio.
"""

from __future__ import annotations

import socket
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import trio
import trio.testing

from trio_vllm.server import serve_app
from trio_vllm.server._h11 import serve_h11
from trio_vllm.server._http import WATCH_DISCONNECT

from ._util import raw_request

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

pytestmark = pytest.mark.anyio


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


class _App:
    """Echoes the body; ``/stream`` sends three chunks; ``/wait`` streams until the
    client goes away (records the disconnect); ``/boom`` raises; ``/ignore`` answers
    without reading the body."""

    def __init__(self) -> None:
        self.disconnected = trio.Event()
        self.streaming = trio.Event()
        self.release = trio.Event()
        self.sends_after_gone = 0
        self.watch_fired = 0  # WATCH_DISCONNECT callbacks (``/watch``)
        self.watch_gone = trio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        path = scope["path"]
        if path == "/boom":
            raise RuntimeError("boom")
        if path == "/twice":  # sends after the response's end: ignored
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"a", "more_body": True})
            await send({"type": "http.response.body", "body": b"b"})
            await send({"type": "http.response.body", "body": b"c", "more_body": True})
            await send({"type": "http.response.body", "body": b"d"})
            return
        if path == "/ignore":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"nope"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if path == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for part in (b"a", b"", b"bc"):
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b"d"})
            return
        if path == "/wait":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
            self.streaming.set()
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    assert (await receive())["type"] == "http.disconnect"
                    self.disconnected.set()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch)
                await self.release.wait()
                await send({"type": "http.response.body", "body": b"y", "more_body": True})
                self.sends_after_gone += 1
                await trio.sleep_forever()
            return
        if path == "/watch":  # streams until released or the watch says the client left
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
            with trio.CancelScope() as cancel_scope:

                def gone() -> None:
                    self.watch_fired += 1
                    self.watch_gone.set()
                    cancel_scope.cancel()

                stop = scope["extensions"][WATCH_DISCONNECT](gone)
                self.streaming.set()
                try:
                    await self.release.wait()
                finally:
                    stop()
            await send({"type": "http.response.body", "body": b"y"})
            return
        if path == "/slow":
            await self.release.wait()
        headers = [(b"x-path", path.encode()), (b"x-query", scope["query_string"])]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@asynccontextmanager
async def serving(
    app: Any, **options: Any
) -> AsyncIterator[tuple[int, Callable[[], None], trio.Nursery]]:
    sock = _listener()
    port = sock.getsockname()[1]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_h11, app, sock, shutdown_trigger=stop.wait, **options))
        try:
            yield port, stop.set, nursery
        finally:
            stop.set()
            while _OPEN:
                await _OPEN.pop().aclose()


async def _read_until_closed(stream: trio.SocketStream) -> bytes:
    data = b""
    with trio.fail_after(10):
        while chunk := await stream.receive_some(65536):
            data += chunk
    return data


_OPEN: list[trio.SocketStream] = []  # closed by `serving` on its way out


async def _open(port: int) -> trio.SocketStream:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    _OPEN.append(stream)
    return stream


@pytest.fixture
def anyio_backend() -> str:
    return "trio"  # the h11 server runs on trio only


async def test_keep_alive_and_pipelining() -> None:
    async with serving(_App()) as (port, _, _):
        stream = await _open(port)
        one = b"POST /a?q=1 HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc"
        two = b"GET /b HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        await stream.send_all(one + two)  # pipelined: answered in order
        data = await _read_until_closed(stream)
    first, _, rest = data.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200 OK")
    assert b"x-path: /a" in first
    assert b"x-query: q=1" in first
    assert b"content-length: 3" in first
    assert rest.startswith(b"abcHTTP/1.1 200 OK")
    assert b"x-path: /b" in rest
    assert b"connection: close" in rest.lower()


async def test_streamed_body_is_chunked_and_empty_chunks_are_skipped() -> None:
    async with serving(_App()) as (port, _, _):
        status, headers, body = await raw_request(port, "POST", "/stream", b"")
    assert status == 200
    assert headers["transfer-encoding"] == "chunked"
    assert body == b"abcd"


async def test_streamed_body_raw_framing() -> None:
    async with serving(_App()) as (port, _, _):
        stream = await _open(port)
        await stream.send_all(b"GET /stream HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        data = await _read_until_closed(stream)
    assert data.partition(b"\r\n\r\n")[2] == b"1\r\na\r\n2\r\nbc\r\n1\r\nd\r\n0\r\n\r\n"


async def test_http_1_0_stream_is_delimited_by_close() -> None:
    async with serving(_App()) as (port, _, _):
        stream = await _open(port)
        await stream.send_all(b"GET /stream HTTP/1.0\r\n\r\n")
        data = await _read_until_closed(stream)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK")
    assert b"transfer-encoding" not in head.lower()
    assert body == b"abcd"


async def test_idle_and_slowloris_connections_are_closed() -> None:
    async with serving(_App(), keep_alive_timeout=0.2) as (port, _, _):
        idle = await _open(port)
        assert await _read_until_closed(idle) == b""
        slow = await _open(port)
        # A head that never completes: trickled byte by byte, closed all the same.
        with trio.fail_after(10):
            with pytest.raises(trio.BrokenResourceError):  # noqa: PT012
                for byte in b"GET / HTTP/1.1\r\nhost: x\r\nx-a: " + b"a" * 10_000:
                    await slow.send_all(bytes([byte]))
                    await trio.sleep(0.01)
        # The server still serves.
        status, _, _ = await raw_request(port, "GET", "/ok")
        assert status == 200


async def test_malformed_and_oversized_heads() -> None:
    async with serving(_App()) as (port, _, _):
        bad = await _open(port)
        await bad.send_all(b"GET / HTTP/1.1\r\nno colon here\r\n\r\n")
        data = await _read_until_closed(bad)
        assert data.startswith(b"HTTP/1.1 400 Bad Request")
        big = await _open(port)
        await big.send_all(b"GET / HTTP/1.1\r\nhost: x\r\nx-a: " + b"a" * 200_000 + b"\r\n\r\n")
        data = await _read_until_closed(big)
        assert data.startswith(b"HTTP/1.1 431 Request Header Fields Too Large"), data[:300]


async def test_a_body_the_app_did_not_read_is_skipped() -> None:
    async with serving(_App()) as (port, _, _):
        stream = await _open(port)
        one = b"POST /ignore HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello"
        two = b"GET /after HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        await stream.send_all(one + two)
        data = await _read_until_closed(stream)
    assert data.startswith(b"HTTP/1.1 404 Not Found")
    assert b"x-path: /after" in data


async def test_expect_100_continue() -> None:
    async with serving(_App()) as (port, _, _):
        stream = await _open(port)
        await stream.send_all(
            b"POST /e HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nexpect: 100-continue\r\n"
            b"connection: close\r\n\r\n"
        )
        with trio.fail_after(10):
            first = await stream.receive_some(65536)
        assert first.startswith(b"HTTP/1.1 100 Continue")
        await stream.send_all(b"hi")
        data = first + await _read_until_closed(stream)
    assert data.endswith(b"\r\n\r\nhi")


async def test_disconnect_reaches_the_app_and_later_sends_do_nothing() -> None:
    app = _App()
    async with serving(app) as (port, _, _):
        stream = await _open(port)
        await stream.send_all(b"GET /wait HTTP/1.1\r\nhost: x\r\n\r\n")
        with trio.fail_after(10):
            await app.streaming.wait()
            await stream.aclose()
            await app.disconnected.wait()
        app.release.set()
        status, _, _ = await raw_request(port, "GET", "/ok")
        assert status == 200


async def test_watch_disconnect_calls_back_when_the_client_goes() -> None:
    """The WATCH_DISCONNECT extension: no task in receive(), the server's epoll watcher
    calls back once on the client's close, and the server keeps serving."""
    app = _App()
    async with serving(app) as (port, _, _):
        stream = await _open(port)
        await stream.send_all(b"GET /watch HTTP/1.1\r\nhost: x\r\n\r\n")
        with trio.fail_after(10):
            await app.streaming.wait()
            await stream.aclose()
            await app.watch_gone.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert app.watch_fired == 1
        status, _, _ = await raw_request(port, "GET", "/ok")
        assert status == 200


async def test_watch_disconnect_ignores_a_pipelined_request() -> None:
    """Bytes of a next request during the response are no disconnect: the response
    completes and the pipelined request is answered on the same connection."""
    app = _App()
    async with serving(app) as (port, _, _):
        stream = await _open(port)
        await stream.send_all(b"GET /watch HTTP/1.1\r\nhost: x\r\n\r\n")
        with trio.fail_after(10):
            await app.streaming.wait()
            await stream.send_all(b"GET /next HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            await trio.sleep(0.2)
            assert app.watch_fired == 0
            app.release.set()
            data = await _read_until_closed(stream)
    assert app.watch_fired == 0
    assert data.count(b"HTTP/1.1 200 OK") == 2
    assert b"x-path: /next" in data


async def test_watch_disconnect_stopped_does_not_call_back() -> None:
    app = _App()
    async with serving(app) as (port, _, _):
        stream = await _open(port)
        await stream.send_all(b"GET /watch HTTP/1.1\r\nhost: x\r\n\r\n")
        with trio.fail_after(10):
            await app.streaming.wait()
            app.release.set()  # stop() runs, then the last body goes out
            data = b""
            while not data.endswith(b"0\r\n\r\n"):
                data += await stream.receive_some(65536)
            await stream.aclose()
            await trio.sleep(0.2)
        assert app.watch_fired == 0
        status, _, _ = await raw_request(port, "GET", "/ok")
        assert status == 200


async def test_app_error_is_500_and_closes() -> None:
    async with serving(_App()) as (port, _, _):
        status, _, _ = await raw_request(port, "GET", "/boom")
    assert status == 500


async def test_shutdown_closes_idle_connections_and_drains_running_ones() -> None:
    app = _App()
    async with serving(app, graceful_timeout=30) as (port, stop, _):
        idle = await _open(port)
        busy = await _open(port)
        await busy.send_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        await trio.testing.wait_all_tasks_blocked()
        stop()
        assert await _read_until_closed(idle) == b""
        app.release.set()
        data = await _read_until_closed(busy)
        # Answered in full, with the connection's end announced.
        assert data.startswith(b"HTTP/1.1 200 OK")
        assert b"connection: close" in data.lower()
        with pytest.raises(OSError, match=r"refused|Connection|connect"):  # noqa: PT012
            with trio.fail_after(10):
                while True:  # the listener closes (a connect may still land in the
                    await (await _open(port)).aclose()  # backlog briefly)
                    await trio.sleep(0.01)


async def test_graceful_timeout_cancels_what_is_left() -> None:
    app = _App()
    with trio.fail_after(10):
        async with serving(app, graceful_timeout=0.2) as (port, stop, _):
            busy = await _open(port)
            await busy.send_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
            await trio.testing.wait_all_tasks_blocked()
            stop()
            assert await _read_until_closed(busy) == b""


async def test_serve_app_chooses_the_server(anyio_backend: str) -> None:
    sock = _listener()
    with pytest.raises(ValueError, match="http_server"):
        await serve_app(_App(), sock=sock, http_server="nginx")  # type: ignore[arg-type]
    sock.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_h11_is_trio_only(anyio_backend: str) -> None:
    sock = _listener()
    with pytest.raises(ValueError, match="trio only"):
        await serve_app(_App(), sock=sock, http_server="h11")
    sock.close()


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_uvicorn_is_asyncio_only(anyio_backend: str) -> None:
    sock = _listener()
    with pytest.raises(ValueError, match="asyncio only"):
        await serve_app(_App(), sock=sock, http_server="uvicorn")
    sock.close()


@pytest.mark.parametrize(
    ("anyio_backend", "http_server"),
    [("trio", "h11"), ("trio", "hypercorn"), ("asyncio", "hypercorn"), ("asyncio", "uvicorn")],
)
async def test_every_server_answers_the_same(anyio_backend: str, http_server: str) -> None:
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        port = await tg.start(
            partial(serve_app, _App(), port=0, shutdown_trigger=stop.wait,
                    http_server=http_server)
        )  # fmt: skip
        status, headers, body = await raw_request(port, "POST", "/stream", b"q")
        status2, headers2, body2 = await raw_request(port, "POST", "/echo?x=y", b"payload")
        stop.set()
    assert (status, headers["transfer-encoding"], body) == (200, "chunked", b"abcd")
    assert (status2, headers2["x-query"], body2) == (200, "x=y", b"payload")


async def test_head_gets_the_head_only_and_the_connection_goes_on() -> None:
    async with serving(_App()) as (port, _, _):
        stream = await _open(port)
        one = b"HEAD /ignore HTTP/1.1\r\nhost: x\r\n\r\n"
        two = b"GET /after HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        await stream.send_all(one + two)
        data = await _read_until_closed(stream)
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404 Not Found")
    assert b"content-length: 4" in head
    assert rest.startswith(b"HTTP/1.1 200 OK")  # no body bytes after the HEAD answer
    assert b"x-path: /after" in rest


async def test_sends_after_the_end_of_a_stream_are_ignored() -> None:
    async with serving(_App()) as (port, _, _):
        stream = await _open(port)
        one = b"GET /twice HTTP/1.1\r\nhost: x\r\n\r\n"
        two = b"GET /after HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        await stream.send_all(one + two)
        data = await _read_until_closed(stream)
    rest = data.partition(b"\r\n\r\n")[2]
    assert rest.startswith(b"1\r\na\r\n1\r\nb\r\n0\r\n\r\nHTTP/1.1 200 OK")
    assert b"x-path: /after" in rest
