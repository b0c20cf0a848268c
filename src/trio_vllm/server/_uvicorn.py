"""The app on uvicorn (httptools' parser), for asyncio: ``serve_app(http_server="uvicorn")``.

uvicorn is what ``vllm serve`` runs on; ``trio-vllm serve --backend asyncio`` serves with
it on uvloop. What differs from ``uvicorn.Server.serve``'s defaults, all so that it
behaves as this package's other HTTP servers do:

* signals: ``Server.serve`` replaces the SIGINT/SIGTERM handlers with its own
  (``capture_signals``) and re-raises the captured signal when it returns; the caller
  handles signals here (`run_openai_server`), so the subclass's ``capture_signals`` is a
  no-op and shutdown comes from ``shutdown_trigger`` (``should_exit``, which uvicorn's
  main loop reads every 0.1 s);
* the drain: uvicorn cancels the requests still running ``graceful_timeout`` seconds after
  shutdown began but does not wait for them; this does (a cancelled generation aborts on
  its engine before the call returns);
* cancellation of the call closes everything at once: the listener, every connection
  (aborted), every request (cancelled, then awaited);
* a request it cancels is not logged as an app error with a CancelledError traceback;
* startup (``create_server`` on the socket) is shielded: a cancellation that lands in it
  would leave a listener uvicorn never recorded, still registered with the event loop
  after the socket closed (on asyncio's own loop the next socket to get that descriptor
  number is then never polled: a hang);
* no connection outlives the call: one still open when it returns (a client that stopped
  reading keeps a closed transport's buffer unflushed forever) is aborted;
* ``access_log`` is this call's choice: uvicorn's ``Config(access_log=False)`` empties the
  ``uvicorn.access`` logger's handlers and stops its propagation for the whole process
  (and its protocol logs only when that logger has handlers), so a later call with
  ``access_log=True`` logged nothing; here the protocol takes the flag and the logger is
  left alone.

Logs go to ``uvicorn.error`` and, with ``access_log``, ``uvicorn.access`` (uvicorn's own
logging configuration is not applied: ``log_config=None``). uvicorn and httptools are
imported on the first call (``pip install 'trio-vllm[asyncio]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import TYPE_CHECKING, Any

import anyio

if TYPE_CHECKING:
    import socket
    from collections.abc import Awaitable, Callable, Iterator

__all__ = ["serve_uvicorn"]

# Seconds the requests uvicorn cancelled (or a cancelled call cancels) get to finish
# unwinding (their engine aborts) before the call returns anyway.
_UNWIND_TIMEOUT = 10.0


async def serve_uvicorn(
    app: Callable[..., Awaitable[None]],
    sock: socket.socket,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None,
    graceful_timeout: float,
    access_log: bool,
    backlog: int,
) -> None:
    """Serve ``app`` on the listening ``sock`` (adopted) with uvicorn until
    ``shutdown_trigger`` returns (then: no new connections, running requests get
    ``graceful_timeout`` seconds, then are cancelled and awaited)."""
    import uvicorn

    config = uvicorn.Config(
        app,
        http=_protocol_class(),  # httptools' protocol, with the call's access_log
        ws="none",
        lifespan="off",
        loop="none",
        interface="asgi3",
        log_config=None,
        access_log=True,  # False would clear the uvicorn.access logger (module docstring)
        proxy_headers=False,  # as the other servers: the peer is the client
        server_header=False,
        headers=[("server", "trio-vllm")],  # as the h11 server
        backlog=backlog,
        timeout_graceful_shutdown=graceful_timeout,  # type: ignore[arg-type]  # float works
    )
    config.trio_vllm_access_log = access_log  # type: ignore[attr-defined]  # our protocol's
    server = _server_class()(config)
    done = False
    _filter_uvicorn_log(+1)
    try:
        async with anyio.create_task_group() as tg:
            if shutdown_trigger is not None:

                async def trigger() -> None:
                    await shutdown_trigger()
                    server.should_exit = True

                tg.start_soon(trigger)
            await server.serve(sockets=[sock])
            done = True
            tg.cancel_scope.cancel()
    finally:
        try:
            with anyio.CancelScope(shield=True):
                await _close(server, abort=not done)
        finally:
            sock.close()  # after the asyncio server that wraps it
            _filter_uvicorn_log(-1)


# Calls serving now: the filter stays on uvicorn.error while any does (one logger for
# them all; the first to end removed it from the others' logs).
_serving = 0


def _filter_uvicorn_log(change: int) -> None:
    global _serving
    _serving += change
    log = logging.getLogger("uvicorn.error")
    if _serving:
        log.addFilter(_drop_cancelled_requests)  # idempotent
    else:
        log.removeFilter(_drop_cancelled_requests)


def _drop_cancelled_requests(record: logging.LogRecord) -> bool:
    """uvicorn logs a request task it cancels (at its graceful timeout; or this call's
    cancellation) as "Exception in ASGI application" with a CancelledError traceback:
    an ending this call chose (uvicorn's own "Cancel N running task(s)" line says so),
    not an app error; dropped. Other app errors are logged as uvicorn logs them."""
    exc = record.exc_info[1] if record.exc_info else None
    return not isinstance(exc, asyncio.CancelledError)


async def _close(server: Any, *, abort: bool) -> None:
    """What uvicorn left open: after a cancellation everything (aborted); after its own
    shutdown the requests it cancelled at the graceful timeout (still unwinding), and
    the connections still open after them (aborted: a transport closed with unsent data
    waits for its client to read it, forever if it never does)."""
    state = server.server_state
    if abort:
        for listener in getattr(server, "servers", ()):
            listener.close()
        for connection in list(state.connections):
            connection.transport.abort()
        for task in state.tasks:
            task.cancel()
    tasks = set(state.tasks)
    if tasks:
        _, running = await asyncio.wait(tasks, timeout=_UNWIND_TIMEOUT)
        if running:
            logging.getLogger("trio_vllm.server").error(
                "%d request task(s) still running %.0f s after their cancellation; left running",
                len(running),
                _UNWIND_TIMEOUT,
            )
    for connection in list(state.connections):
        connection.transport.abort()


@functools.cache
def _server_class() -> type[Any]:
    """``uvicorn.Server`` without its signal handling (made once uvicorn is imported)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # The caller handles SIGINT/SIGTERM (and asks for shutdown through
            # shutdown_trigger): uvicorn installs nothing, re-raises nothing.
            yield

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            # Shielded: asyncio's create_server starts serving, then awaits once; a
            # cancellation there loses the listener (never put in self.servers, so
            # never closed). Startup is bounded (lifespan off, the socket bound); the
            # cancellation lands at main_loop's first sleep, with self.servers whole.
            with anyio.CancelScope(shield=True):
                await super().startup(sockets)

    return Server


@functools.cache
def _protocol_class() -> type[Any]:
    """httptools' protocol with the call's ``access_log`` (made once uvicorn is imported)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class Protocol(HttpToolsProtocol):
        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            # uvicorn's: "uvicorn.access has handlers"; here: the call said so (where
            # the lines go is the logger's business, as for the other servers).
            self.access_log = config.trio_vllm_access_log

    return Protocol
