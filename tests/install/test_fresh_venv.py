"""A user's install, in fresh virtual environments built from this checkout.

Opt-in (``TRIO_VLLM_TEST_INSTALL=1``): it builds a wheel and installs it twice from the
package index, a minute or more on a loaded machine; CI does not run it.

* ``pip install trio-vllm`` (no extras) runs the README's first Python example and
  ``trio-vllm generate``, and installs no torch;
* ``pip install 'trio-vllm[testing]'`` runs a scratch project's test that uses the kit's
  fixtures on the echo engine, on trio and asyncio, and installs no torch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("TRIO_VLLM_TEST_INSTALL") != "1",
        reason="builds fresh venvs from the package index; set TRIO_VLLM_TEST_INSTALL=1",
    ),
    pytest.mark.timeout(900),
]


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, f"{cmd}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)])
    (built,) = out.glob("trio_vllm-*.whl")
    return built


def _venv(path: Path, requirement: str) -> Path:
    _run([sys.executable, "-m", "venv", str(path)])
    python = path / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", requirement])
    installed = _run([str(python), "-m", "pip", "list", "--format=freeze"]).lower()
    assert "torch" not in installed, installed
    return python


def _readme_first_python_example() -> str:
    match = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert match is not None
    return match.group(1)


def test_plain_install_runs_the_readme_example(tmp_path: Path, wheel: Path) -> None:
    python = _venv(tmp_path / "venv", str(wheel))
    example = tmp_path / "example.py"
    example.write_text(_readme_first_python_example())
    out = _run([str(python), str(example)], cwd=tmp_path)
    assert "length" in out, out  # the last output's finish reason
    generated = _run([str(tmp_path / "venv" / "bin" / "trio-vllm"), "generate", "hello"])
    assert generated == "hellohellohelloh\n"


def test_testing_extra_runs_a_project_with_the_kit(tmp_path: Path, wheel: Path) -> None:
    python = _venv(tmp_path / "venv", f"trio-vllm[testing] @ {wheel.as_uri()}")
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_with_engine.py").write_text(
        textwrap.dedent(
            """
            import pytest
            import trio_vllm as tv

            @pytest.fixture(params=["trio", "asyncio"])
            def anyio_backend(request):
                return request.param

            @pytest.mark.anyio
            @pytest.mark.reference_engines(model="echo")
            async def test_echo(engine_client):
                request = tv.make_request([1, 5, 7], max_tokens=3)
                tokens = []
                async with engine_client.generate(request) as stream:
                    async for out in stream:
                        tokens.extend(out.new_token_ids)
                assert tokens == [1, 5, 7]
            """
        )
    )
    out = _run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project)
    assert "2 passed" in out, out
