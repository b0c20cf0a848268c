"""Serving the app: our h11 server on trio (or hypercorn), uvicorn on asyncio (or hypercorn).

`serve_app` binds the listening socket itself (so port 0 works and the bound port
is reported through ``task_status`` on both backends) and hands it to the HTTP server:
on trio `serve_h11` (``_h11.py``, the default: the streaming hot path without
hypercorn's per-send stack) or hypercorn's trio worker (``http_server="hypercorn"``),
on asyncio `serve_uvicorn` (``_uvicorn.py``: uvicorn with httptools, when installed) or
hypercorn's asyncio worker. `run_openai_server`
is the command's body: engines + text frontend + app + signals + death policy.
"""

from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING, Any, Literal

import anyio

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from anyio.abc import TaskStatus


__all__ = ["DEFAULT_SHUTDOWN_GRACE", "HTTPServerName", "serve_app"]

HTTPServerName = Literal["auto", "h11", "hypercorn", "uvicorn"]
HTTP_SERVERS: tuple[HTTPServerName, ...] = ("auto", "h11", "hypercorn", "uvicorn")
# What http_server="uvicorn" imports (the [asyncio] extra; uvloop is the CLI's).
UVICORN_MODULES = ("uvicorn", "httptools")

logger = logging.getLogger("trio_vllm.server")

DEFAULT_SHUTDOWN_GRACE = 30.0


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def uvicorn_installed() -> bool:
    """Whether ``http_server="uvicorn"`` can run (uvicorn and httptools importable)."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in UVICORN_MODULES)


def _on_trio() -> bool:
    import trio

    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


async def serve_app(
    app: Callable[..., Awaitable[None]],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    graceful_timeout: float = DEFAULT_SHUTDOWN_GRACE,
    backlog: int = 2048,
    access_log: bool = False,
    sock: socket.socket | None = None,
    http_server: HTTPServerName = "auto",
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve an ASGI app until ``shutdown_trigger`` returns.

    ``http_server``: ``"h11"`` (trio only) is `serve_h11`, this package's HTTP/1.1
    server; ``"uvicorn"`` (asyncio only) is uvicorn with httptools' parser
    (``pip install 'trio-vllm[asyncio]'``); ``"hypercorn"`` is hypercorn's trio worker
    under trio and its asyncio worker under asyncio; ``"auto"`` (the default) is h11 on
    trio, and uvicorn on asyncio when uvicorn and httptools are installed (hypercorn
    otherwise). ``task_status.started(port)`` reports the bound port (useful with
    ``port=0``) once the socket listens. When ``shutdown_trigger`` returns, the server
    stops accepting, lets running requests finish for ``graceful_timeout`` seconds, then
    cancels them (a cancelled generation request aborts on its engine), and returns with
    no connection left open (on hypercorn, whose shutdown a client that stopped reading
    holds forever, the connections still open ``graceful_timeout`` + 0.5 s after the
    trigger are shut down). Cancelling this call closes everything at once (on hypercorn:
    a shutdown with no grace, its cancelled requests awaited). ``sock``: a listening
    socket to serve instead of binding ``host:port`` (one that several server processes
    share, ``--api-server-count``); it is adopted (closed when serving ends).
    """
    if http_server not in HTTP_SERVERS:
        raise ValueError(f"http_server must be one of {HTTP_SERVERS}, got {http_server!r}")
    on_trio = _on_trio()
    if http_server == "h11" and not on_trio:
        raise ValueError(
            'http_server="h11" runs on trio only (use "uvicorn" or "hypercorn" on asyncio)'
        )
    if http_server == "uvicorn" and on_trio:
        raise ValueError('http_server="uvicorn" runs on asyncio only (use "h11" or "hypercorn")')
    if http_server == "auto" and not on_trio:
        http_server = "uvicorn" if uvicorn_installed() else "hypercorn"
    elif http_server == "uvicorn" and not uvicorn_installed():
        raise ValueError(
            'http_server="uvicorn" needs uvicorn and httptools: pip install "trio-vllm[asyncio]"'
        )
    if sock is None:
        sock = _listen(host, port, backlog)
    sock_name = sock.getsockname()
    bound_port = sock_name[1]
    if on_trio and http_server != "hypercorn":
        from ._h11 import serve_h11

        task_status.started(bound_port)
        await serve_h11(
            app,
            sock,
            shutdown_trigger=shutdown_trigger,
            graceful_timeout=graceful_timeout,
            access_log=access_log,
        )
        return
    if http_server == "uvicorn":
        from ._uvicorn import serve_uvicorn

        task_status.started(bound_port)
        await serve_uvicorn(
            app,
            sock,
            shutdown_trigger=shutdown_trigger,
            graceful_timeout=graceful_timeout,
            access_log=access_log,
            backlog=backlog,
        )
        return
    from hypercorn.config import Config

    config = Config()
    # hypercorn adopts the descriptor (socket.socket(fileno=...)): detach ours.
    config.bind = [f"fd://{sock.detach()}"]
    config.graceful_timeout = graceful_timeout
    config.backlog = backlog
    config.accesslog = logging.getLogger("hypercorn.access") if access_log else None
    config.errorlog = logging.getLogger("hypercorn.error")
    task_status.started(bound_port)
    await _serve_hypercorn(
        app,
        config,
        sock_name,
        on_trio=on_trio,
        shutdown_trigger=shutdown_trigger,
        graceful_timeout=graceful_timeout,
    )


# Seconds past graceful_timeout (from the trigger) before the connections hypercorn
# still holds are shut down under it.
_HYPERCORN_MARGIN = 0.5


async def _serve_hypercorn(
    app: Callable[..., Awaitable[None]],
    config: Any,
    sock_name: Any,
    *,
    on_trio: bool,
    shutdown_trigger: Callable[[], Awaitable[None]] | None,
    graceful_timeout: float,
) -> None:
    """hypercorn's worker, bounded: a connection whose client stopped reading holds up
    both of hypercorn's workers past their graceful timeout (the trio worker's send is
    shielded, so even a cancellation waits on it; the asyncio worker waits, after
    cancelling, for its writer to flush, forever). ``graceful_timeout`` + a margin after
    the trigger (at once when this call is cancelled) the connections of this listener
    still open are shut down (``shutdown(2)``, the descriptor left to hypercorn): their
    sends fail, hypercorn's requests end (cancelled ones are awaited by hypercorn) and it
    closes them."""
    triggered = anyio.Event()
    stop = anyio.Event()  # this call was cancelled

    async def trigger() -> None:
        async with anyio.create_task_group() as either:

            async def asked() -> None:
                if shutdown_trigger is None:
                    await anyio.sleep_forever()
                else:
                    await shutdown_trigger()
                either.cancel_scope.cancel()

            either.start_soon(asked)
            await stop.wait()
            either.cancel_scope.cancel()
        triggered.set()

    async def bound() -> None:
        await triggered.wait()
        await anyio.sleep(config.graceful_timeout + _HYPERCORN_MARGIN)
        while True:
            _shut_connections(sock_name)
            await anyio.sleep(0.5)

    async def on_cancel() -> None:
        try:
            await anyio.sleep_forever()
        finally:  # this call cancelled (or serving over): a shutdown with no grace
            config.graceful_timeout = 0
            stop.set()

    if on_trio:
        from hypercorn.trio import serve as trio_serve

        serve: Callable[..., Awaitable[None]] = trio_serve
    else:
        from hypercorn.asyncio import serve as asyncio_serve

        serve = asyncio_serve
    async with anyio.create_task_group() as outer:
        outer.start_soon(on_cancel)
        # Shielded: this call's cancellation is turned into a shutdown with no grace
        # (on asyncio, the worker's cleanup cancelled would leave its requests running,
        # unowned; on trio its send is shielded anyway).
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                tg.start_soon(bound)
                await serve(app, config, shutdown_trigger=trigger)
                tg.cancel_scope.cancel()
        outer.cancel_scope.cancel()


def _accepted_by(name: Any, sock_name: Any) -> bool:
    """Whether local address ``name`` is one a listener bound to ``sock_name`` accepts on
    (its port; its address, or any when it listens on every address)."""
    if not isinstance(name, tuple) or name[1] != sock_name[1]:
        return False
    return bool(name[0] == sock_name[0] or sock_name[0] in ("0.0.0.0", "::"))


def _shut_connections(sock_name: Any) -> None:
    """``shutdown(SHUT_RDWR)`` every connected socket of this process on the listener's
    local address ``sock_name`` (the connections it accepted). The
    descriptors stay their owner's (no close under an event loop). Linux (/proc)."""
    import os
    import stat

    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in fds:
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            conn = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            name = conn.getsockname()
            if conn.type == socket.SOCK_STREAM and _accepted_by(name, sock_name):
                conn.getpeername()  # the listener has none (OSError)
                conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            conn.detach()
