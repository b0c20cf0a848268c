"""``trio-vllm bench sync``: what a blocking consumer pays per output.

One `SyncClient` and one reference engine (echo model). Each round
starts two requests of ``--tokens`` tokens with a stream buffer large enough that
nothing is coalesced, waits until the engine has sent every output (so the engine's
speed is out of the figure), then drains them: one with ``async for`` inside the
client's event loop (the anchor, what an async application pays) and one by iterating
the `SyncRequestStream` from this thread. The order alternates per
round. Reports outputs/s and CPU per output for both, and the ratio sync / async.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

import anyio

from ..client import ReferenceEngines, make_request
from ..sync import SyncClient
from ._common import emit, engine_args, fmt, machine

if TYPE_CHECKING:
    from ..client import EngineCoreClient, RequestStream
    from ..sync import SyncRequestStream


async def _wait_finished(stream: RequestStream) -> None:
    while not stream.finished:  # noqa: ASYNC110 - a benchmark's setup, not a hot path
        await anyio.sleep(0.005)


async def _wait_none_in_flight(client: EngineCoreClient) -> None:
    # A request leaves the in-flight count when its final output arrives.
    while any(client.in_flight.values()):  # noqa: ASYNC110 - a benchmark's setup
        await anyio.sleep(0.005)


def _drain_sync(client: SyncClient, tokens: int) -> tuple[float, float, int]:
    stream: SyncRequestStream = client.generate(make_request([1], max_tokens=tokens))
    # Wait for the engine to have sent everything: not part of the timing.
    client.portal.call(_wait_none_in_flight, client.async_client)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    count = sum(1 for _ in stream)
    return time.perf_counter() - wall0, time.process_time() - cpu0, count


async def _drain_async(client: EngineCoreClient, tokens: int) -> tuple[float, float, int]:
    async with client.generate(make_request([1], max_tokens=tokens)) as stream:
        await _wait_finished(stream)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        count = 0
        async for _ in stream:
            count += 1
        return time.perf_counter() - wall0, time.process_time() - cpu0, count


def _round(client: SyncClient, tokens: int, sync_first: bool) -> dict[str, tuple[float, ...]]:
    out: dict[str, tuple[float, ...]] = {}
    for case in ("sync", "async") if sync_first else ("async", "sync"):
        if case == "sync":
            out[case] = _drain_sync(client, tokens)
        else:
            out[case] = client.portal.call(_drain_async, client.async_client, tokens)
    return out


def run(args: Any) -> int:
    tokens, rounds = int(args.tokens), int(args.rounds)
    results: dict[str, Any] = {}
    table = [f"sync: draining {tokens:,} buffered outputs, {rounds} rounds (median)"]
    for backend in [b for b in str(args.backend).split(",") if b]:
        engines = ReferenceEngines(model="echo", extra_args=engine_args())
        samples: dict[str, list[tuple[float, ...]]] = {"sync": [], "async": []}
        with SyncClient(engines, backend=backend, stream_buffer=tokens + 1) as client:
            _round(client, min(tokens, 200), True)  # warm-up
            for i in range(rounds):
                for case, sample in _round(client, tokens, i % 2 == 0).items():
                    count = int(sample[2])
                    if count != tokens:
                        raise RuntimeError(f"{case}: {count} outputs, expected {tokens}")
                    samples[case].append(sample)
        per_case: dict[str, dict[str, float]] = {}
        for case, rows in samples.items():
            per_case[case] = {
                "outputs_per_s": statistics.median(tokens / wall for wall, _, _ in rows),
                "cpu_us_per_output": statistics.median(cpu / tokens * 1e6 for _, cpu, _ in rows),
            }
        sync, anchor = per_case["sync"], per_case["async"]
        results[backend] = {
            **per_case,
            "ratio_sync_async": sync["outputs_per_s"] / anchor["outputs_per_s"],
            "cpu_ratio_sync_async": sync["cpu_us_per_output"] / anchor["cpu_us_per_output"],
        }
        for case in ("async", "sync"):
            row = per_case[case]
            table.append(
                f"  {backend:8s} {case:6s} {fmt(row['outputs_per_s']):>10s} outputs/s "
                f"{row['cpu_us_per_output']:7.1f} us CPU/output"
            )
        table.append(
            f"  {backend:8s} sync/async: throughput {results[backend]['ratio_sync_async']:.2f}, "
            f"CPU per output {results[backend]['cpu_ratio_sync_async']:.2f}"
        )
    report = {
        "bench": "sync",
        "machine": machine(),
        "tokens": tokens,
        "rounds": rounds,
        "backends": results,
    }
    emit(report, as_json=args.json, table=table)
    return 0
