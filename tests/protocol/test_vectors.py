"""Every captured vLLM vector passes through the codec (the same checks as the command)."""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from trio_vllm._wirecheck import check_file, run_wire_check

from ._vectors import RELEASES, repo_vector_files, require_vectors, vector_dir, vector_params

if TYPE_CHECKING:
    from pathlib import Path


@pytest.mark.parametrize("path", vector_params())
def test_vector(path: Path) -> None:
    result = check_file(path)
    assert result.passed, f"{path.name}: {result.reason}"


@pytest.mark.parametrize("path", repo_vector_files(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_repo_vector(path: Path) -> None:
    """Our own recordings of stock vLLM's frames: ADDs with structured outputs, and a
    pooling ADD and its embedding output as ``LLM.embed`` sent and received them."""
    result = check_file(path)
    assert result.passed, f"{path.name}: {result.reason}"


def test_repo_vectors_are_there() -> None:
    names = {p.stem for p in repo_vector_files()}
    assert {"add_structured_json", "add_structured_choice", "add_structured_regex"} <= names
    assert {"add_pooling_embed_stock", "outputs_pooling_embed_stock"} <= names


@pytest.mark.parametrize("release", RELEASES)
def test_each_release_has_all_30_vectors(release: str) -> None:
    require_vectors()
    files = [p for p in vector_dir(release).glob("*.json") if p.name != "INDEX.json"]
    assert len(files) == 30


def test_run_wire_check_summary(capsys: pytest.CaptureFixture[str]) -> None:
    root = require_vectors()
    status = run_wire_check([str(root / f"vllm-{r}") for r in RELEASES], verbose=False)
    out = capsys.readouterr().out.splitlines()
    assert out == ["90 passed, 0 failed"]
    assert status == 0


def test_run_wire_check_reports_a_broken_vector(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = require_vectors()
    src = root / "vllm-0.32.0"
    for name in ("add_minimal.json", "abort.json", "outputs_finished.json"):
        (tmp_path / name).write_text((src / name).read_text())
    # Change the value of one vector: encoding no longer reproduces vLLM's frames.
    text = (tmp_path / "add_minimal.json").read_text().replace('"max_tokens": 8', '"max_tokens": 9')
    (tmp_path / "add_minimal.json").write_text(text)
    status = run_wire_check([str(tmp_path)], verbose=False)
    out = capsys.readouterr().out.splitlines()
    assert status == 1
    assert out[-1] == "2 passed, 1 failed"
    assert len(out) == 2
    assert out[0].startswith("FAIL ")
    assert "add_minimal.json" in out[0]
    assert "differs" in out[0]


def test_run_wire_check_missing_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = run_wire_check([str(tmp_path / "nope")], verbose=False)
    assert status == 1
    assert capsys.readouterr().out.splitlines()[-1] == "0 passed, 1 failed"


def test_cli_entry_point() -> None:
    root = require_vectors()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trio_vllm.cli",
            "wire",
            "check",
            *(str(root / f"vllm-{r}") for r in RELEASES),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "90 passed, 0 failed"
