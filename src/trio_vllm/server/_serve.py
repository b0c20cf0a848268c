"""Serving the app: hypercorn on trio (or asyncio), and the whole ``trio-vllm serve`` run.

`serve_app` binds the listening socket itself (so port 0 works and the bound port
is reported through ``task_status`` on both backends) and hands it to hypercorn's trio
worker, or to its asyncio worker when running under asyncio. `run_openai_server`
is the command's body: engines + text frontend + app + signals + death policy.
"""

from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from anyio.abc import TaskStatus


__all__ = ["DEFAULT_SHUTDOWN_GRACE", "serve_app"]

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
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve an ASGI app with hypercorn until ``shutdown_trigger`` returns.

    Runs hypercorn's trio worker under trio and its asyncio worker under asyncio.
    ``task_status.started(port)`` reports the bound port (useful with ``port=0``) once
    the socket listens. When ``shutdown_trigger`` returns, hypercorn stops accepting,
    lets running requests finish for ``graceful_timeout`` seconds, then cancels them
    (a cancelled generation request aborts on its engine). Cancelling this call closes
    everything at once. ``sock``: a listening socket to serve instead of binding
    ``host:port`` (one that several server processes share, ``--api-server-count``);
    it is adopted (closed when serving ends).
    """
    from hypercorn.config import Config

    if sock is None:
        sock = _listen(host, port, backlog)
    bound_port = sock.getsockname()[1]
    config = Config()
    # hypercorn adopts the descriptor (socket.socket(fileno=...)): detach ours.
    config.bind = [f"fd://{sock.detach()}"]
    config.graceful_timeout = graceful_timeout
    config.backlog = backlog
    config.accesslog = logging.getLogger("hypercorn.access") if access_log else None
    config.errorlog = logging.getLogger("hypercorn.error")
    task_status.started(bound_port)
    if _on_trio():
        from hypercorn.trio import serve as trio_serve

        await trio_serve(app, config, shutdown_trigger=shutdown_trigger)
    else:
        from hypercorn.asyncio import serve as asyncio_serve

        await asyncio_serve(app, config, shutdown_trigger=shutdown_trigger)
