"""Engine process lifecycle with tiny python children: output tail, exit watch, shutdown."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import TYPE_CHECKING

import anyio
import pytest

from trio_vllm.client._process import EngineProcess, spawn_engine_process

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio


def _gone(pid: int) -> bool:
    """True if ``pid`` is neither running nor a zombie child of ours."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child (anymore): reaped
    else:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def _spawn(code: str) -> EngineProcess:
    return await spawn_engine_process([sys.executable, "-c", code], name="test child", ranks=[0])


async def test_exit_is_reported_with_code_and_output_tail() -> None:
    code = (
        "import sys\n"
        "for i in range(100): print('line', i)\n"
        "sys.stderr.write('fatal: boom\\n')\n"
        "sys.exit(3)\n"
    )
    proc = await _spawn(code)
    exits: list[tuple[EngineProcess, float]] = []
    with anyio.fail_after(30):
        await proc.watch(lambda p: exits.append((p, time.monotonic())))
    assert exits
    assert exits[0][0] is proc
    assert proc.returncode == 3
    text = proc.describe_exit()
    assert "exited with code 3" in text
    assert "fatal: boom" in text
    assert "line 99" in text
    assert "line 10\n" not in proc.output_tail(20)  # bounded tail
    await proc.stop(grace=1)
    assert _gone(proc.pid)


async def test_signal_death_is_described() -> None:
    proc = await _spawn("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    with anyio.fail_after(30):
        await proc.watch(lambda p: None)
    assert proc.returncode == -signal.SIGKILL
    assert "killed by SIGKILL" in proc.describe_exit()
    assert "without writing any output" in proc.describe_exit()
    await proc.stop(grace=1)


async def test_exit_observed_promptly() -> None:
    proc = await _spawn("import time; time.sleep(0.3)")
    seen: list[float] = []
    start = time.monotonic()
    with anyio.fail_after(30):
        await proc.watch(lambda p: seen.append(time.monotonic()))
    # The child sleeps 0.3 s; python startup adds some. The watcher itself adds < 0.1 s;
    # how much all of it takes measures the machine, so this only says it was seen.
    assert seen[0] - start < 30
    await proc.stop(grace=1)


async def test_stop_sigterm_then_sigkill_and_reap_group() -> None:
    # The child ignores SIGTERM and starts a grandchild in its process group.
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('grandchild', g.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = await _spawn(code)
    grandchild = None
    with anyio.fail_after(30):
        while grandchild is None:
            await anyio.sleep(0.05)
            # watch() is not running here: read the pipe directly.
            assert proc.process.stdout is not None
            with anyio.move_on_after(0.5):
                proc._feed(await proc.process.stdout.receive())
            for line in list(proc._tail):  # complete lines only
                if line.startswith("grandchild"):
                    grandchild = int(line.split()[1])
    start = time.monotonic()
    await proc.stop(grace=0.3)
    elapsed = time.monotonic() - start
    assert 0.25 < elapsed < 30  # the child sleeps 60 s unless killed
    assert proc.returncode == -signal.SIGKILL
    assert _gone(proc.pid)
    with anyio.fail_after(30):
        while True:
            try:
                os.kill(grandchild, 0)
            except ProcessLookupError:
                break
            # It may linger as a zombie of the (dead) child until init reaps it.
            try:
                stat = await anyio.Path(f"/proc/{grandchild}/stat").read_text()
            except FileNotFoundError:  # reaped between the kill(0) and the read
                break
            if stat.split(") ")[1].startswith("Z"):
                break
            await anyio.sleep(0.02)


# The launcher terminates its child once the child says its SIGTERM handler is in place
# (a fixed wait raced with the child's interpreter startup on a loaded machine: the
# SIGTERM then killed it before the handler existed).
_LAUNCHER = (
    "import os, signal, subprocess, sys\n"
    "child = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]],\n"
    "                         stdout=subprocess.PIPE)\n"
    "assert child.stdout.readline() == b'ready\\n'\n"
    "print('child', child.pid, flush=True)\n"
    "child.terminate()\n"
    "os._exit(1)  # quits at once, as our vLLM launcher does when an engine core dies\n"
)


def _engine_core(teardown_s: float, *, ignore_sigterm: bool = False) -> str:
    """A child that, on SIGTERM, takes ``teardown_s`` to shut down, then writes its
    marker file (argv[1]) and exits; or ignores SIGTERM."""
    if ignore_sigterm:
        return (
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)"
        )
    return (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        f"    time.sleep({teardown_s})\n"
        "    open(sys.argv[1], 'w').write('clean')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )


async def _launcher_that_quit_first(code: str, marker: str) -> tuple[EngineProcess, int]:
    proc = await spawn_engine_process(
        [sys.executable, "-c", _LAUNCHER, code, marker], name="launcher", ranks=[0]
    )
    assert proc.process.stdout is not None
    data = b""
    with anyio.fail_after(30):  # two interpreter startups
        while not data.endswith(b"\n"):  # unbuffered: print() may arrive in pieces
            data += await proc.process.stdout.receive()
    child = int(data.split()[1])
    with anyio.fail_after(30):
        assert await proc.process.wait() == 1
    return proc, child


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_stop_lets_children_that_outlive_the_launcher_finish(tmp_path: Path) -> None:
    """A launcher that exited first (its engine core still shutting down after its
    SIGTERM): stop gives the rest of the group the grace, instead of SIGKILL at once."""
    marker = str(tmp_path / "clean")
    proc, child = await _launcher_that_quit_first(_engine_core(0.5), marker)
    start = time.monotonic()
    await proc.stop(grace=90)
    elapsed = time.monotonic() - start
    assert await anyio.Path(marker).read_text() == "clean"  # its teardown ran to the end
    assert not _running(child)
    assert elapsed < 30, elapsed  # ended with the group (0.5 s), not with the 90 s grace


async def test_stop_kills_children_that_outlive_the_launcher_after_the_grace(
    tmp_path: Path,
) -> None:
    marker = str(tmp_path / "clean")
    proc, child = await _launcher_that_quit_first(_engine_core(0, ignore_sigterm=True), marker)
    start = time.monotonic()
    await proc.stop(grace=0.5)
    elapsed = time.monotonic() - start
    assert 0.45 < elapsed < 30, elapsed  # it ignores SIGTERM: only the SIGKILL ends it
    with anyio.fail_after(30):
        while _running(child):  # noqa: ASYNC110 - not our child: nothing to wait on
            await anyio.sleep(0.02)
    assert not await anyio.Path(marker).exists()


async def test_stop_graceful_exit_within_grace() -> None:
    proc = await _spawn("import time; print('up', flush=True); time.sleep(60)")
    start = time.monotonic()
    await proc.stop(grace=90)
    assert time.monotonic() - start < 30  # ended at the SIGTERM, not with the 90 s grace
    assert proc.returncode == -signal.SIGTERM
    assert _gone(proc.pid)


async def test_stop_completes_when_caller_is_cancelled() -> None:
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(60)"
    )
    proc = await _spawn(code)
    assert proc.process.stdout is not None
    with anyio.fail_after(30):
        assert b"up" in await proc.process.stdout.receive()  # the handler is installed
    with anyio.CancelScope() as scope:
        scope.cancel()
        await proc.stop(grace=0.2)  # shielded: runs to completion anyway
    assert proc.returncode == -signal.SIGKILL
    assert _gone(proc.pid)


async def test_watch_cancelled_does_not_call_on_exit() -> None:
    proc = await _spawn("import time; time.sleep(60)")
    called: list[EngineProcess] = []
    with anyio.move_on_after(0.2):
        await proc.watch(called.append)
    assert called == []
    await proc.stop(grace=1)
    assert _gone(proc.pid)
