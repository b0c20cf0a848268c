"""Benchmark: receive throughput of trio_vllm.transport against its anchors (not a test).

One run measures, with a PUSH sender in another process over ipc://:

* ``blocking``: a raw blocking pyzmq ``recv_multipart`` loop (the ceiling);
* ``zmq.asyncio``: pyzmq's asyncio socket, ``await recv_multipart()`` per message
  (what vLLM's AsyncMPClient uses), on asyncio and on uvloop;
* ``transport``: ``AsyncSocket.receive_batch(256)`` on trio, asyncio and uvloop;

for 200-byte and 8 KiB messages:

* live rate: messages/s while the sender streams (first to last message);
* drain cost: CPU time of the receiving thread per message (``time.thread_time``)
  while draining a queue filled beforehand: the pure per-message cost of the
  receive path, in us/msg. CPU time rather than wall time, so that other load on
  the machine distorts it less; the live rate is wall-clock by nature.

Repeats are interleaved (every design once per round), so changing load on a shared
machine hits all designs alike. Live rate: median of the rounds. Drain cost: the
minimum, the usual estimator of an intrinsic CPU cost under interference; it is
applied to every design, the ceiling included.

Ratios are printed against the blocking ceiling in the same run, and against
zmq.asyncio. ``--json`` prints the figures as JSON instead of a table.

    .venv/bin/python bench/bench_transport.py [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import zmq
import zmq.asyncio

from trio_vllm.transport import AsyncSocket

SENDER = textwrap.dedent(
    """
    import sys, zmq
    ctx = zmq.Context()
    push = None
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "connect":
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.connect(args[0])
        elif cmd == "send":
            n, size = int(args[0]), int(args[1])
            payload, send = b"x" * size, push.send
            for _ in range(n):
                send(payload)
        elif cmd == "close":
            push.close(linger=0)
            push = None
        elif cmd == "quit":
            break
        print("ok", flush=True)
    ctx.term()
    """
)

SIZES = (200, 8192)
LIVE_N = {200: 200_000, 8192: 50_000}
DRAIN_N = {200: 200_000, 8192: 20_000}
SETTLE_S = 0.5  # after a fill, let libzmq's I/O thread move everything into the queue


def settle() -> None:
    """Block (the event loop too, on purpose) while the queue fills; nothing else runs."""
    time.sleep(SETTLE_S)


class Sender:
    """The PUSH sender process, driven line by line over its stdin."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SENDER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def command(self, line: str) -> None:
        self.start(line)
        self.wait()

    def start(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait(self) -> None:
        assert self.proc.stdout is not None
        reply = self.proc.stdout.readline()
        if reply.strip() != "ok":
            raise RuntimeError(f"sender failed: {reply!r}")

    def quit(self) -> None:
        self.start("quit")
        self.proc.wait(timeout=30)


# A receiver design takes (sender, endpoint directory, mode, n, size) and returns
# seconds: wall time first-to-last message for "live", thread CPU time for "drain".
Design = Callable[[Sender, str, str, int, int], float]


def _endpoint(tmpdir: str) -> str:
    return f"ipc://{tmpdir}/b{time.monotonic_ns()}"


def blocking_design(sender: Sender, tmpdir: str, mode: str, n: int, size: int) -> float:
    ctx: zmq.Context[Any] = zmq.Context()
    pull: zmq.Socket[Any] = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    endpoint = _endpoint(tmpdir)
    pull.bind(endpoint)
    sender.command(f"connect {endpoint}")
    sender.command("send 1 8")
    pull.recv_multipart()
    recv = pull.recv_multipart
    if mode == "live":
        sender.start(f"send {n} {size}")
        recv()
        t0 = time.perf_counter()
        for _ in range(n - 1):
            recv()
        elapsed = time.perf_counter() - t0
        sender.wait()
    else:
        sender.command(f"send {n} {size}")
        settle()
        t0 = time.thread_time()
        for _ in range(n):
            recv()
        elapsed = time.thread_time() - t0
    sender.command("close")
    pull.close(linger=0)
    ctx.term()
    return elapsed


def _run_async(fn: Callable[[], Awaitable[float]], loop: str) -> float:
    if loop == "trio":
        return anyio.run(fn, backend="trio")
    options: dict[str, Any] = {}
    if loop == "uvloop":
        import uvloop

        options["loop_factory"] = uvloop.new_event_loop
    return anyio.run(fn, backend="asyncio", backend_options=options)


def zmq_asyncio_design(loop: str) -> Design:
    def design(sender: Sender, tmpdir: str, mode: str, n: int, size: int) -> float:
        async def main() -> float:
            ctx = zmq.asyncio.Context()
            pull = ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.RCVHWM, 0)
            endpoint = _endpoint(tmpdir)
            pull.bind(endpoint)
            sender.command(f"connect {endpoint}")
            sender.command("send 1 8")
            await pull.recv_multipart()
            recv = pull.recv_multipart
            if mode == "live":
                sender.start(f"send {n} {size}")
                await recv()
                t0 = time.perf_counter()
                for _ in range(n - 1):
                    await recv()
                elapsed = time.perf_counter() - t0
                sender.wait()
            else:
                sender.command(f"send {n} {size}")
                settle()
                t0 = time.thread_time()
                for _ in range(n):
                    await recv()
                elapsed = time.thread_time() - t0
            sender.command("close")
            pull.close(linger=0)
            ctx.term()
            # let zmq.asyncio's reader callbacks unwind before the loop closes
            await asyncio.sleep(0)
            return elapsed

        return _run_async(main, loop)

    return design


def transport_design(loop: str) -> Design:
    def design(sender: Sender, tmpdir: str, mode: str, n: int, size: int) -> float:
        async def main() -> float:
            ctx: zmq.Context[Any] = zmq.Context()
            pull = AsyncSocket.create(ctx, zmq.PULL, options={zmq.RCVHWM: 0})
            endpoint = _endpoint(tmpdir)
            pull.bind(endpoint)
            sender.command(f"connect {endpoint}")
            sender.command("send 1 8")
            await pull.receive()
            receive_batch = pull.receive_batch
            if mode == "live":
                sender.start(f"send {n} {size}")
                got = len(await receive_batch(256)) - 1
                t0 = time.perf_counter()
                while got < n - 1:
                    got += len(await receive_batch(256))
                elapsed = time.perf_counter() - t0
                sender.wait()
            else:
                sender.command(f"send {n} {size}")
                settle()
                got = 0
                t0 = time.thread_time()
                while got < n:
                    got += len(await receive_batch(256))
                elapsed = time.thread_time() - t0
            sender.command("close")
            pull.close()
            ctx.term()
            return elapsed

        return _run_async(main, loop)

    return design


DESIGNS: dict[str, Design] = {
    "blocking": blocking_design,
    "zmq.asyncio/asyncio": zmq_asyncio_design("asyncio"),
    "zmq.asyncio/uvloop": zmq_asyncio_design("uvloop"),
    "transport/trio": transport_design("trio"),
    "transport/asyncio": transport_design("asyncio"),
    "transport/uvloop": transport_design("uvloop"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds per figure")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply message counts")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()

    try:
        import uvloop  # noqa: F401
    except ImportError:
        for name in [d for d in DESIGNS if d.endswith("/uvloop")]:
            del DESIGNS[name]

    sender = Sender()
    results: dict[str, dict[str, dict[str, float]]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-transport-") as tmpdir:
            for size in SIZES:
                per_size: dict[str, dict[str, float]] = {}
                live_n = max(1000, int(LIVE_N[size] * args.scale))
                drain_n = max(1000, int(DRAIN_N[size] * args.scale))
                live: dict[str, list[float]] = {name: [] for name in DESIGNS}
                drain: dict[str, list[float]] = {name: [] for name in DESIGNS}
                for round_ in range(args.repeat):
                    for name, design in DESIGNS.items():
                        live[name].append(design(sender, tmpdir, "live", live_n, size))
                        drain[name].append(design(sender, tmpdir, "drain", drain_n, size))
                    if not args.json:
                        print(f"  {size} B: round {round_ + 1} done", file=sys.stderr)
                for name in DESIGNS:
                    per_size[name] = {
                        "live_rate": (live_n - 1) / statistics.median(live[name]),
                        "drain_us_per_msg": min(drain[name]) / drain_n * 1e6,
                        "drain_us_per_msg_median": statistics.median(drain[name]) / drain_n * 1e6,
                    }
                results[str(size)] = per_size
    finally:
        sender.quit()

    for per_size in results.values():
        ceiling = per_size["blocking"]
        anchor = per_size["zmq.asyncio/asyncio"]
        for figures in per_size.values():
            figures["live_vs_ceiling"] = figures["live_rate"] / ceiling["live_rate"]
            figures["drain_vs_ceiling"] = ceiling["drain_us_per_msg"] / figures["drain_us_per_msg"]
            figures["drain_vs_zmq_asyncio"] = (
                anchor["drain_us_per_msg"] / figures["drain_us_per_msg"]
            )
            figures["live_vs_zmq_asyncio"] = figures["live_rate"] / anchor["live_rate"]

    if args.json:
        print(json.dumps({"repeat": args.repeat, "results": results}, indent=2))
        return
    header = (
        f"{'size':>6} {'design':<22} {'live msg/s':>11} {'x ceil':>7} {'x zmq.aio':>9}"
        f" {'drain us/msg':>13} {'x ceil':>7} {'x zmq.aio':>9}"
    )
    print(header)
    print("-" * len(header))
    for size_key, per_size in results.items():
        for name, f in per_size.items():
            print(
                f"{size_key:>6} {name:<22} {f['live_rate']:>11,.0f} {f['live_vs_ceiling']:>7.2f}"
                f" {f['live_vs_zmq_asyncio']:>9.2f} {f['drain_us_per_msg']:>13.2f}"
                f" {f['drain_vs_ceiling']:>7.2f} {f['drain_vs_zmq_asyncio']:>9.2f}"
            )
    print("x ceil: ratio to the blocking loop (drain: ceiling cost / design cost; >1 is faster)")


if __name__ == "__main__":
    main()
