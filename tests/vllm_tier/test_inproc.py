"""InprocEngine against stock vLLM, in a python that has it (without: tests/sync).

trio-vllm's own environment has no vLLM, so the real check runs
``_inproc_scenario.py`` with ``TRIO_VLLM_TEST_VLLM_PYTHON`` and this checkout's ``src``
on ``PYTHONPATH`` (InprocEngine needs neither trio nor a socket).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from .conftest import EXPECTED_GREEDY, REPO, TINY_MODEL, vllm_python

SCENARIO = Path(__file__).with_name("_inproc_scenario.py")


@pytest.mark.timeout(600)
def test_inproc_engine_against_stock_vllm() -> None:
    python = vllm_python()
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "src")
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    # vLLM's in-process mode; on CPU it also keeps the worker in this process.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    result = subprocess.run(
        [python, str(SCENARIO), str(TINY_MODEL)],
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
        check=False,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("SCENARIO ")]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert lines, result.stdout[-3000:]
    report = json.loads(lines[0][len("SCENARIO ") :])
    assert report["available"] is True
    assert report["vllm_version"] == "0.32.0"
    assert report["max_model_len"] == 256
    assert report["tokens"] == EXPECTED_GREEDY
    assert report["finish_reason"] == "length"
    assert report["aborted_live"] == []
    assert report["unfinished_after_abort"] is False
    assert report["live_after_break"] == []
    assert report["supported_tasks"] == ["generate"]
    assert report["reset_prefix_cache"] is True
    assert report["is_sleeping"] is False
    assert "not supported in-process" in report["wait_mode"]
    assert report["tokens_again"] == EXPECTED_GREEDY[:4]
