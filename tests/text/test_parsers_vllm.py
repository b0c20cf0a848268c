"""The parser table against vLLM live: vLLM 0.32's own parser classes, in vLLM's python,
fed the cases of ``parser_cases.py`` (``parsers_vllm.py``), give exactly the recorded
``data/parser_parity.json`` and exactly what our parsers give. Marked ``vllm``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from . import parser_cases
from .test_parsers import CHAIN_IDS, TABLE, ours_chain, ours_reasoning, ours_tools

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).with_name("parsers_vllm.py")


@pytest.fixture(scope="module")
def vllm_table() -> dict[str, dict[str, Any]]:
    python = os.environ.get("TRIO_VLLM_TEST_VLLM_PYTHON")
    if not python:
        pytest.skip("TRIO_VLLM_TEST_VLLM_PYTHON is not set (a python with stock vLLM 0.32.0)")
    proc = subprocess.run(
        [python, str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    marker = proc.stdout.rindex("@@RESULT@@")
    result: dict[str, dict[str, Any]] = json.loads(proc.stdout[marker + len("@@RESULT@@") :])
    return result


def test_the_recorded_table_is_vllms_answer(vllm_table: dict[str, dict[str, Any]]) -> None:
    assert vllm_table == TABLE


@pytest.mark.parametrize(
    ("name", "case", "deltas"),
    parser_cases.TOOL_CASES,
    ids=[f"{n}/{c}" for n, c, _ in parser_cases.TOOL_CASES],
)
def test_tool_parser_live(
    vllm_table: dict[str, dict[str, Any]], name: str, case: str, deltas: list[str]
) -> None:
    assert ours_tools(name, deltas) == vllm_table["tools"][f"{name}/{case}"]


@pytest.mark.parametrize(
    ("name", "case", "deltas"),
    parser_cases.REASONING_CASES,
    ids=[f"{n}/{c}" for n, c, _ in parser_cases.REASONING_CASES],
)
def test_reasoning_parser_live(
    vllm_table: dict[str, dict[str, Any]], name: str, case: str, deltas: list[str]
) -> None:
    assert ours_reasoning(name, deltas) == vllm_table["reasoning"][f"{name}/{case}"]


@pytest.mark.parametrize(("reasoning", "tool", "choice", "case", "deltas"),
                         parser_cases.CHAIN_CASES, ids=CHAIN_IDS)  # fmt: skip
def test_chain_live(
    vllm_table: dict[str, dict[str, Any]],
    reasoning: str,
    tool: str,
    choice: str,
    case: str,
    deltas: list[str],
) -> None:
    key = f"{reasoning}+{tool}/{choice}/{case}"
    assert ours_chain(reasoning, tool, choice, deltas) == vllm_table["chain"][key]
