"""InprocEngine where vLLM is not installed (trio-vllm's own environment).

The real checks run against stock vLLM in ``tests/vllm/test_inproc.py``.
"""

from __future__ import annotations

import pytest

from trio_vllm import InprocEngine


def test_without_vllm_it_says_so_before_doing_anything() -> None:
    if InprocEngine.available():
        pytest.skip("vLLM is installed here; this checks an environment without it")
    engine = InprocEngine("some-model")
    with pytest.raises(ImportError, match="needs vLLM importable"), engine:
        pytest.fail("must not start")
    with pytest.raises(RuntimeError, match="not started"):
        engine.get_output()


def test_available_ignores_a_vllm_directory_on_sys_path() -> None:
    # pytest puts tests/ on sys.path, where tests/vllm is a package named "vllm";
    # only an installed distribution counts.
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin and "tests" not in spec.origin:
        pytest.skip("a real vLLM is importable here")
    assert InprocEngine.available() is False
