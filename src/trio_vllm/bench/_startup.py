"""``trio-vllm bench startup``: what ``open_client`` adds to an engine's own startup.

Each round, alternately: the engine's own readiness time (a blocking pyzmq frontend
binds, spawns a direct-mode reference engine and waits for its ready message: process
start, imports, connect) and its stop time (SIGTERM until reaped); then
``open_client`` from entry to the body (bind, spawn, handshake, ready) and from the
end of the body to the return (SIGTERM, reap, close, clean up). Reported: medians,
and the client's overhead = open_client ready - engine ready (handshake included;
the median of the per-round differences),
plus two parts of it measured directly: entry -> engine process spawned, and the last
handshake event (``on_progress``) -> the body.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import anyio

from ..client import ReferenceEngines, open_client
from ._common import direct_engine, emit, engine_args, machine


def _anchor() -> tuple[float, float, float, float]:
    with direct_engine() as engine:
        ready = engine.ready_s
        start = time.perf_counter()
    return ready, time.perf_counter() - start, 0.0, 0.0


async def _ours() -> tuple[float, float, float, float]:
    """(ready, shutdown, entry -> engine spawned, last handshake event -> body)."""
    progress: list[float] = []
    start = time.perf_counter()
    async with open_client(
        ReferenceEngines(model="echo", extra_args=engine_args()),
        ready_timeout=120,
        on_progress=lambda _: progress.append(time.perf_counter()),
    ):
        body = time.perf_counter()
        ready = body - start
        stop = time.perf_counter()
    # The first progress report comes right after the engine process was spawned.
    return ready, time.perf_counter() - stop, progress[0] - start, body - progress[-1]


def run(args: Any) -> int:
    backends = [b for b in str(args.backend).split(",") if b]
    samples: dict[str, list[tuple[float, float, float, float]]] = {"engine": []}
    samples.update({b: [] for b in backends})
    for _ in range(args.rounds):
        samples["engine"].append(_anchor())
        for backend in backends:
            samples[backend].append(anyio.run(_ours, backend=backend))
    med = {
        k: {
            "ready_ms": statistics.median(x[0] for x in v) * 1000,
            "shutdown_ms": statistics.median(x[1] for x in v) * 1000,
        }
        for k, v in samples.items()
    }
    for backend in backends:
        v = samples[backend]
        med[backend]["to_spawned_ms"] = statistics.median(x[2] for x in v) * 1000
        med[backend]["last_event_to_body_ms"] = statistics.median(x[3] for x in v) * 1000
    engine_ready = med["engine"]["ready_ms"]
    for backend in backends:
        # Rounds alternate, so pair them: the median of per-round differences.
        pairs = zip(samples[backend], samples["engine"], strict=True)
        med[backend]["overhead_ms"] = statistics.median(o[0] - e[0] for o, e in pairs) * 1000
    report = {"bench": "startup", "machine": machine(), "rounds": args.rounds, "median": med}
    table = [f"startup: medians of {args.rounds} rounds (echo reference engine)"]
    table.append(
        f"  {'case':34s} {'ready ms':>9s} {'overhead':>9s} {'shutdown':>9s} "
        f"{'spawned':>9s} {'last->body':>10s}"
    )
    table.append(
        f"  {'engine alone (blocking frontend)':34s} {engine_ready:9.1f} {'':>9s} "
        f"{med['engine']['shutdown_ms']:9.1f}"
    )
    for backend in backends:
        m = med[backend]
        table.append(
            f"  {'open_client on ' + backend:34s} {m['ready_ms']:9.1f} "
            f"{m['overhead_ms']:9.1f} {m['shutdown_ms']:9.1f} {m['to_spawned_ms']:9.1f} "
            f"{m['last_event_to_body_ms']:10.2f}"
        )
    table.append(
        "  overhead = median per-round (ready - engine alone), noisy: process start "
        "dominates; spawned = "
        "entry -> engine process spawned; last->body = last handshake event -> body"
    )
    emit(report, as_json=args.json, table=table)
    return 0
