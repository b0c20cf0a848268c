"""``VllmEngines`` end to end without vLLM: the bundled headless entry point runs with a
stand-in ``vllm`` package (``fake_vllm/``) whose ``run_headless`` starts reference
engines on the TCP handshake address, as ``vllm serve --headless`` would.

This checks what the real tier (``tests/vllm_tier``, needs a python with vLLM) cannot check
everywhere: the command line, the entry point, the TCP handshake of a launcher hosting
several ranks, stopping the launcher's whole process tree, and the orphan watch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import anyio
import pytest

from _procs import alive, descendants
from trio_vllm.client import VllmEngines, make_request, open_client

from .conftest import child_pids

pytestmark = pytest.mark.anyio

FAKE_VLLM = str(Path(__file__).with_name("fake_vllm"))
ENV = {"PYTHONPATH": os.pathsep.join(p for p in (FAKE_VLLM, os.environ.get("PYTHONPATH")) if p)}


async def test_vllm_engines_with_a_stand_in_vllm() -> None:
    source = VllmEngines("some-model", python=sys.executable, env=ENV, count=2)
    async with open_client(source, ready_timeout=30) as client:
        assert client.ranks == [0, 1]
        launcher = client.engine_pids[0]
        assert client.engine_pids == {0: launcher, 1: launcher}  # one launcher, two ranks
        assert client.addresses["handshake"].startswith("tcp://127.0.0.1:")
        engines = descendants(launcher)
        assert len(engines) == 2
        async with client.generate(make_request([7, 8], max_tokens=4)) as stream:
            assert await stream.collect() == [7, 8, 7, 8]
        assert await client.call_utility_all("get_supported_tasks")
    # The launcher and the engines it started are gone (SIGTERM, then the group).
    with anyio.fail_after(30):
        while any(alive(pid) for pid in (launcher, *engines)):  # noqa: ASYNC110
            await anyio.sleep(0.05)
    assert launcher not in child_pids()


def _start_orphan_launcher(port: int) -> tuple[subprocess.Popen[bytes], int]:
    """A shell starts the entry point in the background, prints its pid and waits."""
    entry = Path(__file__).parents[2] / "src" / "trio_vllm" / "client" / "_vllm_headless.py"
    command = (
        f"{sys.executable} {entry} --model m --data-parallel-address 127.0.0.1 "
        f"--data-parallel-rpc-port {port} >/dev/null 2>&1 & echo $!; sleep 60"
    )
    shell = subprocess.Popen(
        ["sh", "-c", command], stdout=subprocess.PIPE, env={**os.environ, **ENV}
    )
    assert shell.stdout is not None
    return shell, int(shell.stdout.readline())


def _kill(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.wait()
    if process.stdout is not None:
        process.stdout.close()


async def test_entry_point_stops_when_its_parent_dies() -> None:
    # Nobody listens on the handshake port: the engine just waits for a frontend.
    shell, launcher = _start_orphan_launcher(1)
    try:
        engines: list[int] = []
        with anyio.fail_after(30):
            while not engines:
                await anyio.sleep(0.05)
                engines = descendants(launcher)
        assert alive(launcher)
    finally:
        _kill(shell)  # the client dies without stopping its engines
    start = time.monotonic()
    with anyio.fail_after(30):
        while any(alive(pid) for pid in (launcher, *engines)):  # noqa: ASYNC110
            await anyio.sleep(0.05)
    print(f"orphaned launcher stopped itself after {time.monotonic() - start:.2f} s")


async def test_stop_leaves_no_shared_memory_of_killed_engine_cores() -> None:
    """Stock vLLM SIGKILLs its engine cores on a requested shutdown, so only the
    launcher's resource tracker unlinks their shared memory; with the launcher's slow
    interpreter teardown it used to outlast the grace, and the group's SIGKILL took
    the tracker along, leaving the segment (see ``fake_vllm`` for ``--fake-shm``)."""
    name = f"trio_vllm_test_{uuid.uuid4().hex[:12]}"
    path = Path("/dev/shm") / name
    source = VllmEngines("m", python=sys.executable, extra_args=["--fake-shm", name], env=ENV)
    try:
        async with open_client(source, ready_timeout=30, shutdown_grace=60) as client:
            launcher = client.engine_pids[0]
            with anyio.fail_after(30):
                while not path.exists():  # noqa: ASYNC110 - a file, nothing to wait on
                    await anyio.sleep(0.05)
            async with client.generate(make_request([7, 8], max_tokens=2)) as stream:
                assert await stream.collect() == [7, 8]
            start = time.monotonic()
        elapsed = time.monotonic() - start
        assert not alive(launcher)
        assert not path.exists(), "the killed engine core's segment was left behind"
        # The launcher exited after the cleanup, not at the end of the 60 s grace.
        assert elapsed < 30, elapsed
    finally:
        if path.exists():
            path.unlink()
