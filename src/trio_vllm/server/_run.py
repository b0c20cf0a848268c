"""``trio-vllm serve``'s body: engines, text frontend, app, signals, the death policy."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from typing import TYPE_CHECKING, Any

import anyio

from ._app import DEFAULT_MAX_BODY_BYTES, OpenAIServer
from ._serve import DEFAULT_SHUTDOWN_GRACE, HTTPServerName, serve_app

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping, Sequence

    from anyio.abc import TaskStatus

    from ..client import ClientOptions, EngineSource
    from ._frontend import TextFrontend
    from ._lora import LoRAModulePath
    from ._tools import ToolOptions

__all__ = ["run_openai_server"]

logger = logging.getLogger("trio_vllm.server")

# Seconds the HTTP server's drain outlasts the app's shutdown grace: time for the error
# events of the requests the app ends at the grace to reach their clients.
_DRAIN_MARGIN = 5.0


async def run_openai_server(
    engines: EngineSource | Sequence[EngineSource],
    *,
    model: str | os.PathLike[str] | None,
    served_model_names: Sequence[str] | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_keys: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE,
    keep_serving_on_engine_death: bool = False,
    merge_outputs: bool = False,
    tool_options: ToolOptions | None = None,
    freeze_gc: bool = False,
    handle_signals: bool = True,
    access_log: bool = False,
    http_server: HTTPServerName = "auto",
    generation_config: str | os.PathLike[str] = "auto",
    override_generation_config: Mapping[str, object] | None = None,
    client_options: ClientOptions | None = None,
    lora_modules: Sequence[LoRAModulePath] = (),
    allow_runtime_lora_updating: bool | None = None,
    trust_request_chat_template: bool = False,
    stop: anyio.Event | None = None,
    listen_fd: int | None = None,
    server_index: int | None = None,
    parent_pid: int | None = None,
    task_status: TaskStatus[OpenAIServer] = anyio.TASK_STATUS_IGNORED,
) -> int:
    """Start the engines, the text frontend and the HTTP server; return an exit status.

    Returns 0 after a requested shutdown (SIGTERM, SIGINT, or ``stop`` set): the server
    stops accepting, running requests get ``shutdown_grace`` seconds (one still running then
    is aborted and ends with an error event and ``[DONE]``, or a 503, and is logged:
    `OpenAIServer.begin_shutdown`), then the engines are stopped (a request during startup
    just stops the startup). Returns 1 when the engines die: every open stream ends with an
    error event, then the server shuts down the same way, so a supervisor restarts it; with
    ``keep_serving_on_engine_death`` it keeps serving instead (``/health`` 503, every
    generation request 503) until asked to stop. ``task_status.started(app)`` hands out the
    app once it listens (``app.port`` is the bound port). ``generation_config`` and
    ``override_generation_config`` are `open_llm`'s (vLLM's ``--generation-config`` and
    ``--override-generation-config``), ``client_options`` its `ClientOptions`;
    ``merge_outputs``, ``lora_modules``, ``allow_runtime_lora_updating``,
    ``trust_request_chat_template`` and ``tool_options`` are `OpenAIServer`'s,
    ``http_server`` `serve_app`'s (the adapters are loaded on the engines before the
    server listens; one that fails to load raises ``ValueError``). With
    ``freeze_gc`` the startup heap (imports, tokenizer, engines' handshake) is collected
    once and frozen (``gc.freeze()``) when the server listens, as ``vllm serve`` does:
    the collector then never walks it again while serving. The process keeps it frozen
    after the call returns (``trio-vllm serve`` always passes it), with the collector's
    young-generation threshold raised to 20,000 allocations (from 700).

    One of several API servers (``trio-vllm serve --api-server-count N``): ``listen_fd``
    is the listening socket the servers share (adopted), ``server_index`` goes into an
    ``x-trio-vllm-server`` header on every response, and the server shuts down (status
    0, as for SIGTERM) if the process ``parent_pid`` exits, so that none is orphaned.

    Raises:
        EngineStartupError: the engines did not start.
        OSError: the address could not be bound.
    """
    from ..llm import open_llm

    shutdown = anyio.Event()
    exit_code = 0
    serving = False

    async def watch_signals() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                logger.info(
                    "%s: no new connections; running requests may take %.0f s",
                    signal.Signals(signum).name,
                    shutdown_grace,
                )
                shutdown.set()

    async def watch_stop(event: anyio.Event) -> None:
        await event.wait()
        shutdown.set()

    async def stop_startup(scope: anyio.CancelScope) -> None:
        await shutdown.wait()
        if not serving:  # still starting: stop that (open_llm stops the engines)
            scope.cancel()

    async def watch_parent() -> None:
        # The parent of a group of API servers: its exit (even SIGKILL) ends this one.
        assert parent_pid is not None
        try:
            fd = os.pidfd_open(parent_pid)
        except OSError:
            fd = -1
        if fd < 0 or os.getppid() != parent_pid:  # gone already (this one reparented)
            if fd >= 0:
                os.close(fd)
            logger.error("the parent process is gone; shutting down")
            shutdown.set()
            return
        try:
            await anyio.wait_readable(fd)
        finally:
            os.close(fd)
        logger.error("the parent process exited; shutting down")
        shutdown.set()

    async with anyio.create_task_group() as outer:
        if handle_signals and threading.current_thread() is threading.main_thread():
            outer.start_soon(watch_signals)
        if parent_pid is not None:
            outer.start_soon(watch_parent)
        if stop is not None:
            outer.start_soon(watch_stop, stop)
        outer.start_soon(stop_startup, outer.cancel_scope)
        async with open_llm(
            engines,
            model=model,
            served_model_name=served_model_names[0] if served_model_names else None,
            generation_config=generation_config,
            override_generation_config=override_generation_config,
            **(client_options or {}),
        ) as llm:
            frontend: TextFrontend = llm
            tasks = await llm.supported_tasks()  # which routes vllm serve would offer
            app = OpenAIServer(
                frontend,
                served_model_names=served_model_names,
                api_keys=api_keys,
                max_body_bytes=max_body_bytes,
                model_root=None if model is None else str(model),
                merge_outputs=merge_outputs,
                tool_options=tool_options,
                lora_modules=lora_modules,
                allow_runtime_lora_updating=allow_runtime_lora_updating,
                trust_request_chat_template=trust_request_chat_template,
                supported_tasks=tasks,
            )
            await app.load_static_loras()

            async def watch_engines() -> None:
                nonlocal exit_code
                error = await frontend.client.wait_dead()
                app.mark_dead()
                if keep_serving_on_engine_death:
                    logger.error("engines died (%s); serving on with /health 503", error)
                    return
                logger.error("engines died (%s); shutting down with exit status 1", error)
                exit_code = 1
                shutdown.set()

            served = anyio.Event()

            served_app: Callable[..., Awaitable[None]] = app
            if server_index is not None:
                served_app = _ServerHeader(app, server_index)
            sock = None
            if listen_fd is not None:
                sock = socket.socket(fileno=listen_fd)

            async def serve(*, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
                try:
                    await serve_app(
                        served_app,
                        sock=sock,
                        host=host,
                        port=port,
                        shutdown_trigger=shutdown.wait,
                        # The app ends what outlives the grace itself (an error event
                        # and [DONE]); the HTTP server's own cut comes only after that.
                        graceful_timeout=shutdown_grace + _DRAIN_MARGIN,
                        access_log=access_log,
                        http_server=http_server,
                        task_status=task_status,
                    )
                finally:
                    served.set()

            async def grace_on_shutdown() -> None:
                await shutdown.wait()
                app.begin_shutdown(shutdown_grace)

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch_engines)
                tg.start_soon(grace_on_shutdown)
                app.port = await tg.start(serve)
                serving = True
                if freeze_gc:
                    _freeze_startup_heap()
                logger.info("serving %s on http://%s:%d", app.model_names[0], host, app.port)
                task_status.started(app)
                await served.wait()  # the HTTP server returned: drained (or cancelled), closed
                tg.cancel_scope.cancel()
        outer.cancel_scope.cancel()
    return exit_code


_GC_YOUNG = 20000  # gc's generation-0 threshold while serving (freeze_gc)


def _freeze_startup_heap() -> None:
    # vLLM's freeze_gc_heap: every generation collected first, so that only what
    # survives (the long-lived startup heap) is frozen.
    import gc

    for generation in (0, 1, 2):
        gc.collect(generation)
    gc.freeze()
    # Then a young generation ~30x Python's default (700 allocations): a streamed token
    # allocates a few dozen short-lived objects (outputs, events, trio's wakeups), and a
    # collection every ~20 tokens of a busy server cost ~4 % of its CPU (issue 25's A/B);
    # the older generations keep their defaults relative to it.
    gc.set_threshold(_GC_YOUNG, *gc.get_threshold()[1:])
    logger.info("startup heap frozen: %d objects (gc.freeze, as vllm serve)", gc.get_freeze_count())


class _ServerHeader:
    """The app with ``x-trio-vllm-server: INDEX`` on every response: which of the
    group's API servers answered (tests and load checks read it)."""

    def __init__(self, app: Callable[..., Awaitable[None]], index: int) -> None:
        self.app = app
        self.header = (b"x-trio-vllm-server", str(index).encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def send_with_header(message: Any) -> None:
            if message.get("type") == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)
