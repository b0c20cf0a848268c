"""Helpers for the client tests: engine sources and leak checks."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from trio_vllm.client import ReferenceEngines

FAKE_ENGINE = str(Path(__file__).with_name("_fake_engine.py"))


class FakeEngines(ReferenceEngines):
    """The scripted engine of ``_fake_engine.py`` (protocol-violation faults)."""

    def __init__(self, fault: str = "", n: int = 0, count: int = 1) -> None:
        super().__init__(count)
        self.fault = fault
        self.n = n

    def command(self, handshake_address: str, rank: int) -> list[str]:
        return [sys.executable, FAKE_ENGINE, handshake_address, str(rank), self.fault, str(self.n)]

    def describe(self) -> str:
        return f"fake engine ({self.fault or 'no fault'})"


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def child_pids() -> set[int]:
    """Direct children of this process (running or zombie)."""
    pids: set[int] = set()
    me = os.getpid()
    for task in os.listdir(f"/proc/{me}/task"):
        try:
            text = Path(f"/proc/{me}/task/{task}/children").read_text()
        except OSError:
            continue
        pids.update(int(p) for p in text.split())
    return pids


def thread_names() -> set[str]:
    return {t.name for t in threading.enumerate()}
