from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator


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
