"""``trio-vllm serve --api-server-count 2``: two frontend processes on shared engines.

Each server stamps ``x-trio-vllm-server: K`` on its responses, so the test knows which
process answered. Two groups are started (about 6 s each on two idle cores): one for
answers, shares, disconnects, metrics and SIGTERM, one for engine death.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import signal
import sys
import tempfile
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import anyio
import httpx
import pytest
import zmq

from _procs import alive, descendants, wait_gone
from trio_vllm.testing import EngineControl
from trio_vllm.transport import PrivateIpcDir

from ._util import ServeProcess, serve_process, sse_events

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture
def anyio_backend() -> str:
    # The servers under test are processes of their own (trio); one loop here is enough
    # (tests/client/test_shared.py runs the library form on trio and asyncio).
    return "trio"


_HEADER = "x-trio-vllm-server"


class _Group(ServeProcess):
    control: EngineControl | None = None

    def descendants(self) -> list[int]:
        return descendants(self.process.pid)


def _metrics_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "trio-vllm-metrics-*")))


@asynccontextmanager
async def api_servers(*args: str) -> AsyncIterator[_Group]:
    """``trio-vllm serve --api-server-count 2 --port 0 ARGS`` with both servers up; at
    the end: stopped if still running, and every process of the group checked gone."""
    controls = PrivateIpcDir()
    address = controls.endpoint("control")
    command = [
        sys.executable, "-m", "trio_vllm.cli", "serve", "--port", "0",
        "--api-server-count", "2",
        f"--engine-args=--control-address {address} --step-interval-ms 20", *args,
    ]  # fmt: skip
    everything: list[int] = []
    try:
        async with serve_process(
            command, _Group, servers=2, ready_timeout=90, stop_timeout=60
        ) as group:
            everything = group.descendants()
            assert len(everything) == 3  # the engine and two servers
            engine = next(p for p in everything if "reference_engine" in _cmdline(p))
            group.control = EngineControl(
                rank=0, address=address, pid=engine, context=zmq.Context.instance()
            )
            yield group
    finally:
        with anyio.CancelScope(shield=True):
            for pid in everything:
                await wait_gone(pid, 30)
            controls.cleanup()


@asynccontextmanager
async def _resumed(group: _Group) -> AsyncIterator[None]:
    """SIGCONT the engine at the end whatever happened (a stopped engine left behind
    would hold the group's teardown until SIGKILL)."""
    try:
        yield
    finally:
        if group.control is not None and alive(group.control.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(group.control.pid, signal.SIGCONT)


async def _stream_then_leave(port: int) -> str:
    """Open a streaming completion on a fresh connection, read its first event, close
    the connection; returns the answering server's index."""
    body = json.dumps({"prompt": "abc", "max_tokens": 2000, "ignore_eos": True, "stream": True})
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: "
        f"application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    data = b""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send((head + body).encode())
        while b"data: " not in data:
            data += await stream.receive()
    found = re.search(rb"x-trio-vllm-server: (\d+)", data, re.IGNORECASE)
    assert data.startswith(b"HTTP/1.1 200"), data
    assert found is not None, data
    return found.group(1).decode()


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


@pytest.mark.parametrize(
    "backend",
    [pytest.param([], id="trio-h11"), pytest.param(["--backend", "asyncio"], id="asyncio-uvicorn")],
)
async def test_two_servers_answer_share_abort_and_stop_on_sigterm(backend: list[str]) -> None:
    before = _metrics_dirs()
    async with (
        api_servers(*backend) as group,
        httpx.AsyncClient(base_url=group.base_url) as http,
    ):
        assert len(_metrics_dirs() - before) == 1
        # Every request answered correctly; both processes take a share. New
        # connections are spread by the kernel, so ask until each answered (at most 200).
        served: dict[str, int] = {}
        for i in range(200):
            async with httpx.AsyncClient(base_url=group.base_url) as fresh:
                response = await fresh.post(
                    "/v1/completions",
                    json={"prompt": f"q{i} ", "max_tokens": 8, "ignore_eos": True},
                )
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == (f"q{i} " * 8)[:8]
            server = response.headers[_HEADER]
            served[server] = served.get(server, 0) + 1
            if len(served) == 2 and i >= 9:
                break
        assert sorted(served) == ["0", "1"], served

        # A client that leaves a stream, on either server, aborts it at the engine.
        assert group.control is not None
        left: set[str] = set()
        for _ in range(200):
            left.add(await _stream_then_leave(group.port))
            await group.control.wait_idle(within=10)
            if left == {"0", "1"}:
                break
        assert left == {"0", "1"}

        # /metrics, from either server, counts both servers' requests.
        answered = sum(served.values())
        metrics = (await http.get("/metrics")).text
        success = [
            float(line.rpartition(" ")[2])
            for line in metrics.splitlines()
            if line.startswith("vllm:request_success_total{") and '"length"' in line
        ]
        assert success == [answered], metrics

        # SIGTERM stops all of it (api_servers checks every process is gone).
        group.process.send_signal(signal.SIGTERM)
        with anyio.fail_after(60):
            assert await group.process.wait() == 0
    assert _metrics_dirs() - before == set()


@pytest.mark.parametrize("death", ["killed", "stopped"])
async def test_engine_death_ends_streams_in_both_and_exits_1(death: str) -> None:
    # "stopped": a SIGSTOPped engine (alive, silent) is noticed by each server's own
    # heartbeats (attached clients watch their input's connections), each exits 1,
    # the parent exits 1 and its engine stop (SIGTERM + SIGCONT) ends the engine.
    before = _metrics_dirs()
    hang = ["--engine-hang-timeout", "2"] if death == "stopped" else []
    async with api_servers(*hang) as group, _resumed(group):
        assert group.control is not None
        results: dict[str, list[object]] = {}
        streaming: dict[str, anyio.Event] = {"0": anyio.Event(), "1": anyio.Event()}

        async def one(started: anyio.Event) -> None:
            async with (
                httpx.AsyncClient(base_url=group.base_url, timeout=60) as fresh,
                fresh.stream(
                    "POST",
                    "/v1/completions",
                    json={"prompt": "abc", "max_tokens": 2000, "ignore_eos": True, "stream": True},
                ) as response,
            ):
                server = response.headers[_HEADER]
                data = b""
                async for chunk in response.aiter_bytes():
                    data += chunk
                    streaming[server].set()
                    started.set()
                results.setdefault(server, sse_events(data))

        async with anyio.create_task_group() as tg:
            # Streams until each server has one open (the kernel picks the server).
            for _ in range(50):
                started = anyio.Event()
                tg.start_soon(one, started)
                await started.wait()
                if all(e.is_set() for e in streaming.values()):
                    break
            assert all(e.is_set() for e in streaming.values())
            assert not results, "a stream ended before the engine died"
            if death == "killed":
                await group.control.kill()
            else:
                os.kill(group.control.pid, signal.SIGSTOP)
        assert sorted(results) == ["0", "1"]
        for events in results.values():
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == 503  # type: ignore[index]
        with anyio.fail_after(60):
            assert await group.process.wait() == 1
        if death == "stopped":
            stderr = group.stderr.decode(errors="replace")
            # Both servers' verdicts (each on its own input endpoint), not the parent's.
            assert stderr.count("did not answer heartbeats for 2 s") >= 2, stderr
    assert _metrics_dirs() - before == set()


async def test_a_server_that_dies_stops_the_group_with_status_1() -> None:
    before = _metrics_dirs()
    async with api_servers() as group:
        servers = [p for p in group.descendants() if "--api-server-index" in _cmdline(p)]
        assert len(servers) == 2
        os.kill(servers[1], signal.SIGKILL)  # the other one is stopped (api_servers checks)
        with anyio.fail_after(60):
            assert await group.process.wait() == 1
    assert _metrics_dirs() - before == set()
