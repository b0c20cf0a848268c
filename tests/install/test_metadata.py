"""What PyPI and a new user read first: the package metadata and the README's install."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_classifiers_state_posix_the_pythons_and_the_status() -> None:
    classifiers = set(PROJECT["classifiers"])
    assert "Operating System :: POSIX" in classifiers
    assert any(c.startswith("Development Status :: ") for c in classifiers)
    minor = int(PROJECT["requires-python"].removeprefix(">=3."))
    assert f"Programming Language :: Python :: 3.{minor}" in classifiers
    assert not any("Windows" in c for c in classifiers)


def test_project_urls() -> None:
    assert {"Homepage", "Documentation", "Source", "Changelog"} <= set(PROJECT["urls"])


def test_the_light_extras_pull_no_torch() -> None:
    extras = PROJECT["optional-dependencies"]
    for light in ("testing", "docs", "text", "structured", "asyncio"):
        assert not any(req.startswith("torch") for req in extras[light]), light
    assert any(req.startswith("pytest") for req in extras["testing"])
    assert "test" not in extras  # replaced by testing (it pulled an unpinned torch)


def test_ci_installs_the_asyncio_server() -> None:
    # dev (what .ci/run installs) pulls [asyncio], so the uvicorn tests run in CI.
    extras = PROJECT["optional-dependencies"]
    assert {"uvicorn", "httptools", "uvloop"} <= {
        req.split(">")[0].split(";")[0].strip() for req in extras["asyncio"]
    }
    (dev_self,) = [req for req in extras["dev"] if req.startswith("trio-vllm[")]
    assert "asyncio" in dev_self.partition("[")[2].rstrip("]").split(",")


def test_the_readme_installs_as_a_user_first() -> None:
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert first is not None
    # From the clone: the package is not on PyPI yet, and the README says so.
    assert first.group(1).strip().splitlines()[-1] == "pip install ."
    assert "once the package is published on PyPI; it is\nnot there yet" in readme
    for extra in ("torch", "testing", "text", "dev"):
        assert f"`trio-vllm[{extra}]`" in readme
    develop = readme.index("## Develop")
    assert readme.index(f"{CPU_INDEX} -c constraints-cpu.txt -e '.[dev]'") > develop


CPU_INDEX = "pip install --extra-index-url https://download.pytorch.org/whl/cpu"


def test_the_cpu_torch_pin_names_a_build_only_the_cpu_index_has() -> None:
    # torch==2.13.0 on PyPI is the CUDA build; the +cpu local version is PyTorch's CPU
    # index's alone, so the pin cannot resolve to CUDA libraries.
    pins = [
        line
        for line in (ROOT / "constraints-cpu.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert pins == ["torch==2.13.0+cpu"]
    readme = (ROOT / "README.md").read_text()
    assert f"{CPU_INDEX} -c constraints-cpu.txt '.[torch]'" in readme
