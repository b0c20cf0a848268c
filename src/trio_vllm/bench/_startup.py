"""``trio-vllm bench startup``: what ``open_client`` adds to an engine's own startup.

Each round, alternately: the engine's own readiness time (a blocking pyzmq frontend
binds, spawns a direct-mode reference engine and waits for its ready message: process
start, imports, connect) and its stop time (SIGTERM until reaped); then
``open_client`` from entry to the body (bind, spawn, handshake, ready) and from the
end of the body to the return (SIGTERM, reap, close, clean up). Reported: medians,
and the client's overhead = open_client ready - engine ready (handshake included).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import anyio

from ..client import ReferenceEngines, open_client
from ._common import direct_engine, emit, engine_args, machine


def _anchor() -> tuple[float, float]:
    with direct_engine() as engine:
        ready = engine.ready_s
        start = time.perf_counter()
    return ready, time.perf_counter() - start


async def _ours() -> tuple[float, float]:
    start = time.perf_counter()
    async with open_client(
        ReferenceEngines(model="echo", extra_args=engine_args()), ready_timeout=120
    ):
        ready = time.perf_counter() - start
        start = time.perf_counter()
    return ready, time.perf_counter() - start


def run(args: Any) -> int:
    backends = [b for b in str(args.backend).split(",") if b]
    samples: dict[str, list[tuple[float, float]]] = {"engine": []}
    samples.update({b: [] for b in backends})
    for _ in range(args.rounds):
        samples["engine"].append(_anchor())
        for backend in backends:
            samples[backend].append(anyio.run(_ours, backend=backend))
    med = {
        k: {
            "ready_ms": statistics.median(r for r, _ in v) * 1000,
            "shutdown_ms": statistics.median(s for _, s in v) * 1000,
        }
        for k, v in samples.items()
    }
    engine_ready = med["engine"]["ready_ms"]
    for backend in backends:
        med[backend]["overhead_ms"] = med[backend]["ready_ms"] - engine_ready
    report = {"bench": "startup", "machine": machine(), "rounds": args.rounds, "median": med}
    table = [f"startup: medians of {args.rounds} rounds (echo reference engine)"]
    table.append(f"  {'case':36s} {'ready ms':>9s} {'overhead':>9s} {'shutdown':>9s}")
    table.append(
        f"  {'engine alone (blocking frontend)':36s} {engine_ready:9.1f} {'':>9s} "
        f"{med['engine']['shutdown_ms']:9.1f}"
    )
    for backend in backends:
        m = med[backend]
        table.append(
            f"  {'open_client on ' + backend:36s} {m['ready_ms']:9.1f} "
            f"{m['overhead_ms']:9.1f} {m['shutdown_ms']:9.1f}"
        )
    emit(report, as_json=args.json, table=table)
    return 0
