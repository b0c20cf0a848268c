"""``trio-vllm bench idle``: CPU time of a client with open, idle engines.

``time.process_time()`` counts every thread of this process (the event loop and
libzmq's I/O threads). Measured over the same window: a blocking pyzmq ``poll`` on
a direct engine's sockets (the anchor), the bare event loop sleeping without a
client, and a client with ``--engines`` open, idle reference engines. A client that
polls shows up here; one that waits on file descriptors costs about nothing.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import zmq

from ..client import ReferenceEngines, open_client
from ._common import direct_engine, emit, engine_args, machine

_TARGET_MS_PER_5S = 10.0


def _anchor(seconds: float) -> float:
    with direct_engine() as engine:
        poller = zmq.Poller()
        poller.register(engine.inputs, zmq.POLLIN)
        poller.register(engine.outputs, zmq.POLLIN)
        cpu = time.process_time()
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            poller.poll(max(1, int(left * 1000)))
        return time.process_time() - cpu


async def _bare(seconds: float) -> float:
    cpu = time.process_time()
    await anyio.sleep(seconds)
    return time.process_time() - cpu


async def _client(seconds: float, engines: int) -> float:
    source = ReferenceEngines(engines, model="echo", extra_args=engine_args())
    async with open_client(source, ready_timeout=120):
        await anyio.sleep(0.5)  # let startup's last wake-ups settle
        cpu = time.process_time()
        await anyio.sleep(seconds)
        return time.process_time() - cpu


def run(args: Any) -> int:
    seconds = float(args.seconds)
    scale = 5.0 / seconds * 1000  # -> ms per 5 s
    cases: dict[str, float] = {"anchor blocking poll": _anchor(seconds) * scale}
    for backend in [b for b in str(args.backend).split(",") if b]:
        cases[f"{backend} event loop alone"] = anyio.run(_bare, seconds, backend=backend) * scale
        cases[f"{backend} client, {args.engines} idle engines"] = (
            anyio.run(_client, seconds, args.engines, backend=backend) * scale
        )
    report = {
        "bench": "idle",
        "machine": machine(),
        "seconds": seconds,
        "engines": args.engines,
        "target_ms_per_5s": _TARGET_MS_PER_5S,
        "cpu_ms_per_5s": cases,
    }
    table = [f"idle: CPU time of this process over {seconds:g} s (scaled to ms per 5 s)"]
    for name, ms in cases.items():
        mark = ""
        if "client" in name:
            mark = " ok" if ms < _TARGET_MS_PER_5S else f" > {_TARGET_MS_PER_5S:g}"
        table.append(f"  {name:40s} {ms:8.2f} ms{mark}")
    emit(report, as_json=args.json, table=table)
    return 0
