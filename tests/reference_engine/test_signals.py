"""SIGTERM stops the engine promptly whichever of its threads the kernel delivers it to.

A process-directed signal may land on any thread that does not block it (libzmq's
threads block signals; numpy/torch helper threads do not). Python runs its handler in
the main thread only, so a main thread blocked in ``zmq_poll`` must be woken by the
signal itself: these tests direct SIGTERM at each such thread with ``tgkill`` (what the
kernel does when it picks another thread) and at the process, in the states that hung.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import pytest

from ._harness import request

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._harness import Frontend

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="tgkill and /proc are Linux")

_SYS_TGKILL = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)
# Specified: exit status 0 within a second of SIGTERM. A missed signal is a hang (the
# loop blocks in its poll with no timeout, idle or stalled), so the bound asserted is a
# hang guard; how long the exit took is printed (a loaded machine's wall clock is not
# the engine's).
_EXIT_SPECIFIED = 1.0
_EXIT_WITHIN = 15.0


def _tgkill(pid: int, tid: int, signum: int) -> None:
    if _SYS_TGKILL is None:
        pytest.skip("tgkill syscall number unknown on this machine")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_TGKILL, pid, tid, signum) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tid})")


def _other_threads(pid: int) -> list[int]:
    """Non-main threads that may receive SIGTERM (libzmq's own threads block signals)."""
    tids = []
    for t in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid):
        with open(f"/proc/{pid}/task/{t}/status") as f:
            blocked = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
        if not blocked & (1 << (signal.SIGTERM - 1)):
            tids.append(t)
    return tids


def _exits_promptly(fe: Frontend, what: str) -> None:
    assert fe.proc is not None
    t0 = time.monotonic()
    try:
        code = fe.proc.wait(_EXIT_WITHIN)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"engine did not exit within {_EXIT_WITHIN} s of SIGTERM ({what}); "
            f"stderr: {fe.stderr()}"
        ) from None
    assert code == 0, (what, code, fe.stderr())
    print(
        f"{what}: exited {time.monotonic() - t0:.3f} s after SIGTERM "
        f"(specified: {_EXIT_SPECIFIED:g} s)"
    )


def _idle(fe: Frontend) -> None:
    time.sleep(0.2)  # the loop is in its blocking poll


def _after_control(fe: Frontend) -> None:
    assert fe.control("ping")["ok"] is True
    time.sleep(0.2)


def _stalled(fe: Frontend) -> None:
    fe.add(request([5, 6, 7], max_tokens=10**6))
    assert fe.control("stall") == {"ok": True}
    time.sleep(0.2)


_STATES: dict[str, Callable[[Frontend], Any]] = {
    "idle": _idle,
    "after_control": _after_control,
    "stalled": _stalled,
}


@pytest.mark.parametrize("state", list(_STATES))
def test_sigterm_on_any_thread(spawn, state: str) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM delivered to each non-main thread in turn (fresh engine each time)."""
    fe = spawn(control=True)
    assert fe.proc is not None
    threads = _other_threads(fe.proc.pid)
    assert threads, "expected a helper thread that accepts SIGTERM (numpy's)"
    fe.close()
    for k in range(len(threads)):
        fe = spawn(control=True)
        assert fe.proc is not None
        _STATES[state](fe)
        tids = _other_threads(fe.proc.pid)
        tid = tids[k % len(tids)]
        with open(f"/proc/{fe.proc.pid}/task/{tid}/comm") as f:
            name = f.read().strip()
        _tgkill(fe.proc.pid, tid, signal.SIGTERM)
        _exits_promptly(fe, f"{state}, thread {name}")


@pytest.mark.parametrize("state", list(_STATES))
def test_sigterm_to_the_process_repeatedly(spawn, state: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fe = spawn(control=True)
        _STATES[state](fe)
        fe.signal(signal.SIGTERM)
        _exits_promptly(fe, state)
