"""The public API is typed for users: ``mypy --strict`` on a user's program agrees with
every ``assert_type`` in ``typed_user_code.py`` (and finds nothing else)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SNIPPET = Path(__file__).with_name("typed_user_code.py")
SRC = Path(__file__).resolve().parents[2] / "src"


def test_user_code_type_checks_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    env = {**os.environ, "MYPYPATH": str(SRC)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--follow-imports=silent",
            "--cache-dir",
            str(tmp_path / "cache"),
            str(SNIPPET),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        env=env,
        cwd=SRC.parent,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success" in result.stdout
