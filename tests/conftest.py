from __future__ import annotations

import pytest


@pytest.fixture(
    params=[
        pytest.param("trio", id="trio"),
        pytest.param("asyncio", id="asyncio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every ``@pytest.mark.anyio`` test on trio and on asyncio."""
    return str(request.param)
