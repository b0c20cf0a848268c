"""Test hooks for CLI subprocesses, active when this folder is on PYTHONPATH.

* ``TRIO_VLLM_TEST_HIDE=torch,...``: importing these modules fails as if they were not
  installed (engine processes inherit the variable, so it applies to them too).
* ``TRIO_VLLM_TEST_BLOCK_IMPORT=MODULE:MARKER``: the first import of MODULE creates the
  file MARKER and sleeps, so a test can deliver Ctrl-C in the middle of start-up imports.
"""

import os
import sys
import time

_hidden = {m for m in os.environ.get("TRIO_VLLM_TEST_HIDE", "").split(",") if m}
_block, _, _marker = os.environ.get("TRIO_VLLM_TEST_BLOCK_IMPORT", "").partition(":")


class _Hooks:
    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        global _block
        if name.partition(".")[0] in _hidden:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        if _block and name == _block:
            _block = ""
            with open(_marker, "w"):
                pass
            time.sleep(60)
        return None


sys.meta_path.insert(0, _Hooks())
