"""Shared pieces of the benchmarks: a directly connected reference engine for the
blocking anchors, machine facts, statistics, and table/JSON output."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from ..protocol.codec import ClientCodec
from ..protocol.profiles import profile_for_version

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

ENGINE_IDENTITY = b"\x00\x00"  # rank 0 (docs/protocol.md §2: 2-byte little-endian rank)
PROTOCOL_VERSION = "0.32.0"


def engine_args(*, firehose: int = 0) -> list[str]:
    """Reference-engine arguments shared by every benchmark (besides ``--model echo``)."""
    args = ["--disable-log-stats", "--max-model-len", "100000000"]
    if firehose:
        args += ["--firehose", str(firehose)]
    return args


def engine_command(inputs: str, outputs: str, *, firehose: int = 0) -> list[str]:
    """A reference engine in direct mode (no handshake) connecting to the two sockets."""
    return [
        sys.executable, "-m", "trio_vllm.reference_engine",
        "--input-address", inputs, "--output-address", outputs, "--model", "echo",
        *engine_args(firehose=firehose),
    ]  # fmt: skip


def stop_process(proc: subprocess.Popen[Any], grace: float = 5.0) -> None:
    """SIGTERM, wait ``grace`` seconds, then SIGKILL; always reaps."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """Hold Ctrl-C back while a child process starts, and raise it on leaving.

    A ``KeyboardInterrupt`` raised inside ``subprocess.Popen`` (after the fork, while it
    waits for the exec) loses the child: no one has its ``Popen`` then, so no one stops
    it. Held here, it is raised once the caller owns the process. Only in the main
    thread (elsewhere Python delivers no signal).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received and callable(previous):
        previous(signal.SIGINT, None)
    elif received and previous == signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)  # the default action: terminate, as unheld


class ScratchDir:
    """A private temporary directory for ipc endpoints, removed on close."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="trio-vllm-bench-")

    def endpoint(self, name: str) -> str:
        return f"ipc://{self.path}/{name}"

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


@dataclass
class DirectEngine:
    """A reference engine connected straight to a blocking ROUTER (input) and PULL
    (output) bound here: the sockets of every blocking anchor."""

    context: zmq.Context[Any]
    inputs: zmq.Socket[bytes]
    outputs: zmq.Socket[bytes]
    process: subprocess.Popen[Any]
    codec: ClientCodec
    ready_s: float = 0.0
    _closed: bool = field(default=False, repr=False)

    def send_add(self, request: Any) -> None:
        self.inputs.send_multipart([ENGINE_IDENTITY, *self.codec.encode_add(request)])

    def receive(self) -> Any:
        return self.codec.decode_outputs(self.outputs.recv_multipart(copy=True))


@contextlib.contextmanager
def direct_engine(*, firehose: int = 0, ready_timeout: float = 120.0) -> Iterator[DirectEngine]:
    """Start a direct-mode reference engine and wait (blocking) for its ready message.

    ``ready_s`` is the engine's own time from spawn to ready message: process start,
    imports, model load, connect. On exit the engine gets SIGTERM and is reaped, and
    every socket is closed.
    """
    scratch = ScratchDir()
    context: zmq.Context[Any] = zmq.Context()
    inputs = context.socket(zmq.ROUTER)
    outputs = context.socket(zmq.PULL)
    proc: subprocess.Popen[Any] | None = None
    try:
        for sock in (inputs, outputs):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
        inputs.bind(scratch.endpoint("input"))
        outputs.bind(scratch.endpoint("output"))
        log_path = os.path.join(scratch.path, "engine.log")
        start = time.perf_counter()
        with open(log_path, "wb") as log, sigint_held():
            proc = subprocess.Popen(
                engine_command(scratch.endpoint("input"), scratch.endpoint("output"),
                               firehose=firehose),
                stdout=subprocess.DEVNULL, stderr=log,
            )  # fmt: skip
        if not inputs.poll(int(ready_timeout * 1000)):
            with open(log_path, errors="replace") as f:
                tail = f.read()[-2000:]
            raise RuntimeError(f"the reference engine sent no ready message:\n{tail}")
        identity, _ready = inputs.recv_multipart()
        ready_s = time.perf_counter() - start
        if identity != ENGINE_IDENTITY:
            raise RuntimeError(f"unexpected engine identity {identity!r}")
        codec = ClientCodec(profile_for_version(PROTOCOL_VERSION))
        yield DirectEngine(context, inputs, outputs, proc, codec, ready_s)
    finally:
        if proc is not None:
            stop_process(proc)
        inputs.close(linger=0)
        outputs.close(linger=0)
        context.term()
        scratch.close()


def _commit() -> str | None:
    """The git commit of the measured source (``+dirty`` with local changes), if any."""
    here = os.path.dirname(os.path.abspath(__file__))
    package = os.path.dirname(here)  # all of trio_vllm is measured, not only bench/
    try:
        head = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no", "--", package],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None  # an installed package, or no git
    return f"{head}+dirty" if dirty else head or None


def machine() -> dict[str, Any]:
    """Where and when a result was measured."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    from .._version import __version__

    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_1min": load[0] if load else None,
        "load_avg": load,  # 1, 5, 15 minutes, when the result is written
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "trio_vllm": __version__,
    }


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (0 <= q <= 100) of an already sorted sequence."""
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def emit(result: dict[str, Any], *, as_json: bool, table: Sequence[str]) -> None:
    """Print one JSON object (``--json``) or the human table."""
    if as_json:
        print(json.dumps(result, separators=(",", ":")))
    else:
        print("\n".join(table))


def fmt(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)
