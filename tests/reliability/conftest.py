"""The reliability suite's pytest configuration.

Tests marked ``slow`` here (the full soak, long fuzzing) are deselected unless asked
for: with an explicit ``-m`` expression that selects them (``pytest -m slow
tests/reliability``) or with ``TRIO_VLLM_SLOW=1``. So the plain ``pytest`` of CI runs
only the CI-sized parts. See docs/reliability.md.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("markexpr") or os.environ.get("TRIO_VLLM_SLOW") == "1":
        return
    here = os.path.dirname(__file__)
    slow = [
        item
        for item in items
        if item.get_closest_marker("slow") is not None and str(item.path).startswith(here)
    ]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item not in slow]
