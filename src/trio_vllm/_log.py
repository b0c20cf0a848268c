"""trio-vllm's loggers and the forwarding of engine processes' output to them.

Loggers (standard library ``logging``; see ``docs/logging.md``): ``trio_vllm`` and its
children, ``trio_vllm.client`` for the client and ``trio_vllm.engine.<rank>`` for each
line a spawned engine process writes. A ``NullHandler`` on ``trio_vllm`` keeps the
library silent until the application configures logging.

Engine lines are handed to a background thread through a bounded queue, so a slow
handler (a file on a slow disk, a blocked terminal) never stalls the event loop, and a
flood of output never grows memory: when the queue is full, lines are dropped and
counted, and a record says how many once there is room again. Lines are only queued
when their logger is enabled for their level, so an application that does not log
engine output pays one ``isEnabledFor`` check per line.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import re
import threading
import time

__all__ = ["ENGINE_LOGGER", "flush_engine_logs", "forward_engine_line", "logger"]

logger = logging.getLogger("trio_vllm")
logger.addHandler(logging.NullHandler())

ENGINE_LOGGER = "trio_vllm.engine"

_QUEUE_LINES = 10_000
# vLLM's format: "INFO 12-01 10:31:13 [core.py:97] ...", in a data-parallel launcher
# prefixed with the engine core's name: "(EngineCore_DP1 pid=123) WARNING ...".
_LEVEL = re.compile(r"^(?:\(\S+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
_LEVELS = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
}


def engine_line_level(line: str) -> int:
    """The level of one engine output line: its vLLM-style prefix, else ``INFO``."""
    match = _LEVEL.match(line)
    return _LEVELS[match.group(1)] if match else logging.INFO


class _Forwarder:
    """The queue and the thread that hands engine lines to their loggers."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start empty, with no thread."""
        # Also in a forked child: the thread is not there, and the locks may have been
        # held by it at the fork.
        self._queue: queue.Queue[tuple[logging.Logger, int, str, int]] = queue.Queue(_QUEUE_LINES)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.dropped = 0
        self._idle = threading.Condition()
        self._busy = 0  # lines queued or being handled

    def put(self, log: logging.Logger, level: int, line: str, pid: int) -> None:
        if self._thread is None:
            self._start()
        # Under the lock: clients in several threads (SyncClient) share the queue. The
        # lock is only held for non-blocking queue operations.
        with self._idle:
            if self.dropped and self._queue.qsize() < _QUEUE_LINES // 2:
                note = f"[{self.dropped} lines of engine output dropped: log handlers too slow]"
                self.dropped = 0
                self._enqueue(log, logging.WARNING, note, pid)
            self._enqueue(log, level, line, pid)

    def _enqueue(self, log: logging.Logger, level: int, line: str, pid: int) -> None:
        try:
            self._queue.put_nowait((log, level, line, pid))
        except queue.Full:
            self.dropped += 1
        else:
            self._busy += 1

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                # A daemon: it must not keep the interpreter alive; it holds nothing
                # but log lines, which flush() can wait for.
                thread = threading.Thread(
                    target=self._run, name="trio-vllm-engine-log", daemon=True
                )
                thread.start()
                self._thread = thread
                # Before logging's own shutdown (atexit runs last-registered first):
                # what the engines wrote last reaches the handlers.
                atexit.register(self.flush, 1.0)

    def _run(self) -> None:
        while True:
            log, level, line, pid = self._queue.get()
            try:
                log.log(level, "%s", line, extra={"engine_pid": pid})
            except Exception:  # a broken handler must not end forwarding for everyone
                pass
            finally:
                with self._idle:
                    self._busy -= 1
                    if self._busy == 0:
                        self._idle.notify_all()

    def flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True


_forwarder = _Forwarder()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forwarder.reset)


def forward_engine_line(log: logging.Logger, line: str, pid: int) -> None:
    """Queue one engine output line for ``log`` (a ``trio_vllm.engine.<rank>`` logger).

    Never blocks: drops the line (counted) when the queue is full.
    """
    level = engine_line_level(line)
    if log.isEnabledFor(level):
        _forwarder.put(log, level, line, pid)


def flush_engine_logs(timeout: float = 5.0) -> bool:
    """Wait (blocking) until every queued engine line was handled; ``False`` on timeout."""
    return _forwarder.flush(timeout)
