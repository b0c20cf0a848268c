"""Running ``vllm serve`` and ``trio-vllm serve --engine vllm`` side by side in the tier.

One place for what every parity module needs: a free port, waiting for ``/health``,
stopping a server (SIGTERM, then SIGKILL), the machine's stock-vLLM lock, and
`serve_pair`, which runs the same requests against both servers in turn.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import httpx

from .conftest import ENGINE_ARGS, ENGINE_ENV, REPO, TINY_MODEL, vllm_python

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

VLLM_CLI = REPO.parent / "shared" / "interop" / "vllm_cli.py"
SERVE_ARGS = [a for a in ENGINE_ARGS if a != "--skip-tokenizer-init"]
SERVED = "tiny"
LOCK = Path("/work/locks/vllm.lock")
R = TypeVar("R")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(process: subprocess.Popen[bytes], port: int, timeout: float) -> None:
    """Until ``GET /health`` answers 200; `AssertionError` if the server exits first or
    ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode} during startup")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"server on port {port} not healthy after {timeout} s")


def stop(process: subprocess.Popen[bytes]) -> int:
    """SIGTERM, up to 120 s to exit, then SIGKILL; the exit status."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(120)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


@contextlib.contextmanager
def vllm_lock() -> Iterator[None]:
    """The machine's stock-vLLM lock (/work/locks/vllm.lock, when it exists), held by
    this process while its stock servers or engines run. Not ``flock`` around the
    ``Popen``: SIGTERM to ``flock`` would leave its child serving, holding the lock."""
    if not LOCK.exists():
        yield
        return
    with LOCK.open() as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def serve_pair(
    run: Callable[[int], R],
    *,
    model: Path = TINY_MODEL,
    server_args: Sequence[str] = (),
    stock_args: Sequence[str] = (),
    our_args: Sequence[str] = (),
    engine_args: Sequence[str] = (),
) -> tuple[R, R]:
    """``run(port)`` against ``vllm serve MODEL``, then against ``trio-vllm serve --engine
    vllm`` on the same model, each under `vllm_lock`: (vLLM's results, ours).

    ``server_args`` go to both command lines, ``stock_args`` to vLLM's only,
    ``our_args`` to ours only; ``engine_args`` are engine flags (vLLM's command line,
    our ``--engine-args``). Ours must exit 0 on SIGTERM."""
    python = vllm_python()
    serve_args = [*SERVE_ARGS, *engine_args]
    stock = [python, str(VLLM_CLI), "serve", str(model), "--served-model-name", SERVED,
             "--host", "127.0.0.1", *serve_args, *server_args, *stock_args]  # fmt: skip
    ours = [sys.executable, "-m", "trio_vllm.cli", "serve", "--engine", "vllm",
            "--vllm-python", python, "--model", str(model), "--served-model-name", SERVED,
            f"--engine-args={' '.join(serve_args)}", "--ready-timeout", "800",
            *server_args, *our_args]  # fmt: skip
    expected = _served(stock, run, exit_status=None)
    got = _served(ours, run, exit_status=0)
    return expected, got


def _served(command: list[str], run: Callable[[int], R], *, exit_status: int | None) -> R:
    """``run(port)`` against ``command --port PORT`` under `vllm_lock`; the server is
    stopped after (`stop`), its exit status asserted unless ``exit_status`` is None."""
    port = free_port()
    with vllm_lock():
        server = subprocess.Popen(
            [*command, "--port", str(port)], env={**os.environ, **ENGINE_ENV},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_healthy(server, port, 900)
            return run(port)
        finally:
            status = stop(server)
            if exit_status is not None:
                assert status == exit_status
