"""``sigint_held``: a Ctrl-C that arrives while a child process starts is delivered
once the block is left, to whatever SIGINT disposition was in place before.

Each case runs in a fresh interpreter: the signal goes to that process itself
(``os.kill`` to oneself is delivered before it returns), so nothing here is timed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

_HELD = textwrap.dedent(
    """
    import os, signal, sys
    from trio_vllm.bench._common import sigint_held
    {setup}
    with sigint_held():
        os.kill(os.getpid(), signal.SIGINT)
        print("held", flush=True)
    print("after", flush=True)
    """
)


def _run(setup: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _HELD.format(setup=setup)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def test_a_held_ctrl_c_raises_keyboard_interrupt_on_leaving() -> None:
    # Python's own handler, set explicitly: a child started from a shell's background
    # job inherits SIGINT ignored, and Python then installs no handler of its own.
    done = _run("signal.signal(signal.SIGINT, signal.default_int_handler)")
    assert done.stdout == "held\n"
    assert "KeyboardInterrupt" in done.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signal dispositions")
def test_a_held_ctrl_c_kills_a_process_whose_sigint_is_default() -> None:
    # SIG_DFL means "Ctrl-C terminates": holding it back must not swallow it.
    done = _run("signal.signal(signal.SIGINT, signal.SIG_DFL)")
    assert done.stdout == "held\n"
    assert done.returncode == -signal.SIGINT


def test_a_held_ctrl_c_stays_ignored_where_sigint_is_ignored() -> None:
    done = _run("signal.signal(signal.SIGINT, signal.SIG_IGN)")
    assert (done.returncode, done.stdout) == (0, "held\nafter\n")
