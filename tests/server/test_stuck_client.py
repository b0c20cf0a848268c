"""Every HTTP server ends `serve_app` on time with a client that stopped reading.

A client sends a streaming request and never reads: the server's send blocks on full
socket buffers. `serve_app`'s contract holds on every server all the same: when
``shutdown_trigger`` returns, the request gets ``graceful_timeout`` seconds, is then
cancelled and awaited (its cleanup, as a generation's abort on its engine, finishes
before the call returns), the call returns, and no socket of the connection is left open.
"""

from __future__ import annotations

from functools import partial

import anyio
import pytest

from trio_vllm.server import serve_app

from .test_uvicorn import (
    _Firehose,
    _listener,
    _open_stream,
    _read_to_end,
    _server_side_sockets,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

SERVERS = [
    ("trio", "h11"),
    ("trio", "hypercorn"),
    ("asyncio", "hypercorn"),
    ("asyncio", "uvicorn"),
]


@pytest.mark.parametrize(("anyio_backend", "http_server"), SERVERS)
async def test_a_client_that_stopped_reading_does_not_hold_up_the_shutdown(
    anyio_backend: str, http_server: str
) -> None:
    app = _Firehose()
    stop = anyio.Event()
    sock = _listener()
    port = sock.getsockname()[1]
    grace = 0.3
    with anyio.fail_after(30):  # the test's own bound; the call's is far shorter
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                partial(serve_app, app, sock=sock, shutdown_trigger=stop.wait,
                        graceful_timeout=grace, http_server=http_server)
            )  # fmt: skip
            stream = await _open_stream(port)  # and never read
            await app.blocked()
            assert _server_side_sockets(port) == 2  # the listener, the connection
            stop.set()
            asked = anyio.current_time()
        took = anyio.current_time() - asked
        assert took < grace + app.unwind + 3, took
        assert app.ended == ["cancelled"]  # cancelled, and awaited to its end
        assert _server_side_sockets(port) == 0
        await _read_to_end(stream)  # and the client sees the end


@pytest.mark.parametrize(("anyio_backend", "http_server"), SERVERS)
async def test_cancelling_the_call_with_a_client_that_stopped_reading_ends_it_at_once(
    anyio_backend: str, http_server: str
) -> None:
    app = _Firehose()
    sock = _listener()
    port = sock.getsockname()[1]
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                partial(serve_app, app, sock=sock, graceful_timeout=30, http_server=http_server)
            )
            stream = await _open_stream(port)  # and never read
            await app.blocked()
            tg.cancel_scope.cancel()
            asked = anyio.current_time()
        took = anyio.current_time() - asked
        assert took < app.unwind + 3, took
        assert app.ended == ["cancelled"]
        assert _server_side_sockets(port) == 0
        await _read_to_end(stream)
