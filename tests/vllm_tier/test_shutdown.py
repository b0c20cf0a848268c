"""Stopping a stock vLLM engine we spawned leaves none of its shared memory behind.

vLLM's CPU engine core and its worker each create a ``/dev/shm/psm_*`` ring buffer
(the executor's broadcast queue, the worker's response queue). On a requested shutdown
vLLM SIGKILLs them at once, so the launcher's multiprocessing resource tracker is what
unlinks the segments, and it can only do so once the launcher has let go of it. The
stock launcher lets go at the end of its interpreter teardown, which on a loaded
machine outlasted the client's grace period; the SIGKILL of the process group then
took the tracker along.

The test makes that teardown slow on purpose (a ``sitecustomize`` atexit handler in the
launcher sleeps past the grace), so the outcome does not hang on the machine's load:
without the fix the segments are always left. It finds the segments the engine's
processes map while serving, so segments of other engines on the machine do not count,
and removes any it leaves.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from trio_vllm.client import VllmEngines, make_request
from trio_vllm.sync import SyncClient

from .conftest import ENGINE_ARGS, ENGINE_ENV, EXPECTED_GREEDY, TINY_MODEL, vllm_python

pytestmark = pytest.mark.timeout(600)

GRACE_S = 30.0
# The launcher only (not its engine cores, workers or resource tracker).
_SLOW_TEARDOWN = f"""\
import atexit, sys, time
if sys.argv and sys.argv[0].endswith("_vllm_headless.py"):
    atexit.register(time.sleep, {GRACE_S * 3})
"""


def _group_members(pgid: int) -> list[int]:
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":  # an unreaped orphan is gone
            members.append(int(name))
    return members


def _mapped_segments(pids: list[int]) -> set[str]:
    """The ``/dev/shm/psm_*`` files that any of ``pids`` has mapped."""
    found = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/psm_"):
                found.add(fields[5].split()[0].removeprefix("/dev/shm/"))
    return found


def _existing(names: set[str]) -> list[str]:
    return sorted(name for name in names if os.path.exists(f"/dev/shm/{name}"))


def test_stop_after_serving_leaves_no_shared_memory(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(_SLOW_TEARDOWN)
    engines = VllmEngines(
        str(TINY_MODEL),
        python=vllm_python(),
        extra_args=ENGINE_ARGS,
        env={**ENGINE_ENV, "PYTHONPATH": str(tmp_path)},
    )
    segments: set[str] = set()
    try:
        with SyncClient(engines, ready_timeout=500, shutdown_grace=GRACE_S) as client:
            stream = client.generate(make_request([1, 5, 7, 9], max_tokens=8, temperature=0.0))
            assert [t for o in stream for t in o.new_token_ids] == EXPECTED_GREEDY
            (launcher,) = client.engine_pids.values()
            segments = _mapped_segments(_group_members(launcher))
            # The executor's broadcast queue and the worker's response queue.
            assert len(segments) >= 2, segments
            assert _existing(segments) == sorted(segments)
            stop_started = time.monotonic()
        stop_s = time.monotonic() - stop_started
        print(f"stopped in {stop_s:.2f} s; segments {sorted(segments)}")
        assert _existing(segments) == [], "shared memory left in /dev/shm"
        assert _group_members(launcher) == []
        # The launcher exited once the cleanup was done, not killed after the grace.
        assert stop_s < GRACE_S, stop_s
    finally:
        for name in _existing(segments):
            os.unlink(f"/dev/shm/{name}")
