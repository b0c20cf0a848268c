"""The soak (``soak.py``) in CI size, and the full size outside CI (``-m slow``)."""

from __future__ import annotations

import anyio
import pytest

from .soak import SoakResult, run_soak

pytestmark = pytest.mark.anyio

RSS_LIMIT = 20 * 2**20


def _check(result: SoakResult) -> None:
    summary = result.summary()
    summary.pop("rss_samples")
    print(summary)
    assert result.errors == []
    assert result.wrong_tokens == 0
    assert result.accounted == result.requests, result.outcomes
    # Every way of ending a request was exercised.
    assert all(count > 0 for count in result.outcomes.values()), result.outcomes
    assert result.utility_calls > 0
    assert result.rss_growth < RSS_LIMIT, f"RSS grew {result.rss_growth / 2**20:.1f} MB"


@pytest.mark.timeout(110)
async def test_soak_20k() -> None:
    """20,000 requests through 4 engines: all accounted for, engines idle, RSS flat."""
    with anyio.fail_after(100):
        result = await run_soak(20_000, engines=4, concurrency=64, seed=7)
    _check(result)


@pytest.mark.slow
@pytest.mark.timeout(4 * 3600)
async def test_soak_1m() -> None:
    """The full soak: 1,000,000 requests (outside CI; see docs/reliability.md)."""
    result = await run_soak(1_000_000, engines=4, concurrency=64, seed=1)
    _check(result)
