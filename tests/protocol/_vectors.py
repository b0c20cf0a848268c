"""Where the shared wire vectors live: ``<repo>/../shared/wire-vectors`` (CI always has it)."""

from __future__ import annotations

from pathlib import Path

import pytest

VECTORS_ROOT = Path(__file__).resolve().parents[2].parent / "shared" / "wire-vectors"
RELEASES = ("0.25.1", "0.32.0", "0.33.0")


def vector_dir(release: str) -> Path:
    return VECTORS_ROOT / f"vllm-{release}"


def require_vectors() -> Path:
    """Skip (with the reason) when the shared vector folder is not next to the repo."""
    if not VECTORS_ROOT.is_dir():
        pytest.skip(f"wire vectors not found at {VECTORS_ROOT} (CI provides ../shared)")
    return VECTORS_ROOT


def vector_params() -> list[object]:
    """One pytest param per vector file of every release (empty if the folder is absent)."""
    params: list[object] = []
    if not VECTORS_ROOT.is_dir():
        reason = f"wire vectors not found at {VECTORS_ROOT} (CI provides ../shared)"
        return [pytest.param(None, id="no-vectors", marks=pytest.mark.skip(reason=reason))]
    for release in RELEASES:
        d = vector_dir(release)
        if not d.is_dir():
            continue
        for path in sorted(d.glob("*.json")):
            if path.name != "INDEX.json":
                params.append(pytest.param(path, id=f"{release}/{path.stem}"))
    return params


#: Vectors this repository records itself with stock vLLM, per release folder: ADD frames
#: with structured outputs (tools/record_structured_vectors.py) and a pooling ADD and
#: output (tests/vllm_tier/embed_reference.py, run by test_llm_embed_matches_vllm_llm_embed).
REPO_VECTORS_ROOT = Path(__file__).resolve().parent / "wire_vectors"


def repo_vector_files() -> list[Path]:
    return sorted(p for p in REPO_VECTORS_ROOT.glob("vllm-*/*.json") if p.name != "INDEX.json")
