"""``trio-vllm serve --backend asyncio``: the server on uvloop, served by uvicorn.

The server tests that go through `serving` on asyncio (test_api, test_lifetimes,
test_errors, ...) run uvicorn too (``serve_app``'s "auto" on asyncio, checked here);
test_process and test_api_servers run their signal, grace and death tests on both
backends. Here: the command on asyncio with the official ``openai`` client, SIGINT,
error bodies byte for byte the trio server's, usage errors, and `serve_uvicorn`'s own
drain and cancellation with small ASGI apps on real sockets.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import sys
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import openai
import pytest

from trio_vllm.server import _uvicorn as uvicorn_module
from trio_vllm.server import serve_app

from ._util import ServeProcess, raw_request, serve_process

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

_ASYNCIO = ("--backend", "asyncio")


@asynccontextmanager
async def cli_server(*args: str) -> AsyncIterator[ServeProcess]:
    command = [sys.executable, "-m", "trio_vllm.cli", "serve", "--port", "0", *args]
    async with serve_process(command, ServeProcess) as server:
        yield server


# ------------------------------------------------------------------- the command


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # openai's streams are quiet there
async def test_openai_client_on_uvicorn(anyio_backend: str) -> None:
    async with cli_server(*_ASYNCIO, "--access-log") as server:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=30)
        async with client:
            done = await client.completions.create(
                model="trio-vllm-reference", prompt="abc", max_tokens=5
            )
            assert done.choices[0].text == "abcab"
            assert done.usage is not None
            assert done.usage.completion_tokens == 5
            stream = await client.completions.create(
                model="trio-vllm-reference", prompt="xyz", max_tokens=7, stream=True
            )
            parts = [chunk.choices[0].text async for chunk in stream]
            assert "".join(parts) == "xyzxyzx"
            assert len(parts) == 7  # one event per token
            messages: Any = [{"role": "user", "content": "hi"}]
            chat = await client.chat.completions.create(
                model="trio-vllm-reference", messages=messages, max_tokens=4
            )
            assert chat.choices[0].message.role == "assistant"
            assert chat.usage is not None
            assert chat.usage.completion_tokens == 4
            text = chat.choices[0].message.content
            chat_stream = await client.chat.completions.create(
                model="trio-vllm-reference", messages=messages, max_tokens=4, stream=True
            )
            deltas = [c.choices[0].delta.content or "" async for c in chat_stream if c.choices]
            assert "".join(deltas) == text
        server.process.send_signal(signal.SIGTERM)
        with anyio.fail_after(30):
            assert await server.process.wait() == 0
    # uvicorn served it (its access log), and said nothing else
    assert b"uvicorn.access INFO: 127.0.0.1:" in server.stderr
    assert b'"POST /v1/chat/completions HTTP/1.1" 200' in server.stderr
    assert b"uvicorn.error" not in server.stderr, server.stderr.decode(errors="replace")


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.parametrize("backend", [(), _ASYNCIO], ids=["trio-h11", "asyncio-uvicorn"])
async def test_sigint_lets_a_running_stream_finish_then_exits_0(
    anyio_backend: str, backend: tuple[str, ...]
) -> None:
    async with cli_server(*backend, "--engine-args=--step-interval-ms 5") as server:
        body = json.dumps(
            {"prompt": "abc", "max_tokens": 200, "ignore_eos": True, "stream": True}
        ).encode()
        head = (
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        data = b""
        async with await anyio.connect_tcp("127.0.0.1", server.port) as stream:
            await stream.send(head + body)
            while b"data: " not in data:
                data += await stream.receive()
            server.process.send_signal(signal.SIGINT)
            with anyio.fail_after(30):
                try:
                    while True:
                        data += await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    pass
        assert b"data: [DONE]\n\n" in data, data[-300:]
        assert data.endswith(b"\r\n0\r\n\r\n"), data[-300:]  # the chunked body's end
        assert data.count(b'"finish_reason":"length"') == 1
        assert b'"error"' not in data
        with anyio.fail_after(30):
            assert await server.process.wait() == 0
    assert b"SIGINT: no new connections" in server.stderr


_BAD = [
    ("POST", "/v1/completions", b"{not json"),
    ("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": "many"}'),
    ("POST", "/v1/completions", b'{"prompt": "x", "model": "nope"}'),
    ("POST", "/v1/chat/completions", b'{"messages": "hi"}'),
    ("GET", "/v1/nothing-here", b""),
    ("GET", "/v1/completions", b""),
]


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_errors_are_the_trio_servers_byte_for_byte(anyio_backend: str) -> None:
    async with cli_server() as trio_server, cli_server(*_ASYNCIO) as asyncio_server:
        for method, path, body in _BAD:
            answers = []
            for server in (trio_server, asyncio_server):
                status, headers, data = await raw_request(
                    server.port, method, path, body, {"content-type": "application/json"}
                )
                answers.append((status, headers.get("content-type"), data))
            assert answers[0] == answers[1], (method, path)
            assert answers[0][0] in (400, 404, 405), answers[0]


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_usage_errors_exit_2(anyio_backend: str) -> None:
    cases: list[tuple[list[str], bytes]] = [
        (["--backend", "asyncio", "--http-server", "h11"], b"runs on --backend trio only"),
        (["--http-server", "uvicorn"], b"runs on --backend asyncio only"),
    ]
    for args, message in cases:
        done = await anyio.run_process(
            [sys.executable, "-m", "trio_vllm.cli", "serve", *args], check=False
        )
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.startswith(b"trio-vllm serve: error: "), done.stderr
        assert message in done.stderr, done.stderr
    # Without the extra: what to install (uvicorn hidden from the import system).
    hide = (
        "import sys; sys.modules['uvicorn'] = None; from trio_vllm.cli import main; "
        "sys.exit(main(['serve', '--backend', 'asyncio']))"
    )
    done = await anyio.run_process([sys.executable, "-c", hide], check=False)
    assert done.returncode == 2, done.stderr
    assert b"--backend asyncio needs uvicorn: pip install 'trio-vllm[asyncio]'" in (done.stderr)
    # ... while hypercorn on asyncio needs no uvicorn
    hide = hide.replace("'asyncio']", "'asyncio', '--http-server', 'hypercorn', '--port', '-1']")
    done = await anyio.run_process([sys.executable, "-c", hide], check=False)
    assert done.returncode == 2, done.stderr
    assert b"--port must be in" in done.stderr


# ------------------------------------------------------------ serve_app on uvicorn


class _App:
    """``/stream`` sends a chunk, then waits for ``release`` (or forever); records how
    each request ended (a cancelled one after ``unwind`` seconds of cleanup, as a
    generation's abort on its engine)."""

    def __init__(self, unwind: float = 0.0) -> None:
        self.streaming = anyio.Event()
        self.release = anyio.Event()
        self.ended: list[str] = []
        self.unwind = unwind

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x", "more_body": True})
        self.streaming.set()
        try:
            await self.release.wait()
        except BaseException:
            if self.unwind:
                with anyio.CancelScope(shield=True):
                    await anyio.sleep(self.unwind)
            self.ended.append("cancelled")
            raise
        self.ended.append("finished")
        await send({"type": "http.response.body", "body": b"y"})


async def _refused(port: int) -> None:
    """Wait until connecting to ``port`` fails (the listener closed)."""
    with anyio.fail_after(5):
        while True:
            try:
                stream = await anyio.connect_tcp("127.0.0.1", port)
            except OSError:
                return
            await stream.aclose()
            await anyio.sleep(0.02)


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


async def _open_stream(port: int) -> anyio.abc.SocketStream:
    stream = await anyio.connect_tcp("127.0.0.1", port)
    await stream.send(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
    return stream


async def _read_to_end(stream: anyio.abc.SocketStream) -> bytes:
    """What the server sends until it closes the connection (then closed here too)."""
    data = b""
    async with stream:
        try:
            while True:
                data += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return data


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_auto_is_uvicorn_on_asyncio(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[float] = []
    real = uvicorn_module.serve_uvicorn

    async def recording(*args: Any, **kwargs: Any) -> None:
        calls.append(kwargs["graceful_timeout"])
        await real(*args, **kwargs)

    monkeypatch.setattr(uvicorn_module, "serve_uvicorn", recording)
    app = _App()
    app.release.set()
    stop = anyio.Event()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            port = await tg.start(
                partial(serve_app, app, port=0, shutdown_trigger=stop.wait, graceful_timeout=3)
            )
            status, headers, body = await raw_request(port, "GET", "/stream")
            stop.set()
    assert calls == [3]
    assert (status, headers["server"], body) == (200, "trio-vllm", b"xy")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_shutdown_lets_a_request_finish_within_the_grace(anyio_backend: str) -> None:
    app = _App()
    stop = anyio.Event()
    sock = _listener()
    port = sock.getsockname()[1]
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                partial(serve_app, app, sock=sock, shutdown_trigger=stop.wait,
                        graceful_timeout=30, http_server="uvicorn")
            )  # fmt: skip
            stream = await _open_stream(port)
            await app.streaming.wait()
            stop.set()
            await _refused(port)  # no new connections once draining
            app.release.set()
            data = await _read_to_end(stream)
    assert data.endswith(b"1\r\nx\r\n1\r\ny\r\n0\r\n\r\n"), data
    assert app.ended == ["finished"]
    assert sock.fileno() == -1  # adopted and closed


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_graceful_timeout_cancels_and_awaits_what_is_left(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "uvicorn.error")
    app = _App(unwind=0.5)  # a cleanup that takes a while: the call waits for it
    stop = anyio.Event()
    sock = _listener()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                partial(serve_app, app, sock=sock, shutdown_trigger=stop.wait,
                        graceful_timeout=0.3, http_server="uvicorn")
            )  # fmt: skip
            stream = await _open_stream(sock.getsockname()[1])
            await app.streaming.wait()
            stop.set()
        # serve_app returned: the request was cancelled and has finished unwinding
        assert app.ended == ["cancelled"]
        data = await _read_to_end(stream)
    assert data.endswith(b"1\r\nx\r\n"), data  # cut, not completed
    # uvicorn's one line for the cut, not a CancelledError traceback per request
    assert "Cancel 1 running task(s), timeout graceful shutdown exceeded" in caplog.text
    assert "Exception in ASGI application" not in caplog.text


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_cancelling_the_call_closes_everything_at_once(anyio_backend: str) -> None:
    app = _App(unwind=0.5)  # a cleanup that takes a while: the call waits for it
    sock = _listener()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                partial(serve_app, app, sock=sock, graceful_timeout=30, http_server="uvicorn")
            )
            stream = await _open_stream(sock.getsockname()[1])
            await app.streaming.wait()
            tg.cancel_scope.cancel()
        assert app.ended == ["cancelled"]
        assert sock.fileno() == -1
        await _read_to_end(stream)  # the connection is gone, not left open


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_uvicorn_leaves_the_signal_handlers_alone(anyio_backend: str) -> None:
    # uvicorn.Server.serve would install its own SIGINT/SIGTERM handlers (and re-raise
    # the signal when it returns); the caller's stay (run_openai_server's, a program's).
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    app = _App()
    app.release.set()
    stop = anyio.Event()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            port = await tg.start(
                partial(serve_app, app, port=0, shutdown_trigger=stop.wait,
                        http_server="uvicorn")
            )  # fmt: skip
            assert (await raw_request(port, "GET", "/stream"))[0] == 200  # serving
            during = {sig: signal.getsignal(sig) for sig in before}
            stop.set()
    assert during == before


def _server_side_sockets(port: int) -> int:
    """How many sockets of this process have local port ``port`` (the listener, the
    server's end of each connection; not the clients' ends). /proc/net/tcp: a socket
    no descriptor holds any more (closed, the kernel still sending) has inode 0."""
    count = 0
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] != "0":
                count += 1
    return count


class _Firehose:
    """Sends 64 KiB chunks as fast as the client takes them (forever); a cancelled
    request cleans up for ``unwind`` seconds (shielded) and records it."""

    def __init__(self, unwind: float = 0.5) -> None:
        self.sent = 0
        self.unwind = unwind
        self.ended: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            while True:
                await send({"type": "http.response.body", "body": b"z" * 65536, "more_body": True})
                self.sent += 1
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(self.unwind)
            self.ended.append("cancelled")
            raise

    async def blocked(self) -> None:
        """Until a send waits (the socket buffers are full)."""
        while True:
            before = self.sent
            await anyio.sleep(0.2)
            if before and self.sent == before:
                return


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_client_that_stopped_reading_is_not_left_connected(anyio_backend: str) -> None:
    # The graceful timeout cuts the stream; uvicorn closes the transport, which then
    # waits to flush its buffer to a client that never reads: it must not outlive the call.
    app = _Firehose(unwind=0)
    stop = anyio.Event()
    sock = _listener()
    port = sock.getsockname()[1]
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                partial(serve_app, app, sock=sock, shutdown_trigger=stop.wait,
                        graceful_timeout=0.3, http_server="uvicorn")
            )  # fmt: skip
            stream = await _open_stream(port)  # and never read
            await app.blocked()
            assert _server_side_sockets(port) == 2  # the listener, the connection
            stop.set()
        assert _server_side_sockets(port) == 0
        await _read_to_end(stream)  # and the client sees the end


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_cancellation_during_startup_leaves_nothing_registered(anyio_backend: str) -> None:
    # Cancelled after 0..3 scheduler passes: inside uvicorn's startup for the first ones
    # (asyncio's create_server starts serving, then awaits). A listener lost there stayed
    # registered with the loop after its socket closed, and the next socket given that
    # descriptor number (the next server's listener here) was never polled: a hang.
    for passes in range(4):
        sock = _listener()
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(serve_app, _App(), sock=sock, http_server="uvicorn"))
                for _ in range(passes):
                    await anyio.lowlevel.checkpoint()
                tg.cancel_scope.cancel()
        assert sock.fileno() == -1
        app = _App()
        app.release.set()
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                port = await tg.start(partial(serve_app, app, port=0, http_server="uvicorn"))
                status, _, body = await raw_request(port, "GET", "/stream")
                assert (status, body) == (200, b"xy")
                tg.cancel_scope.cancel()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_shutdown_asked_before_startup_ends_at_once(anyio_backend: str) -> None:
    stop = anyio.Event()
    stop.set()
    sock = _listener()
    with anyio.fail_after(5):
        await serve_app(_App(), sock=sock, shutdown_trigger=stop.wait, http_server="uvicorn")
    assert sock.fileno() == -1


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_access_log_is_each_calls_own(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    # uvicorn's Config(access_log=False) clears the uvicorn.access logger for the whole
    # process: a later access_log=True call logged nothing.
    caplog.set_level(logging.INFO, "uvicorn.access")
    for number, access_log in enumerate((True, False, True)):
        app = _App()
        app.release.set()
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                port = await tg.start(
                    partial(serve_app, app, port=0, access_log=access_log,
                            http_server="uvicorn")
                )  # fmt: skip
                await raw_request(port, "GET", f"/stream?call={number}")
                tg.cancel_scope.cancel()
    logged = [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]
    assert len(logged) == 2, logged
    assert "call=0" in logged[0]
    assert "call=2" in logged[1]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_call_that_ends_keeps_the_log_filter_of_one_still_serving(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Two calls share the uvicorn.error logger: the first to end must not take the
    # filter (no CancelledError traceback per cancelled request) from the other.
    caplog.set_level(logging.INFO, "uvicorn.error")
    app = _App()
    stop = anyio.Event()
    sock = _listener()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                partial(serve_app, app, sock=sock, shutdown_trigger=stop.wait,
                        graceful_timeout=0.3, http_server="uvicorn")
            )  # fmt: skip
            async with anyio.create_task_group() as other:
                await other.start(partial(serve_app, _App(), port=0, http_server="uvicorn"))
                other.cancel_scope.cancel()  # ends first
            stream = await _open_stream(sock.getsockname()[1])
            await app.streaming.wait()
            stop.set()
        await _read_to_end(stream)
    assert app.ended == ["cancelled"]
    assert "Cancel 1 running task(s)" in caplog.text
    assert "Exception in ASGI application" not in caplog.text
