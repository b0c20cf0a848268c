"""``trio-vllm bench latency``: ADD -> first output round trip, p50/p99.

Two reference engines (echo model) run side by side: one owned by ``open_client``,
one connected in direct mode to a blocking ROUTER/PULL pair (ipc, like the client's).
Each round does, back to back and in rotating order: a blocking pyzmq round trip
(send ADD, ``recv`` the output, decode), the same through trio-vllm's ``AsyncSocket``
on the same sockets (the transport alone, no client), a ``client.generate`` round trip
(until the stream yields its first output) and an ``add_request`` + ``get_output``
round trip, so machine noise hits all four alike. Requests ask for one token, so the first output
is also the last.
"""

from __future__ import annotations

import time
from typing import Any

import anyio

from ..client import ReferenceEngines, make_request, open_client
from ..transport import AsyncSocket
from ._common import (
    ENGINE_IDENTITY,
    DirectEngine,
    direct_engine,
    emit,
    engine_args,
    machine,
    percentile,
    ratio,
)

_PROMPT = [1, 2, 3]
_WARMUP = 50


def _raw_round_trip(engine: DirectEngine) -> float:
    request = make_request(_PROMPT, max_tokens=1)
    start = time.perf_counter()
    engine.send_add(request)
    engine.receive()
    return time.perf_counter() - start


async def _stream_round_trip(client: Any) -> float:
    request = make_request(_PROMPT, max_tokens=1)
    start = time.perf_counter()
    elapsed = 0.0
    async with client.generate(request) as stream:
        async for _ in stream:
            if not elapsed:
                elapsed = time.perf_counter() - start
    return elapsed


async def _transport_round_trip(engine: DirectEngine, inputs: Any, outputs: Any) -> float:
    request = make_request(_PROMPT, max_tokens=1)
    start = time.perf_counter()
    await inputs.send([ENGINE_IDENTITY, *engine.codec.encode_add(request)])
    engine.codec.decode_outputs((await outputs.receive_batch(1))[0])
    return time.perf_counter() - start


async def _raw_api_round_trip(client: Any) -> float:
    request = make_request(_PROMPT, max_tokens=1)
    start = time.perf_counter()
    await client.add_request(request)
    await client.get_output()
    return time.perf_counter() - start


async def measure(engine: DirectEngine, rounds: int) -> dict[str, list[float]]:
    """Interleaved round trips; returns sorted samples in seconds per case."""
    samples: dict[str, list[float]] = {"raw": [], "transport": [], "stream": [], "get_output": []}
    # trio-vllm's socket wrapper alone, on the anchor's own sockets (it never closes
    # them; every call drains and re-reads EVENTS, so the blocking calls do no harm).
    inputs, outputs = AsyncSocket(engine.inputs), AsyncSocket(engine.outputs)
    async with open_client(
        ReferenceEngines(model="echo", extra_args=engine_args()), ready_timeout=120
    ) as client:
        for i in range(_WARMUP + rounds):
            # Rotate the order so no case always runs first after a pause.
            for k in range(4):
                case = ("raw", "transport", "stream", "get_output")[(i + k) % 4]
                if case == "raw":
                    # Blocking inside the event loop: nothing else is due meanwhile.
                    value = _raw_round_trip(engine)
                elif case == "transport":
                    value = await _transport_round_trip(engine, inputs, outputs)
                elif case == "stream":
                    value = await _stream_round_trip(client)
                else:
                    value = await _raw_api_round_trip(client)
                if i >= _WARMUP:
                    samples[case].append(value)
    return {k: sorted(v) for k, v in samples.items()}


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "p50_us": percentile(values, 50) * 1e6,
        "p99_us": percentile(values, 99) * 1e6,
        "mean_us": sum(values) / len(values) * 1e6,
    }


_TARGETS = {"p50": 1.5, "p99": 3.0}


def run(args: Any) -> int:
    backends = [b for b in str(args.backend).split(",") if b]
    runs: list[dict[str, Any]] = []
    with direct_engine() as engine:
        for backend in backends:
            samples = anyio.run(measure, engine, args.rounds, backend=backend)
            cases = {k: _summary(v) for k, v in samples.items()}
            ratios: dict[str, float | None] = {}
            for case in ("transport", "stream", "get_output"):
                for q in ("p50", "p99"):
                    ratios[f"{case}/raw {q}"] = ratio(
                        cases[case][f"{q}_us"], cases["raw"][f"{q}_us"]
                    )
            entry: dict[str, Any] = {"backend": backend, "cases": cases, "ratios": ratios}
            if args.samples:
                entry["samples_us"] = {k: [round(x * 1e6) for x in v] for k, v in samples.items()}
            runs.append(entry)
    report = {
        "bench": "latency",
        "machine": machine(),
        "rounds": args.rounds,
        "targets": _TARGETS,
        "runs": runs,
    }
    table = [f"latency: ADD -> first output, echo model, {args.rounds} rounds (interleaved)"]
    for entry in runs:
        table.append(f"  {entry['backend']}")
        table.append(f"    {'case':34s} {'p50 us':>9s} {'p99 us':>9s} {'mean us':>9s}")
        names = {
            "raw": "blocking pyzmq + decoder (anchor)",
            "transport": "AsyncSocket only, same sockets",
            "stream": "trio-vllm generate (stream)",
            "get_output": "trio-vllm add_request + get_output",
        }
        for key, c in entry["cases"].items():
            table.append(
                f"    {names[key]:34s} {c['p50_us']:9.1f} {c['p99_us']:9.1f} {c['mean_us']:9.1f}"
            )
        parts = []
        for key, value in entry["ratios"].items():
            target = _TARGETS[key.rsplit(" ", 1)[1]]
            ok = value is not None and value <= target
            parts.append(f"{key} {value:.2f}{' ok' if ok else f' > {target}'}")
        table.append("    ratios: " + ", ".join(parts))
    emit(report, as_json=args.json, table=table)
    return 0
