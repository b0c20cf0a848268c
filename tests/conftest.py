from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, settings

if TYPE_CHECKING:
    from collections.abc import Iterator

# Property tests must not depend on how fast the machine runs them: a loaded 2-core CI
# box (or a stock engine freezing every process for seconds) can stall one example past
# hypothesis's 200 ms deadline, or the first examples' generation past its "too slow"
# health check. Both would fail a test that is correct. Tests that set their own
# settings inherit this for what they leave out.
settings.register_profile("trio-vllm", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("trio-vllm")


@pytest.fixture(
    params=[
        pytest.param("trio", id="trio"),
        pytest.param("asyncio", id="asyncio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every ``@pytest.mark.anyio`` test on trio and on asyncio."""
    return str(request.param)


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """Move every object alive before the test into the permanent generation.

    For tests with millisecond bounds. Late in a full run, one full collection walks the
    whole session's heap (pytest's reports, every imported module, torch) and takes
    ~160 ms on 2 cores; the allocations of a test (1,000 exceptions at an engine's death)
    can trigger it inside the measured window, which then measures the collector, not
    the client (one CI run failed so). Frozen, a full collection walks only what the
    test allocated; its own garbage is still collected and still counted.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
