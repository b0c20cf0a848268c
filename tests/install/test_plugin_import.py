"""The pytest plugin is loaded in every pytest run wherever trio-vllm is installed: it
must not import the kit (trio, anyio, zmq, the client) until a fixture runs."""

from __future__ import annotations

import subprocess
import sys


def test_loading_the_plugin_imports_no_kit() -> None:
    code = (
        "import sys, pytest, trio_vllm.testing._plugin\n"
        "heavy = ('trio', 'anyio', 'zmq', 'torch', 'trio_vllm.client',"
        " 'trio_vllm.testing._engines')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"


def test_the_kit_names_still_import() -> None:
    import trio_vllm.testing as kit

    assert kit.EngineConfig().count >= 1
    assert callable(kit.check_cancellation)
    assert set(kit.__all__) <= set(dir(kit))
