"""The reference engine's tiny model on two devices through the client (run by gpu_check.sh).

For each device (default ``cpu,cuda``) a fresh ``open_client`` spawns one reference
engine with ``--model tiny --device D`` and runs two phases:

1. greedy: PROMPTS requests one after another (a batch of one each, so the batch
   composition cannot differ between devices), MAX_TOKENS tokens each;
2. load: CONCURRENT greedy requests at once through ``generate`` streams.

It prints, per device, steps/s (engine messages per second in the load phase), the
client's CPU per step and its share of the wall time, and how far the client lags:
``time.monotonic()`` at receipt minus the message's ``timestamp`` (the engine's
``time.monotonic()`` when it sent it; one host, one clock). The client keeps up when
its CPU share is well under 1 and the lag does not grow over the run (last-quarter
p50 close to first-quarter p50). Then it compares the greedy tokens of the two
devices, phase 1 exactly (any difference is reported, request by request), phase 2
as well (there a difference may also come from batch composition, which timing
decides). Exit status 0 unless a run failed; differences are reported, not fatal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import anyio

from trio_vllm import ReferenceEngines, make_request, open_client


def _prompt(i: int) -> list[int]:
    return [(7 * i + j * 13) % 250 + 1 for j in range(5 + i % 7)]


async def _run_device(device: str, args: argparse.Namespace) -> dict[str, Any]:
    engines = ReferenceEngines(model="tiny", device=device, extra_args=["--disable-log-stats"])
    began = time.perf_counter()
    async with open_client(engines, ready_timeout=120) as client:
        ready_s = time.perf_counter() - began
        greedy: list[list[int]] = []
        t0 = time.perf_counter()
        for i in range(args.prompts):
            req = make_request(_prompt(i), max_tokens=args.max_tokens, ignore_eos=True)
            async with client.generate(req) as stream:
                greedy.append(await stream.collect())
        greedy_s = time.perf_counter() - t0

        load: list[list[int]] = [[] for _ in range(args.concurrent)]
        lags: list[float] = []
        steps = 0
        reqs = [
            make_request(_prompt(100 + i), max_tokens=args.max_tokens, ignore_eos=True)
            for i in range(args.concurrent)
        ]
        index = {r.request_id: i for i, r in enumerate(reqs)}
        start, cpu = time.perf_counter(), time.process_time()
        for r in reqs:
            await client.add_request(r)
        finished = 0
        while finished < len(reqs):
            batch = await client.get_output()
            now = time.monotonic()
            if not batch.outputs:
                continue
            steps += 1
            lags.append(now - batch.timestamp)
            for out in batch.outputs:
                load[index[out.request_id]].extend(out.new_token_ids)
                finished += out.finish_reason is not None
        wall, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    q = max(1, len(lags) // 4)
    return {
        "device": device,
        "ready_s": ready_s,
        "greedy_s": greedy_s,
        "greedy_tokens_per_s": args.prompts * args.max_tokens / greedy_s,
        "steps": steps,
        "load_s": wall,
        "steps_per_s": steps / wall,
        "tokens_per_s": sum(map(len, load)) / wall,
        "client_cpu_us_per_step": cpu_s / max(1, steps) * 1e6,
        "client_cpu_share": cpu_s / wall,
        "lag_ms_p50_first_quarter": statistics.median(lags[:q]) * 1e3,
        "lag_ms_p50_last_quarter": statistics.median(lags[-q:]) * 1e3,
        "lag_ms_max": max(lags) * 1e3,
        "greedy": greedy,
        "load": load,
    }


def _diff(name: str, a: list[list[int]], b: list[list[int]]) -> list[str]:
    lines = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            at = next((k for k, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), None)
            at = min(len(x), len(y)) if at is None else at
            lines.append(
                f"  {name} request {i}: first difference at token {at}: "
                f"{x[at : at + 5]} vs {y[at : at + 5]} (lengths {len(x)}, {len(y)})"
            )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="cpu,cuda", help="two devices (default cpu,cuda)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--concurrent", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", metavar="FILE", help="also write the results here")
    args = parser.parse_args()
    devices = [d for d in args.devices.split(",") if d]
    if len(devices) != 2:
        parser.error("--devices takes two devices")
    if "cuda" in devices:
        import torch

        if not torch.cuda.is_available():
            print("torch sees no CUDA device; nothing to check", file=sys.stderr)
            return 2
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    runs = []
    for device in devices:
        print(f"running on {device} ...", flush=True)
        runs.append(anyio.run(_run_device, device, args, backend="trio"))
    for r in runs:
        keeps_up = r["client_cpu_share"] < 0.5 and (
            r["lag_ms_p50_last_quarter"] <= 2 * r["lag_ms_p50_first_quarter"] + 1.0
        )
        r["client_keeps_up"] = keeps_up
        print(
            f"{r['device']}: ready {r['ready_s']:.1f} s; greedy {r['greedy_tokens_per_s']:.0f} "
            f"tokens/s (batch of 1); load ({args.concurrent} requests): {r['steps_per_s']:.1f} "
            f"steps/s, {r['tokens_per_s']:.0f} tokens/s; client {r['client_cpu_us_per_step']:.0f}"
            f" us CPU/step ({r['client_cpu_share']:.0%} of wall); lag p50 "
            f"{r['lag_ms_p50_first_quarter']:.2f} -> {r['lag_ms_p50_last_quarter']:.2f} ms, "
            f"max {r['lag_ms_max']:.1f} ms; client keeps up: {'yes' if keeps_up else 'NO'}"
        )
    a, b = runs
    greedy_diff = _diff("greedy", a["greedy"], b["greedy"])
    load_diff = _diff("load", a["load"], b["load"])
    print(
        f"greedy tokens, {a['device']} vs {b['device']}: "
        + ("identical" if not greedy_diff else f"{len(greedy_diff)} request(s) differ")
    )
    print("\n".join(greedy_diff) if greedy_diff else "", end="")
    print(
        "load-phase tokens: "
        + (
            "identical"
            if not load_diff
            else f"{len(load_diff)} request(s) differ (batch composition may differ too)"
        )
    )
    if load_diff:
        print("\n".join(load_diff[:10]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "greedy_diff": greedy_diff, "load_diff": load_diff}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
