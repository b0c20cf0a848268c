"""Test hooks for CLI subprocesses, active when this folder is on PYTHONPATH.

* ``TRIO_VLLM_TEST_HIDE=torch,...``: importing these modules fails as if they were not
  installed (engine processes inherit the variable, so it applies to them too).
* ``TRIO_VLLM_TEST_BLOCK_IMPORT=MODULE:MARKER``: the first import of MODULE creates the
  file MARKER and sleeps, so a test can deliver Ctrl-C in the middle of start-up imports
  (in the process the test started only: the variable is not inherited by its children).
* ``TRIO_VLLM_TEST_HOLD_SPAWN=MARKER``: the first ``subprocess.Popen`` of a reference
  engine, once the child runs, creates MARKER and waits (inside ``Popen()``) until the
  test removes it, so a test can deliver Ctrl-C before ``Popen()`` returns.
"""

import os
import sys
import time

_hidden = {m for m in os.environ.get("TRIO_VLLM_TEST_HIDE", "").split(",") if m}
# Popped: only the process a test started blocks; an engine it spawns would inherit the
# variable, and one that reached the import first made the marker and slept 60 s with
# the command's stderr open after the command itself had exited 130.
_block, _, _marker = os.environ.pop("TRIO_VLLM_TEST_BLOCK_IMPORT", "").partition(":")


class _Hooks:
    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        global _block
        if name.partition(".")[0] in _hidden:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        if _block and name == _block:
            _block = ""
            with open(_marker, "w"):
                pass
            # In slices, not one sleep(60): Python runs a SIGINT's handler (raises
            # KeyboardInterrupt) in the main thread between bytecodes, and one long sleep
            # is cut short only when the signal interrupts that very syscall. A SIGINT
            # taken by another thread (numpy's OpenBLAS workers exist once numpy is
            # imported), or one that lands after the last check and before the sleep
            # starts (a loaded machine preempting the process there), left the sleep to
            # run out: the command exited 130 only 60 s later, after the test's
            # communicate(timeout=60) had given up.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                time.sleep(0.02)
        return None


sys.meta_path.insert(0, _Hooks())


_spawn_marker = os.environ.get("TRIO_VLLM_TEST_HOLD_SPAWN", "")
if _spawn_marker:
    import subprocess

    _execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def _held(self, args, *rest, **kwargs):  # type: ignore[no-untyped-def]
        global _spawn_marker
        _execute_child(self, args, *rest, **kwargs)
        if _spawn_marker and any("reference_engine" in str(a) for a in args):
            marker, _spawn_marker = _spawn_marker, ""
            with open(marker, "w"):
                pass
            while os.path.exists(marker):
                time.sleep(0.02)

    subprocess.Popen._execute_child = _held  # type: ignore[attr-defined]
