"""The commit a benchmark records is ``+dirty`` for any change to the package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import trio_vllm

PACKAGE = Path(trio_vllm.__file__).parent


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_change_outside_bench_marks_the_commit_dirty(tmp_path: Path) -> None:
    # A throwaway repository holding a copy of the package: a change to the client
    # (not to bench/) must make the recorded commit "+dirty".
    repo = tmp_path / "repo"
    shutil.copytree(
        PACKAGE, repo / "src" / "trio_vllm", ignore=shutil.ignore_patterns("__pycache__")
    )
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "x"]):
        subprocess.run(
            ["git", "-C", str(repo), *args], check=True, env=env, capture_output=True, timeout=60
        )
    probe = [sys.executable, "-c", "from trio_vllm.bench._common import _commit; print(_commit())"]
    run_env = {**os.environ, "PYTHONPATH": str(repo / "src")}

    def recorded() -> str:
        out = subprocess.run(
            probe, env=run_env, capture_output=True, text=True, timeout=60, check=True
        )
        return out.stdout.strip()

    clean = recorded()
    assert clean
    assert not clean.endswith("+dirty")
    client = repo / "src" / "trio_vllm" / "client" / "_client.py"
    client.write_text(client.read_text() + "\n# local change\n")
    assert recorded() == f"{clean}+dirty"
