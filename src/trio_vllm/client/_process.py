"""Engine processes the client spawned: output capture, exit watching, shutdown.

Every process is started in its own session (process group), so that a launcher's
children (a ``vllm serve --headless`` launcher forks engine cores, which fork
workers) can be killed with it. Its stdout and stderr are merged into one pipe that a
task drains all the time, keeping the last lines in a bounded ring for error messages
and forwarding each line to the ``trio_vllm.engine.<rank>`` logger (``trio_vllm._log``:
a bounded queue and a thread, so a slow log handler never stalls the event loop); the
pipe is never left full, so a chatty engine never blocks on a write.

Shutdown is SIGTERM to the process (to its whole group if it already exited: a
launcher may quit before its children), a grace period that also covers group members
outliving it, then SIGKILL to the whole group, then reaping: no zombie is left, also
when the caller is cancelled (the shutdown runs shielded under its own deadline).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import signal
import subprocess
from typing import TYPE_CHECKING

import anyio
import anyio.abc

from .._log import ENGINE_LOGGER, forward_engine_line

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

__all__ = ["EngineProcess", "spawn_engine_process"]

_TAIL_LINES = 40
_MAX_LINE = 2000
# After the process exited, how long to keep reading its pipe for the last lines.
# Short: the exit must reach waiters within 100 ms, and grandchildren may hold the pipe.
_FINAL_DRAIN_S = 0.03
_KILL_WAIT_S = 5.0

_log = logging.getLogger("trio_vllm.client")
# vLLM names a data-parallel engine core's process EngineCore_DP<global rank>.
_DP_PREFIX = re.compile(r"\(\S*?_DP(\d+)\S* pid=\d+\)")


class EngineProcess:
    """One spawned engine (or launcher) process serving ``ranks``.

    Created by `spawn_engine_process`. The owner runs `watch` in its task
    group and calls `stop` (shielded) at the end.
    """

    def __init__(self, process: anyio.abc.Process, *, name: str, ranks: Sequence[int]) -> None:
        self.process = process
        self.name = name
        self.ranks = tuple(ranks)
        self.pid = process.pid
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._partial = b""
        self.returncode: int | None = None
        self.exited = anyio.Event()
        self._eof = anyio.Event()
        # A launcher serving several ranks logs under its first rank, except the lines
        # its engine cores and workers prefix with their rank ("(EngineCore_DP1 pid=7)").
        self._engine_log = logging.getLogger(
            f"{ENGINE_LOGGER}.{self.ranks[0] if self.ranks else name}"
        )
        self._rank_logs = (
            {r: logging.getLogger(f"{ENGINE_LOGGER}.{r}") for r in self.ranks}
            if len(self.ranks) > 1
            else {}
        )

    def __repr__(self) -> str:
        return f"<EngineProcess {self.name} pid={self.pid} ranks={list(self.ranks)}>"

    def output_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines the process wrote (stdout and stderr merged)."""
        tail = list(self._tail)
        if self._partial:
            tail.append(self._partial.decode("utf-8", "replace")[:_MAX_LINE])
        return "\n".join(tail[-lines:])

    def describe_exit(self) -> str:
        """``"<name> (pid N) exited with code C"`` plus the output tail, for messages."""
        code = self.returncode
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        text = f"{self.name} (pid {self.pid}) {how}"
        tail = self.output_tail()
        if tail:
            indented = "\n".join("    " + line for line in tail.splitlines())
            text += f"; last lines of its output:\n{indented}"
        else:
            text += " without writing any output"
        return text

    def _feed(self, data: bytes) -> None:
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            self._line(line.decode("utf-8", "replace").rstrip("\r")[:_MAX_LINE])
        if len(self._partial) > _MAX_LINE * 4:
            # A huge line without newline: keep its start; the ring stays bounded.
            self._line(self._partial[:_MAX_LINE].decode("utf-8", "replace"))
            self._partial = b""

    def _line(self, line: str) -> None:
        self._tail.append(line)
        log = self._engine_log
        if self._rank_logs and (match := _DP_PREFIX.match(line)):
            log = self._rank_logs.get(int(match.group(1)), log)
        forward_engine_line(log, line, self.pid)

    async def _drain(self) -> None:
        stream = self.process.stdout
        try:
            if stream is None:
                return
            with contextlib.suppress(
                anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError
            ):
                while True:
                    self._feed(await stream.receive(65536))
        finally:
            self._eof.set()

    async def watch(self, on_exit: Callable[[EngineProcess], None]) -> None:
        """Drain the output and wait for the exit; then call ``on_exit(self)`` once.

        Runs until the process exits (or the caller is cancelled, then ``on_exit`` is
        not called). ``on_exit`` is a plain function, called right after the exit is
        observed and the last output lines are collected (at most a few ms).
        """
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._drain)
            self.returncode = await self.process.wait()
            # The pipe reaches EOF at once unless grandchildren still hold it open.
            with anyio.move_on_after(_FINAL_DRAIN_S):
                await self._eof.wait()
            tg.cancel_scope.cancel()
        if self._partial:  # a last line without newline
            self._line(self._partial.decode("utf-8", "replace")[:_MAX_LINE])
            self._partial = b""
        _log.debug("%s (pid %d) exited with code %s", self.name, self.pid, self.returncode)
        self.exited.set()
        on_exit(self)

    async def stop(self, grace: float) -> None:
        """SIGTERM, wait up to ``grace`` seconds for the process and the members of its
        group that outlive it, SIGKILL the group, reap.

        Idempotent. Always runs to completion: shielded from outer cancellation, and
        bounded by ``grace`` plus a few seconds.
        """
        with anyio.CancelScope(shield=True):
            deadline = anyio.current_time() + grace
            if self.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self.process.send_signal(signal.SIGTERM)
                # A stopped engine (SIGSTOP, or declared hung) would hold its SIGTERM
                # pending for the whole grace: let it run and handle it now.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.pid, signal.SIGCONT)
                with anyio.move_on_after(grace):
                    await self.process.wait()
            else:
                # It exited first, e.g. a vLLM launcher that quits as soon as one of its
                # engine cores dies: the rest of its group get SIGTERM too (the launcher
                # may have sent it already), not an instant SIGKILL mid-teardown.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.pid, signal.SIGTERM)
            # Members that outlive the leader get the rest of the grace.
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                # Polled: nothing notifies us of a non-child's exit (pidfds are per
                # process, and the members are not known up front).
                while _group_has_live_members(self.pid):  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            # Kill whatever is left of the group (the process itself if it ignored
            # SIGTERM, or children a launcher left behind).
            if _group_has_live_members(self.pid):
                _log.warning(
                    "%s (pid %d) or its children outlived the %.1f s grace period: killing",
                    self.name,
                    self.pid,
                    grace,
                )
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            with anyio.move_on_after(_KILL_WAIT_S):
                self.returncode = await self.process.wait()
            with anyio.move_on_after(_KILL_WAIT_S):
                await self.process.aclose()


def _group_has_live_members(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies do not count: an orphan
    lingers as one until its new parent reaps it, which some container inits never do)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile, or not readable
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


async def spawn_engine_process(
    command: Sequence[str],
    *,
    name: str,
    ranks: Sequence[int],
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> EngineProcess:
    """Start ``command`` in a new session with stdout+stderr captured.

    ``env`` entries are added to the current environment. Raises ``OSError`` when the
    executable cannot be started.
    """
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    # Unbuffered python output, so the tail shows the last lines before a crash.
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    # Shielded: on asyncio a cancellation can land inside the subprocess setup after
    # the fork, leaving a child that nobody owns. The spawn is quick; the caller's
    # cancellation is delivered at its next checkpoint, once the process is owned.
    with anyio.CancelScope(shield=True):
        process = await anyio.open_process(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
        )
    _log.debug(
        "spawned %s (pid %d, ranks %s): %s", name, process.pid, list(ranks), " ".join(command)
    )
    return EngineProcess(process, name=name, ranks=ranks)
