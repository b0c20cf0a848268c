"""Data-parallel benchmark: the same request load through 1 engine (anchor) and N engines.

Every case sends ``--requests`` concurrent echo-model requests of ``--tokens`` tokens
through ``open_client`` with ``client.generate`` (one consumer task each) and measures
wall time and this process's CPU time per output token. The anchor is one engine; the
cases are N engines behind one client (routing, per-engine stats, N sockets'
worth of traffic on one output socket). Printed: requests/s with ``ratio = case /
anchor`` (higher is better), client CPU per token with ``cpu ratio`` (lower is better),
and the spread of requests over ranks. On a 2-core machine N engine processes compete
for the same cores, so throughput cannot scale; the CPU ratio shows what routing over
N engines costs the client. Not a test: nothing asserts.

    python bench/bench_dp.py [--requests 800] [--tokens 16] [--engines 2 4] [--backend trio]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import anyio

from trio_vllm.client import ReferenceEngines, make_request, open_client


async def run_case(engines: int, requests: int, tokens: int) -> dict[str, float | str]:
    async with open_client(ReferenceEngines(engines, model="echo"), ready_timeout=120) as client:
        ranks: Counter[int] = Counter()
        outputs = 0

        async def one(i: int) -> None:
            nonlocal outputs
            request = make_request([i % 50 + 1], max_tokens=tokens)
            async with client.generate(request) as stream:
                ranks[stream.rank] += 1
                got = len(await stream.collect())  # not `+= await`: reads before awaiting
                outputs += got

        # Warm-up (imports, first connections), then the measured round.
        async with anyio.create_task_group() as tg:
            for i in range(min(requests, 50)):
                tg.start_soon(one, i)
        ranks.clear()
        outputs = 0
        wall0, cpu0 = time.perf_counter(), time.process_time()
        async with anyio.create_task_group() as tg:
            for i in range(requests):
                tg.start_soon(one, i)
        wall = time.perf_counter() - wall0
        cpu = time.process_time() - cpu0
    spread = "/".join(str(ranks[r]) for r in sorted(ranks))
    return {
        "req_s": requests / wall,
        "cpu_us_per_token": 1e6 * cpu / max(outputs, 1),
        "spread": spread,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--engines", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--backend", default="trio", choices=["trio", "asyncio"])
    args = parser.parse_args()
    anchor = anyio.run(run_case, 1, args.requests, args.tokens, backend=args.backend)
    print(
        f"anchor  1 engine : {anchor['req_s']:8.0f} req/s  "
        f"{anchor['cpu_us_per_token']:6.1f} us CPU/token  spread {anchor['spread']}"
    )
    for n in args.engines:
        case = anyio.run(run_case, n, args.requests, args.tokens, backend=args.backend)
        ratio = float(case["req_s"]) / float(anchor["req_s"])
        cpu_ratio = float(case["cpu_us_per_token"]) / float(anchor["cpu_us_per_token"])
        print(
            f"case   {n:2d} engines: {case['req_s']:8.0f} req/s  "
            f"{case['cpu_us_per_token']:6.1f} us CPU/token  spread {case['spread']}  "
            f"ratio {ratio:.2f}  cpu ratio {cpu_ratio:.2f}"
        )


if __name__ == "__main__":
    main()
