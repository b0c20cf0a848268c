"""InprocEngine where vLLM is not installed (trio-vllm's own environment).

The real checks run against stock vLLM in ``tests/vllm_tier/test_inproc.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from trio_vllm import InprocEngine

if TYPE_CHECKING:
    from pathlib import Path


def test_without_vllm_it_says_so_before_doing_anything() -> None:
    if InprocEngine.available():
        pytest.skip("vLLM is installed here; this checks an environment without it")
    engine = InprocEngine("some-model")
    with pytest.raises(ImportError, match="needs vLLM importable"), engine:
        pytest.fail("must not start")
    with pytest.raises(RuntimeError, match="not started"):
        engine.get_output()


def test_available_ignores_a_vllm_directory_on_sys_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A directory named "vllm" on sys.path (a checkout, a test folder) is importable
    # but is not vLLM; only an installed distribution counts.
    import importlib.metadata
    import importlib.util

    if "vllm" in importlib.metadata.packages_distributions():
        pytest.skip("a real vLLM is installed here")
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.find_spec("vllm")
    assert spec is not None
    assert spec.origin is not None
    assert str(tmp_path) in spec.origin
    assert InprocEngine.available() is False
