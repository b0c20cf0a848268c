"""Soak: many requests through several reference engines with random aborts and cancels.

Every request ends in exactly one of a few ways, and the soak accounts for each:

* ``completed``: streamed to its final output; the tokens must be exactly the echo
  model's (the prompt, cycled) and ``max_tokens`` long;
* ``broke``: the consumer left the ``generate`` block early (``break``): aborted;
* ``cancelled``: a cancel scope around the consumer fired (a random deadline, or a
  cancel at a random output);
* ``raw_completed`` / ``raw_aborted``: sent with ``add_request``, its outputs taken from
  ``get_output``; finished, or aborted with ``abort_requests`` after a random number of
  outputs;
* ``add_cancelled``: the caller was cancelled before ``add_request`` returned.

A few utility calls run alongside, some cancelled. At the end the client must hold no
live request and no pending utility call, every engine must report no request (asked
through its control socket), and the process's RSS growth after the warm-up must stay
under the limit.

Run it outside CI (documented in docs/reliability.md)::

    .venv/bin/python tests/reliability/soak.py --requests 1000000 --out soak.json

The CI test ``test_soak.py`` runs a reduced version (``--requests 20000``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from trio_vllm import EngineCoreClient, make_request
from trio_vllm.testing import assert_no_inflight_requests, open_reference_engines

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectSendStream

OUTCOMES = ("completed", "broke", "cancelled", "raw_completed", "raw_aborted", "add_cancelled")


def rss_bytes() -> int:
    """Resident set size of this process now (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def echo_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    """What the reference engine's echo model generates: the prompt, cycled."""
    return [prompt[i % len(prompt)] for i in range(max_tokens)]


@dataclass
class SoakResult:
    requests: int
    engines: int
    concurrency: int
    seed: int
    backend: str
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    utility_calls: int = 0
    utility_cancelled: int = 0
    wrong_tokens: int = 0
    errors: list[str] = field(default_factory=list)
    rss_start: int = 0
    rss_after_warmup: int = 0
    rss_end: int = 0
    rss_max: int = 0
    seconds: float = 0.0
    rss_samples: list[tuple[int, int]] = field(default_factory=list)

    @property
    def accounted(self) -> int:
        return sum(self.outcomes.values())

    @property
    def rss_growth(self) -> int:
        return self.rss_end - self.rss_after_warmup

    def summary(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            accounted=self.accounted,
            rss_growth_mb=round(self.rss_growth / 2**20, 2),
            requests_per_s=round(self.requests / self.seconds, 1) if self.seconds else None,
        )
        return data


class _RawRouter:
    """Takes ``get_output`` batches and hands each raw request its outputs."""

    def __init__(self, client: EngineCoreClient) -> None:
        self.client = client
        self.waiters: dict[str, MemoryObjectSendStream[Any]] = {}

    async def run(self) -> None:
        while True:
            batch = await self.client.get_output()
            for output in batch.outputs:
                send = self.waiters.get(output.request_id)
                if send is not None:
                    send.send_nowait(output)


async def _one_request(
    client: EngineCoreClient,
    router: _RawRouter,
    rng: random.Random,
    index: int,
    result: SoakResult,
) -> None:
    prompt = [rng.randrange(1, 250) for _ in range(rng.randrange(1, 5))]
    max_tokens = rng.randrange(1, 9)
    request = make_request(prompt, max_tokens=max_tokens, request_id=f"soak-{index}")
    expected = echo_tokens(prompt, max_tokens)
    kind = rng.random()
    if kind < 0.15:
        await _one_raw(client, router, rng, request, expected, result)
        return
    tokens: list[int] = []
    if kind < 0.55:
        async with client.generate(request) as stream:
            async for out in stream:
                tokens.extend(out.new_token_ids)
        if tokens == expected and stream.finish_reason is not None:
            result.outcomes["completed"] += 1
        else:
            result.wrong_tokens += 1
            result.errors.append(f"{request.request_id}: {tokens} != {expected}")
        return
    if kind < 0.75:
        stop_after = rng.randrange(0, max_tokens + 1)
        async with client.generate(request) as stream:
            seen = 0
            async for _out in stream:
                seen += 1
                if seen >= stop_after:
                    break
        result.outcomes["broke" if not stream.finish_reason else "completed"] += 1
        return
    # Cancelled somewhere: at a random output, or by a deadline of up to 3 ms.
    with anyio.CancelScope() as scope:
        if rng.random() < 0.5:
            scope.deadline = anyio.current_time() + rng.random() * 0.003
        cancel_at = rng.randrange(0, max_tokens + 1)
        async with client.generate(request) as stream:
            seen = 0
            async for _out in stream:
                seen += 1
                if seen >= cancel_at:
                    scope.cancel()
                    await anyio.lowlevel.checkpoint()
    if scope.cancelled_caught:
        result.outcomes["cancelled"] += 1
    else:
        result.outcomes["completed" if stream.finish_reason else "broke"] += 1


async def _one_raw(
    client: EngineCoreClient,
    router: _RawRouter,
    rng: random.Random,
    request: Any,
    expected: list[int],
    result: SoakResult,
) -> None:
    rid = request.request_id
    send, receive = anyio.create_memory_object_stream[Any](64)
    router.waiters[rid] = send
    try:
        with send, receive:
            with anyio.CancelScope() as scope:
                if rng.random() < 0.1:
                    scope.cancel()  # cancelled before (or while) the ADD goes out
                await client.add_request(request)
            if scope.cancelled_caught and rid not in client.live_requests:
                result.outcomes["add_cancelled"] += 1
                return
            abort_after = rng.randrange(0, len(expected) + 2)
            tokens: list[int] = []
            async for out in receive:
                tokens.extend(out.new_token_ids)
                if out.finish_reason is not None:
                    break
                if len(tokens) >= abort_after:
                    await client.abort_requests([rid])
                    result.outcomes["raw_aborted"] += 1
                    return
            if tokens == expected:
                result.outcomes["raw_completed"] += 1
            else:
                result.wrong_tokens += 1
                result.errors.append(f"raw {rid}: {tokens} != {expected}")
    finally:
        del router.waiters[rid]


async def _utility_loop(client: EngineCoreClient, rng: random.Random, result: SoakResult) -> None:
    while True:
        await anyio.sleep(0.01)
        with anyio.CancelScope() as scope:
            if rng.random() < 0.3:
                scope.deadline = anyio.current_time() + rng.random() * 0.002
            tasks = await client.call_utility("get_supported_tasks", rank=rng.choice(client.ranks))
            assert "generate" in tasks
        result.utility_calls += 1
        if scope.cancelled_caught:
            result.utility_cancelled += 1


async def run_soak(
    requests: int,
    *,
    engines: int = 4,
    concurrency: int = 64,
    seed: int = 0,
    warmup_fraction: float = 0.05,
    progress: bool = False,
) -> SoakResult:
    """Run the soak on the current event loop (trio or asyncio); see the module doc."""
    result = SoakResult(
        requests=requests,
        engines=engines,
        concurrency=concurrency,
        seed=seed,
        backend=_backend(),
    )
    rng = random.Random(seed)
    result.rss_start = rss_bytes()
    warmup = max(1, int(requests * warmup_fraction))
    started = time.monotonic()
    async with open_reference_engines(
        count=engines, model="echo", extra_args=("--max-num-seqs", "256")
    ) as engine_set:
        client = engine_set.client
        router = _RawRouter(client)
        next_index = 0
        finished = 0
        sample_every = max(1, requests // 200)

        async def worker() -> None:
            nonlocal next_index, finished
            while next_index < requests:
                index = next_index
                next_index += 1
                await _one_request(client, router, random.Random(rng.random()), index, result)
                finished += 1
                if finished == warmup:
                    result.rss_after_warmup = rss_bytes()
                if finished % sample_every == 0:
                    rss = rss_bytes()
                    result.rss_max = max(result.rss_max, rss)
                    result.rss_samples.append((finished, rss))
                    if progress:
                        rate = finished / (time.monotonic() - started)
                        print(
                            f"{finished}/{requests} {rate:.0f} req/s rss {rss / 2**20:.1f} MB",
                            file=sys.stderr,
                            flush=True,
                        )

        async with anyio.create_task_group() as tg:
            tg.start_soon(router.run)
            tg.start_soon(_utility_loop, client, random.Random(seed + 1), result)
            async with anyio.create_task_group() as workers:
                for _ in range(concurrency):
                    workers.start_soon(worker)
            tg.cancel_scope.cancel()
        result.seconds = time.monotonic() - started
        # Everything must be accounted for, on the client and on the engines.
        assert_no_inflight_requests(client)
        await engine_set.wait_idle(within=5.0)
        result.rss_end = rss_bytes()
        result.rss_max = max(result.rss_max, result.rss_end)
    return result


def _backend() -> str:
    import sniffio

    return sniffio.current_async_library()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["trio", "asyncio"], default="trio")
    parser.add_argument("--rss-limit-mb", type=float, default=20.0)
    parser.add_argument("--out", help="write the JSON summary here too")
    args = parser.parse_args(argv)
    result = anyio.run(
        lambda: run_soak(
            args.requests,
            engines=args.engines,
            concurrency=args.concurrency,
            seed=args.seed,
            progress=True,
        ),
        backend=args.backend,
    )
    summary = result.summary()
    summary.pop("rss_samples")
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(result.summary(), indent=2))
    ok = (
        result.accounted == result.requests
        and result.wrong_tokens == 0
        and result.rss_growth < args.rss_limit_mb * 2**20
    )
    print("SOAK", "PASSED" if ok else "FAILED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
