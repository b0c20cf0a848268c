"""Helpers for tests that watch processes through ``/proc`` (Linux): is a pid alive, its
descendants, waiting for one to be gone. Shared by tests/server, tests/client and the
vllm tier (importable as ``_procs``: tests/ is on ``sys.path`` via its conftest)."""

from __future__ import annotations

import os

import anyio


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (its state in ``/proc/PID/stat``, read after
    the last ``)`` so a command name with spaces or parentheses cannot shift it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (children are listed per thread: engines may be
    spawned from a worker thread); processes gone meanwhile are skipped."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(p) for p in f.read().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


async def wait_gone(pid: int, seconds: float) -> None:
    """Poll until ``pid`` is gone; `TimeoutError` after ``seconds`` (anyio's
    ``fail_after``). Polling: another process's exit has no event to wait on."""
    with anyio.fail_after(seconds):
        while alive(pid):  # noqa: ASYNC110 (another process; nothing to wait on)
            await anyio.sleep(0.05)
