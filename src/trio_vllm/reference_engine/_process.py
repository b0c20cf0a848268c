"""When the engine process must stop: SIGTERM/SIGINT, the signal wake-up socket and the
``--parent-pid`` watch. The pollers of startup and the busy loop wait on what this holds."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from typing import Any

import zmq

from ._errors import EngineExit, log

__all__ = ["ProcessWatch"]


class ProcessWatch:
    """Signals and the parent process; ``stop_requested`` once either says stop."""

    def __init__(self, parent_pid: int | None) -> None:
        self.parent_pid = parent_pid
        self.stop_requested = False
        self.signal_count = 0
        self.parent_fd: int | None = None  # pidfd of --parent-pid, while it lives
        self._parent_check_s: float | None = None  # poll cap without pidfd (old kernels)
        self._initial_ppid = 0
        self._old_wakeup_fd = -1
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    def install(self) -> None:
        """Take SIGTERM/SIGINT and start watching the parent; `uninstall` undoes the fd."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        # The kernel may deliver a process-directed signal to any thread that does not
        # block it (numpy/torch helper threads; libzmq's own block signals); Python then
        # only flags it for the main thread, which stays blocked in zmq_poll and never
        # runs the handler. With the wake-up fd, the C-level handler writes to the socket
        # the poller watches, on whichever thread it runs, so the poll returns.
        self._old_wakeup_fd = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        self._initial_ppid = os.getppid()
        self._watch_parent()

    def uninstall(self) -> None:
        signal.set_wakeup_fd(self._old_wakeup_fd)

    def close(self) -> None:
        self._wake_r.close()
        self._wake_w.close()
        if self.parent_fd is not None:
            os.close(self.parent_fd)
            self.parent_fd = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signal_count += 1
        self.stop_requested = True
        if self.signal_count > 1:
            os._exit(0)  # second signal: stop now, as vLLM's launcher would kill
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # ---- the parent process ----

    def _watch_parent(self) -> None:
        """Start watching --parent-pid: a pidfd the pollers wait on (no polling), or on
        kernels without pidfd_open a check whenever an idle poll times out (0.5 s)."""
        pid = self.parent_pid
        if pid is None:
            return
        try:
            self.parent_fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._parent_gone()
        except (AttributeError, OSError):
            self._parent_check_s = 0.5
            self.check_parent()

    def check_parent(self) -> None:
        pid = self.parent_pid
        if pid is None or self.stop_requested:
            return
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            self._parent_gone()
        except PermissionError:
            pass  # exists, owned by someone else
        else:
            if os.getppid() != pid and pid == self._initial_ppid:
                self._parent_gone()  # it died and its pid was reused; we were reparented

    def _parent_gone(self) -> None:
        log(f"parent process {self.parent_pid} is gone: shutting down")
        self.stop_requested = True
        self._parent_check_s = None
        if self.parent_fd is not None:
            os.close(self.parent_fd)
            self.parent_fd = None

    # ---- what pollers wait on ----

    def register(self, poller: zmq.Poller) -> None:
        """Watch the wake-up socket and the parent's pidfd (if any) on ``poller``."""
        poller.register(self._wake_r, zmq.POLLIN)
        self.register_parent(poller)

    def register_parent(self, poller: zmq.Poller) -> None:
        if self.parent_fd is not None:
            poller.register(self.parent_fd, zmq.POLLIN)

    def after_poll(self, poller: zmq.Poller, events: dict[Any, int]) -> None:
        """After a poll: the pidfd became readable (parent exited), or the fallback
        check; then empty the wake-up socket if a signal wrote to it."""
        fd = self.parent_fd
        if fd is not None and fd in events:
            poller.unregister(fd)  # readable for good: never wait on it again
            self._parent_gone()
        elif self._parent_check_s is not None and not events:
            self.check_parent()
        if self._wake_r.fileno() in events or self._wake_r in events:
            self._drain_wake()

    def poll_timeout(self, timeout: int | None) -> int | None:
        """Cap an idle poll's timeout when the parent can only be checked periodically."""
        if self._parent_check_s is None:
            return timeout
        cap = int(self._parent_check_s * 1000)
        return cap if timeout is None else min(timeout, cap)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(64):
                pass
        except (BlockingIOError, OSError):
            pass

    def sleep(self, seconds: float) -> None:
        """Sleep, but leave with `EngineExit` (status 0) as soon as a stop is requested."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.stop_requested:
                raise EngineExit(0)
            if self.parent_fd is not None or self._parent_check_s is not None:
                self.check_parent()
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))
