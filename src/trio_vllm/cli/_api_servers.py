"""``trio-vllm serve --api-server-count N``: one parent, the engines, N API servers.

As ``vllm serve --api-server-count N``: the parent starts the engines
(`open_shared_engines`, the handshake names N frontends) and N ``trio-vllm serve``
processes, each a full frontend attached to the engines as client ``k``
(`AttachedEngines`), all accepting on one listening socket the parent bound and
passed down (so ``--port 0`` works and the kernel spreads connections over them).
``/metrics`` in any of them shows the group's sums: the servers write their values
to a ``PROMETHEUS_MULTIPROC_DIR`` the parent made (``trio-vllm-metrics-*`` in
TMPDIR) and removes on every exit.

The group lives and dies as one: SIGTERM or Ctrl-C reaches every server (each
drains as ``trio-vllm serve`` does), then the engines stop; status 0. A server that
exits by itself (crash, kill) stops the others; status 1. Engine death: every server
ends its streams and exits 1, so does the parent. Each server also stops if the
parent disappears (it watches the parent's pidfd), and the engines watch it too, so
nothing is left running even after a SIGKILL of the parent.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from anyio.abc import Process

    from .._exceptions import EngineDeadError
    from ..client import EngineSource

__all__ = ["run_api_servers"]

logger = logging.getLogger("trio_vllm.server")

# After the servers were asked to stop: their drain (--shutdown-grace) plus this, then
# SIGKILL. After an engine death: this long for them to end their streams and exit.
_EXIT_MARGIN = 10.0


async def run_api_servers(
    engines: EngineSource,
    *,
    count: int,
    child_argv: Sequence[str],
    host: str,
    port: int,
    shutdown_grace: float,
    ready_timeout: float | None,
) -> int:
    """Run the group; returns the exit status (raises `EngineStartupError`, OSError)."""
    from ..client import open_shared_engines
    from ..server._serve import _listen

    sock = _listen(host, port, 2048)
    metrics_dir = tempfile.mkdtemp(prefix="trio-vllm-metrics-")
    exit_code = 0
    stop = anyio.Event()
    try:
        async with anyio.create_task_group() as outer:

            async def watch_signals() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        logger.info("%s: stopping the API servers", signal.Signals(signum).name)
                        stop.set()

            serving = False

            async def stop_startup(scope: anyio.CancelScope) -> None:
                await stop.wait()
                if not serving:  # still starting the engines: stop that
                    scope.cancel()

            outer.start_soon(watch_signals)
            with anyio.CancelScope() as startup:
                outer.start_soon(stop_startup, startup)
                async with open_shared_engines(
                    engines, clients=count, ready_timeout=ready_timeout
                ) as shared:
                    serving = True
                    exit_code = await _serve_group(
                        shared.attachment.to_json(),
                        shared.wait_dead,
                        count=count,
                        child_argv=child_argv,
                        fd=sock.fileno(),
                        metrics_dir=metrics_dir,
                        shutdown_grace=shutdown_grace,
                        stop=stop,
                    )
            outer.cancel_scope.cancel()
    finally:
        sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return exit_code


async def _serve_group(
    attachment: str,
    wait_dead: Callable[[], Awaitable[EngineDeadError]],
    *,
    count: int,
    child_argv: Sequence[str],
    fd: int,
    metrics_dir: str,
    shutdown_grace: float,
    stop: anyio.Event,
) -> int:
    from prometheus_client import multiprocess

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    processes: list[Process] = []
    failed: list[str] = []
    try:
        for k in range(count):
            command = [
                sys.executable,
                "-m",
                "trio_vllm.cli",
                *child_argv,
                "--attach-engines",
                attachment,
                "--api-server-index",
                str(k),
                "--listen-fd",
                str(fd),
                "--api-server-parent",
                str(os.getpid()),
            ]
            processes.append(
                await anyio.open_process(
                    command, env=env, pass_fds=(fd,), stdin=None, stdout=None, stderr=None
                )
            )
        logger.info(
            "started %d API servers (pids %s)", count, ", ".join(str(p.pid) for p in processes)
        )
        async with anyio.create_task_group() as tg:

            async def watch(k: int, process: Process) -> None:
                code = await process.wait()
                multiprocess.mark_process_dead(process.pid, metrics_dir)  # type: ignore[no-untyped-call]
                if not stop.is_set():
                    failed.append(f"API server {k} (pid {process.pid}) exited with {code}")
                    logger.error("%s; stopping the others", failed[-1])
                    stop.set()
                elif code != 0:
                    failed.append(f"API server {k} (pid {process.pid}) exited with {code}")

            async def watch_engines() -> None:
                error = await wait_dead()
                logger.error("engines died (%s); the API servers end their streams", error)
                failed.append(str(error))
                # Each server noticed it too and exits 1 by itself; give them time.
                await anyio.sleep(_EXIT_MARGIN)
                stop.set()

            for k, process in enumerate(processes):
                tg.start_soon(watch, k, process)
            tg.start_soon(watch_engines)
            await stop.wait()
            await _stop_all(processes, shutdown_grace + _EXIT_MARGIN)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await _stop_all(processes, _EXIT_MARGIN)
    return 1 if failed else 0


async def _stop_all(processes: Sequence[Process], patience: float) -> None:
    """SIGTERM each running server, wait ``patience`` s, SIGKILL what is left; reaped."""
    for process in processes:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
    with anyio.move_on_after(patience):
        for process in processes:
            await process.wait()
    for process in processes:
        if process.returncode is None:
            process.kill()
        await process.wait()
