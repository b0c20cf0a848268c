from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

import trio_vllm as tv
from trio_vllm.llm import LLM, open_llm

from ._util import Served, serving

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


@pytest.fixture
def engine_args() -> list[str]:
    """Extra reference-engine arguments; override per module."""
    return []


@pytest.fixture
async def frontend(engine_args: list[str]) -> AsyncIterator[LLM]:
    """The real text frontend on one reference engine (echo model, the shipped
    byte-level model directory)."""
    async with open_llm(tv.ReferenceEngines(1, model="echo", extra_args=engine_args)) as llm:
        yield llm


@pytest.fixture
async def served(frontend: LLM) -> AsyncIterator[Served]:
    async with serving(frontend) as s:
        yield s
