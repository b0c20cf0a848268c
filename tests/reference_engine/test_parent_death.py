"""--parent-pid: an engine whose frontend process was SIGKILLed stops by itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import pytest

from ._harness import request

if TYPE_CHECKING:
    from ._harness import Frontend

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc and pidfd are Linux")

# The "frontend": starts the engine as its child (telling it its own pid), reports the
# engine's pid, then waits to be killed.
_LAUNCHER = (
    "import os, subprocess, sys, time\n"
    "cmd = sys.argv[1:]\n"
    "if cmd[0] == '--watch':\n"
    "    cmd = cmd[1:] + ['--parent-pid', str(os.getpid())]\n"
    "p = subprocess.Popen(cmd)\n"
    "print(p.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _launch(fe: Frontend, watch: bool) -> tuple[subprocess.Popen[bytes], int]:
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, *(["--watch"] if watch else []), *fe.cmd],
        stdout=subprocess.PIPE,
        stderr=fe._stderr,
    )
    assert launcher.stdout is not None
    engine_pid = int(launcher.stdout.readline())
    launcher.stdout.close()
    return launcher, engine_pid


def _kill_engine(pid: int) -> None:
    if not _gone(pid):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("state", ["handshake", "running", "stalled"])
def test_engine_stops_when_its_frontend_is_killed(spawn, state: str) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(start=False, control=True)
    launcher, engine_pid = _launch(fe, watch=True)
    try:
        if state != "handshake":
            fe.do_handshake()
            assert fe.generate(request([3, 4, 5], max_tokens=4)).tokens == [3, 4, 5, 3]
            fe.add(request([7, 8], max_tokens=10**6))  # busy until stopped
            if state == "stalled":
                assert fe.control("stall") == {"ok": True}
        else:
            time.sleep(0.5)  # the engine said HELLO and waits for the init metadata
        launcher.kill()
        launcher.wait(10)
        # Specified: about a second. Without the watch the engine runs on for ever, so
        # the bound is a hang guard (a loaded machine's wall clock is not the engine's);
        # the time is printed.
        killed = time.monotonic()
        deadline = killed + 15.0
        while not _gone(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _gone(engine_pid), f"engine still running ({state}); stderr: {fe.stderr()}"
        print(f"{state}: engine gone {time.monotonic() - killed:.2f} s after its frontend")
        assert "parent process" in fe.stderr()
    finally:
        launcher.kill()
        launcher.wait(10)
        _kill_engine(engine_pid)


def test_without_the_flag_nothing_changes(spawn) -> None:  # type: ignore[no-untyped-def]
    """Default: no watch (stock vLLM engines do not have one either)."""
    fe = spawn(start=False)
    launcher, engine_pid = _launch(fe, watch=False)
    try:
        fe.do_handshake()
        launcher.kill()
        launcher.wait(10)
        time.sleep(1.0)
        assert not _gone(engine_pid)
        assert fe.generate(request([1, 2], max_tokens=3)).tokens == [1, 2, 1]
    finally:
        _kill_engine(engine_pid)


def test_idle_watch_costs_no_cpu(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(start=False)
    launcher, engine_pid = _launch(fe, watch=True)
    try:
        fe.do_handshake()
        with open(f"/proc/{engine_pid}/stat") as f:
            ticks = sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])
        time.sleep(1.0)
        with open(f"/proc/{engine_pid}/stat") as f:
            assert sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13]) - ticks < 10
    finally:
        launcher.kill()
        launcher.wait(10)
        _kill_engine(engine_pid)
