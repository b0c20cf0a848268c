"""The fenced examples of README.md and docs/ that are marked runnable run, as written.

A block is marked by an HTML comment on the line before its opening fence (invisible
on the rendered page):

* ``<!-- runnable -->`` before a ``python`` block: run as a script (``python FILE``);
* ``<!-- runnable: bash -->``: run with ``bash -euo pipefail`` (``trio-vllm`` on PATH);
* ``<!-- runnable: pytest -->``: a test file, run by pytest in a scratch project (the
  kit's plugin is registered wherever trio-vllm is installed).

Each runs in an empty temporary directory and must exit 0 with no traceback. A marker
that is not followed by a fence fails here, so a marked example cannot silently stop
being run. The blocks start reference engines (echo): about a second each.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_MARKER = re.compile(r"^<!-- runnable(?::\s*(\w+))?\s*-->$")
_KINDS = {"python": "python", "bash": "bash", "pytest": "python"}  # kind -> fence language

pytestmark = pytest.mark.timeout(180)


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    kind: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def runnable_blocks() -> list[Block]:
    """Every marked block; ValueError for a marker without its fence."""
    blocks = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        name = str(page.relative_to(ROOT))
        for i, line in enumerate(lines):
            marker = _MARKER.match(line.strip())
            if marker is None:
                continue
            kind = marker.group(1) or "python"
            fence = f"```{_KINDS.get(kind, '?')}"
            if kind not in _KINDS or i + 1 >= len(lines) or lines[i + 1].strip() != fence:
                raise ValueError(f"{name}:{i + 1}: a runnable marker must precede a {fence} fence")
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            blocks.append(Block(name, i + 2, kind, "\n".join(lines[i + 2 : end]) + "\n"))
    return blocks


BLOCKS = runnable_blocks()


def _env() -> dict[str, str]:
    # The interpreter's own scripts (trio-vllm) first on PATH.
    bindir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}


def _check(result: subprocess.CompletedProcess[str], block: Block) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{block.id} exited {result.returncode}:\n{output}"
    assert "Traceback" not in output, f"{block.id}:\n{output}"


def test_the_markers_are_where_they_should_be() -> None:
    ids = {b.page for b in BLOCKS}
    assert {"README.md", "docs/text.md", "docs/testing.md"} <= ids
    # README's first Python example (the install test's too) is among them
    first = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert first is not None
    assert any(b.code == first.group(1) for b in BLOCKS)


def test_a_marker_without_its_fence_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- runnable: bash -->\n```python\nprint(1)\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "PAGES", [page])
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(
        ValueError, match=re.escape("page.md:1: a runnable marker must precede a ```bash")
    ):
        runnable_blocks()


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind != "pytest"], ids=lambda b: b.id)
def test_runnable_example(block: Block, tmp_path: Path) -> None:
    script = tmp_path / ("example.py" if block.kind == "python" else "example.sh")
    script.write_text(block.code, encoding="utf-8")
    command = (
        [sys.executable, str(script)]
        if block.kind == "python"
        else ["bash", "-euo", "pipefail", str(script)]
    )
    result = subprocess.run(
        command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=150,
        stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip
    _check(result, block)


def test_runnable_test_files(tmp_path: Path) -> None:
    """Every ``pytest`` block, as the test files of one scratch project (one pytest run)."""
    blocks = [b for b in BLOCKS if b.kind == "pytest"]
    assert blocks
    for n, block in enumerate(blocks):
        (tmp_path / f"test_doc_{n}.py").write_text(block.code, encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         str(tmp_path)],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=150,
        stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip
    _check(result, blocks[0])
    # every test ran and passed (the kit may run one on several backends)
    passed = re.search(r"\b(\d+) passed\b", result.stdout)
    assert passed is not None, result.stdout
    assert int(passed.group(1)) >= len(blocks), result.stdout
    assert not re.search(r"\b(failed|error|skipped)\b", result.stdout), result.stdout
