"""hypercorn and prometheus_client load only when an app is built or served."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_server_loads_no_http_stack() -> None:
    code = (
        "import sys, trio_vllm, trio_vllm.server, trio_vllm.cli._serve\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('hypercorn', 'prometheus_client', 'h11', 'openai', 'tokenizers', 'jinja2'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
