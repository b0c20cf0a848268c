"""Load a script of ``bench/`` (not a package) as a module, for tests of its logic."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

BENCH = Path(__file__).parents[2] / "bench"


def load_script(filename: str, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, BENCH / filename)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
