"""Nothing outlives ``open_client``: tasks, threads, fds, sockets, processes, ipc files.

Each exit path (return, exception, cancellation, an engine's death, failed startup,
cancelled startup) is checked against a snapshot taken before the client was opened,
the ipc directories (``trio-vllm-*`` in the temporary directory) included.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import tempfile
import time
from dataclasses import dataclass

import anyio
import pytest
import sniffio

from trio_vllm.client import ExternalEngines, ReferenceEngines, make_request, open_client

from .conftest import FakeEngines, child_pids, open_fds, thread_names

pytestmark = pytest.mark.anyio


_IDLE_TRIO_WORKER = re.compile(r"Trio thread \d+")


def live_tasks() -> int:
    """Tasks alive in the current event loop (trio: walked from the root task)."""
    if sniffio.current_async_library() == "asyncio":
        return len(asyncio.all_tasks())
    import trio

    count = 0
    stack = [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        count += 1
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return count


def ipc_dirs() -> set[str]:
    """The ``trio-vllm-*`` entries of the temporary directory (the run's own, see
    tests/conftest.py: no other run's clients come and go there)."""
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith("trio-vllm-")}


def os_threads() -> int:
    """Threads of this process as the kernel sees them (includes ZeroMQ's I/O threads)."""
    return len(os.listdir("/proc/self/task"))


@dataclass
class Snapshot:
    tasks: int
    threads: set[str]
    os_threads: int
    fds: set[int]
    children: set[int]
    ipc_dirs: set[str]

    @classmethod
    async def take(cls) -> Snapshot:
        # Let finished tasks/threads (asyncio's per-process waitpid threads) wind down:
        # each ends once its child is reaped, which a loaded machine can delay for
        # seconds (up to 10 s here; it breaks out as soon as they are gone).
        for _ in range(500):
            await anyio.sleep(0.02)
            if not any(name.startswith("waitpid") for name in thread_names()):
                break
        # An idle worker of trio's thread cache is named "Trio thread N" (a worker running
        # a job carries the job's name) and lingers up to 10 s for reuse: how many exist
        # depends on how many jobs happened to overlap, so idle ones are a cache, not a leak.
        names = thread_names()
        idle = {name for name in names if _IDLE_TRIO_WORKER.fullmatch(name)}
        return cls(
            live_tasks(),
            names - idle,
            os_threads() - len(idle),
            open_fds(),
            child_pids(),
            ipc_dirs(),
        )

    async def assert_nothing_left(self, pids: list[int], ipc_paths: list[str]) -> None:
        after = await Snapshot.take()
        assert after.tasks == self.tasks, "a task outlived open_client"
        assert after.threads <= self.threads, f"threads left: {after.threads - self.threads}"
        assert after.os_threads <= self.os_threads, "a native thread (ZeroMQ I/O?) is left"
        assert after.fds <= self.fds, f"fds left: {sorted(after.fds - self.fds)}"
        assert after.children <= self.children, f"children left: {after.children}"
        assert after.ipc_dirs <= self.ipc_dirs, f"ipc left: {after.ipc_dirs - self.ipc_dirs}"
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)  # neither running nor a zombie
        for path in ipc_paths:
            assert not _exists(path), f"ipc file left: {path}"
            assert not _exists(os.path.dirname(path)), "ipc directory left"


def _exists(path: str) -> bool:
    return os.path.exists(path)


def _ipc_paths(addresses: dict[str, str]) -> list[str]:
    return [a[len("ipc://") :] for a in addresses.values() if a.startswith("ipc://")]


async def _warm_up() -> None:
    # Import-time and first-use allocations (codec tables, zmq) are not leaks.
    async with (
        open_client(ReferenceEngines(model="echo"), ready_timeout=30) as client,
        client.generate(make_request([1], max_tokens=2)) as stream,
    ):
        await stream.collect()


@pytest.mark.parametrize("how", ["return", "exception", "cancel", "dead-engine"])
async def test_exit_leaves_nothing(how: str) -> None:
    await _warm_up()
    before = await Snapshot.take()
    seen: dict[str, object] = {}

    async def body() -> None:
        async with open_client(ReferenceEngines(2, model="echo"), ready_timeout=30) as client:
            seen["pids"] = list(client.engine_pids.values())
            seen["ipc"] = _ipc_paths(client.addresses)
            assert all(_exists(p) for p in seen["ipc"])  # type: ignore[attr-defined]
            async with client.generate(make_request([1, 2], max_tokens=1000)) as stream:
                await stream.receive()
                if how == "exception":
                    raise LookupError("user code failed")
                if how == "cancel":
                    raise_cancel.cancel()
                    await anyio.sleep(10)
                if how == "dead-engine":
                    os.kill(client.engine_pids[0], signal.SIGKILL)
                    await client.wait_dead()

    with anyio.fail_after(30):
        with anyio.CancelScope() as raise_cancel:
            if how == "exception":
                with pytest.raises(LookupError, match="user code failed"):
                    await body()
            else:
                await body()
    if how == "cancel":
        assert raise_cancel.cancelled_caught
    await before.assert_nothing_left(seen["pids"], seen["ipc"])  # type: ignore[arg-type]


async def test_failed_startup_leaves_nothing() -> None:
    await _warm_up()
    before = await Snapshot.take()
    engines = ReferenceEngines(model="echo", faults=["--crash-on-startup", "boom"])
    with pytest.raises(Exception, match="boom"):
        async with open_client(engines, ready_timeout=30):
            pytest.fail("must not start")
    await before.assert_nothing_left([], [])


async def test_cancelled_startup_leaves_nothing() -> None:
    await _warm_up()
    before = await Snapshot.take()
    engines = ReferenceEngines(2, model="echo", faults=["--startup-delay", "600"])
    start = time.monotonic()
    with anyio.move_on_after(1.0) as scope:
        async with open_client(engines, ready_timeout=900):
            pytest.fail("must not start")
    assert scope.cancelled_caught
    assert time.monotonic() - start < 30  # not the 600 s of the startup delay
    await before.assert_nothing_left([], [])


async def test_engine_ignoring_sigterm_is_killed_after_grace() -> None:
    await _warm_up()
    before = await Snapshot.take()
    async with open_client(FakeEngines("ignore-sigterm"), shutdown_grace=0.5) as client:
        pids = list(client.engine_pids.values())
        start = time.monotonic()
    elapsed = time.monotonic() - start
    assert 0.45 < elapsed < 30, elapsed  # it would never exit without the SIGKILL
    await before.assert_nothing_left(pids, [])


async def test_exception_is_not_wrapped_in_a_group() -> None:
    with pytest.raises(ZeroDivisionError):
        async with open_client(ReferenceEngines(model="echo"), ready_timeout=30):
            1 / 0  # noqa: B018


async def test_external_engines_exit_leaves_nothing() -> None:
    from .test_sources import _free_port, _start_elsewhere, _stop_elsewhere

    await _warm_up()
    address = f"tcp://127.0.0.1:{_free_port()}"
    engine = _start_elsewhere(address, 0)
    try:
        before = await Snapshot.take()
        before.children.add(engine.pid)  # started by the test, not by the client
        async with (
            open_client(ExternalEngines(address), ready_timeout=30) as client,
            client.generate(make_request([3], max_tokens=2)) as stream,
        ):
            assert await stream.collect() == [3, 3]
        await before.assert_nothing_left([], [])
        assert engine.poll() is None  # not ours to stop
    finally:
        _stop_elsewhere([engine])
