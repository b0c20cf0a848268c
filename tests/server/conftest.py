from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

import trio_vllm as tv

from ._fake import FakeLLM
from ._util import Served, serving

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


@pytest.fixture
def engine_args() -> list[str]:
    """Extra reference-engine arguments; override per module."""
    return []


@pytest.fixture
async def frontend(engine_args: list[str]) -> AsyncIterator[FakeLLM]:
    async with tv.open_client(
        tv.ReferenceEngines(1, model="echo", extra_args=engine_args)
    ) as client:
        yield FakeLLM(client)


@pytest.fixture
async def served(frontend: FakeLLM) -> AsyncIterator[Served]:
    async with serving(frontend) as s:
        yield s
