"""Two stock vLLM 0.32.0 engine cores (``--data-parallel-size 2``) behind one client.

One headless launcher starts ranks 0 and 1 (``VllmEngines(count=2)``); the client does
the handshake with both, spreads requests over them by load, routes aborts to the
owner and fans utilities out. Runs only with ``TRIO_VLLM_TEST_VLLM_PYTHON``.
"""

from __future__ import annotations

import anyio
import pytest

from trio_vllm.client import VllmEngines, make_request, open_client

from .conftest import ENGINE_ARGS, ENGINE_ENV, EXPECTED_GREEDY, TINY_MODEL, vllm_python

pytestmark = pytest.mark.timeout(900)


@pytest.mark.anyio
async def test_two_stock_engines_share_the_load() -> None:
    engines = VllmEngines(
        str(TINY_MODEL),
        python=vllm_python(),
        extra_args=ENGINE_ARGS,
        count=2,
        env=ENGINE_ENV,
    )
    async with open_client(engines, ready_timeout=700) as client:
        assert client.ranks == [0, 1]
        served: dict[str, int] = {}
        tokens: dict[str, list[int]] = {}

        async def one(i: int) -> None:
            request = make_request(
                [1, 5, 7, 9], max_tokens=8, temperature=0.0, request_id=f"dp-{i}"
            )
            async with client.generate(request) as stream:
                served[request.request_id] = stream.rank
                tokens[request.request_id] = await stream.collect()

        with anyio.fail_after(300):
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(one, i)
        by_rank = [list(served.values()).count(r) for r in (0, 1)]
        assert by_rank == [4, 4], by_rank
        # Both ranks run the same dummy weights: the same greedy tokens.
        assert all(t == EXPECTED_GREEDY for t in tokens.values()), tokens
        # Pinned requests and a per-engine utility fan-out.
        for rank in (0, 1):
            request = make_request([1, 5, 7, 9], max_tokens=2, request_id=f"pin-{rank}")
            with anyio.fail_after(120):
                async with client.generate(request, rank=rank) as stream:
                    assert stream.rank == rank
                    await stream.collect()
        with anyio.fail_after(120):
            results = await client.call_utility_all("is_sleeping", return_exceptions=True)
        assert results == [False, False]
