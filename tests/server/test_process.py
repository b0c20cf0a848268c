"""``trio-vllm serve`` as a process: SIGTERM drains, engine death exits 1, no orphans."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import anyio
import httpx
import pytest

from _procs import alive, wait_gone
from trio_vllm.reference_engine import MODEL_DIR

from ._util import SERVING, ServeProcess, raw_request, serve_process, sse_events

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path


pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    # The server under test is its own process (trio); the test side needs one loop only.
    return "trio"


class _Server(ServeProcess):
    def engine_pids(self) -> list[int]:
        # Children are listed per thread (engines may be spawned from a worker thread).
        pids: list[int] = []
        for task in os.listdir(f"/proc/{self.process.pid}/task"):
            with open(f"/proc/{self.process.pid}/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        return pids


@asynccontextmanager
async def cli_server(*args: str, env: dict[str, str] | None = None) -> AsyncIterator[_Server]:
    """``trio-vllm serve --port 0 ARGS``, up and listening; stopped at the end if still
    running (SIGTERM, the way it removes what it made, ipc directory included; SIGKILL
    only if it has not exited 30 s later), and its engines checked gone."""
    command = [sys.executable, "-m", "trio_vllm.cli", "serve", "--port", "0", *args]
    engines: list[int] = []
    try:
        async with serve_process(command, _Server, env={**os.environ, **(env or {})}) as server:
            engines = server.engine_pids()
            yield server
    finally:
        with anyio.CancelScope(shield=True):
            for pid in engines:
                await wait_gone(pid, 30)


async def _stream(base_url: str, body: dict[str, object], first: anyio.Event) -> list[object]:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:  # noqa: SIM117
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            data = b""
            async for chunk in response.aiter_bytes():
                data += chunk
                first.set()
            return sse_events(data)


# The server's policies hold on each backend: trio (our h11 server, the default) and
# asyncio (uvicorn with httptools on uvloop, `--backend asyncio`).
BACKENDS = [
    pytest.param([], id="trio-h11"),
    pytest.param(["--backend", "asyncio"], id="asyncio-uvicorn"),
]

_SLOW = ["--engine-args=--step-interval-ms 5"]  # 300 tokens take >= 1.5 s
# 1,500 tokens take >= 30 s: every stream is still open at the SIGKILL, however long a
# loaded machine takes to start all five (nothing waits for them to end).
_SLOWER = ["--engine-args=--step-interval-ms 20"]


async def test_the_startup_heap_is_frozen_before_serving(anyio_backend: str) -> None:
    # As vllm serve's freeze_gc_heap: the collector never walks the startup heap again.
    async with cli_server() as server:
        frozen = re.search(rb"startup heap frozen: (\d+) objects", server.stderr)
        assert frozen is not None, server.stderr.decode(errors="replace")
        assert int(frozen.group(1)) > 10_000  # imports, tokenizer, hypercorn: a real heap
        assert server.stderr.index(frozen.group(0)) < SERVING.search(server.stderr).start()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_sigterm_drains_running_requests_then_exits_0(
    anyio_backend: str, backend: list[str]
) -> None:
    async with cli_server(*backend, *_SLOW, "--shutdown-grace", "30") as server:
        (engine,) = server.engine_pids()
        first = anyio.Event()
        results: list[list[object]] = []

        async def one() -> None:
            results.append(
                await _stream(
                    server.base_url,
                    {"prompt": "abc", "max_tokens": 300, "ignore_eos": True, "stream": True},
                    first,
                )
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(one)
            await first.wait()
            server.process.send_signal(signal.SIGTERM)
            # no new connections once draining (the listener closes at once)
            with anyio.fail_after(30):
                while True:
                    try:
                        await raw_request(server.port, "GET", "/health")
                    except OSError:
                        break
                    await anyio.sleep(0.05)
        (events,) = results
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["text"] for e in events[:-1])  # type: ignore[index]
        assert len(text) == 300
        assert events[-2]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
        with anyio.fail_after(30):
            assert await server.process.wait() == 0
        await wait_gone(engine, 30)
        assert b"SIGTERM" in server.stderr


@pytest.mark.parametrize("backend", BACKENDS)
async def test_sigterm_ends_streams_that_outlive_the_grace(
    anyio_backend: str, backend: list[str]
) -> None:
    # 1,500 tokens take >= 30 s: the stream is open when the 1 s grace ends, on any machine.
    async with cli_server(*backend, *_SLOWER, "--shutdown-grace", "1") as server:
        first = anyio.Event()
        results: list[list[object]] = []

        async def one() -> None:
            results.append(
                await _stream(
                    server.base_url,
                    {"prompt": "abc", "max_tokens": 1500, "ignore_eos": True, "stream": True},
                    first,
                )
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(one)
            await first.wait()
            server.process.send_signal(signal.SIGTERM)
        (events,) = results
        assert events[-1] == "[DONE]"  # a complete SSE stream, not a cut transfer
        error = events[-2]["error"]  # type: ignore[index]
        assert (error["code"], error["type"]) == (503, "ServiceUnavailableError")
        assert "shutdown grace period (1 s)" in error["message"]
        text = "".join(e["choices"][0]["text"] for e in events[:-2])  # type: ignore[index]
        assert 0 < len(text) < 1500
        with anyio.fail_after(30):
            assert await server.process.wait() == 0
        assert b"outlived the shutdown grace period (1 s): ended with an error event" in (
            server.stderr
        )


@pytest.mark.parametrize("backend", BACKENDS)
async def test_engine_death_ends_streams_and_exits_1(
    anyio_backend: str, backend: list[str]
) -> None:
    async with cli_server(*backend, *_SLOWER) as server:
        (engine,) = server.engine_pids()
        started = [anyio.Event() for _ in range(5)]
        results: list[list[object]] = []

        async def one(first: anyio.Event) -> None:
            body = {"prompt": "abc", "max_tokens": 1500, "ignore_eos": True, "stream": True}
            results.append(await _stream(server.base_url, body, first))

        async with anyio.create_task_group() as tg:
            for event in started:
                tg.start_soon(one, event)
            for event in started:
                await event.wait()
            assert not results, "a stream ended before the SIGKILL"
            os.kill(engine, signal.SIGKILL)
        assert len(results) == 5
        for events in results:
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == 503  # type: ignore[index]
        with anyio.fail_after(30):
            assert await server.process.wait() == 1


@pytest.mark.parametrize("backend", BACKENDS)
async def test_keep_serving_on_engine_death(anyio_backend: str, backend: list[str]) -> None:
    async with cli_server(*backend, "--keep-serving-on-engine-death") as server:
        (engine,) = server.engine_pids()
        status, _, _ = await raw_request(server.port, "GET", "/health")
        assert status == 200
        os.kill(engine, signal.SIGKILL)
        with anyio.fail_after(30):
            while (await raw_request(server.port, "GET", "/health"))[0] != 503:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        status, _, data = await raw_request(
            server.port, "POST", "/v1/completions", b'{"prompt": "x"}',
            {"content-type": "application/json"},
        )  # fmt: skip
        assert status == 503
        assert json.loads(data)["error"]["type"] == "ServiceUnavailableError"
        assert server.process.returncode is None
        server.process.send_signal(signal.SIGTERM)
        with anyio.fail_after(30):
            assert await server.process.wait() == 0


async def test_killed_server_leaves_no_engine(anyio_backend: str) -> None:
    # A temporary directory of its own, since a SIGKILLed server leaves its client's ipc
    # directory (the one exit that does): looked at and removed here, not counted as a
    # leak of the run (tests/conftest.py).
    own_tmp = tempfile.mkdtemp(prefix="tv-kill-")
    try:
        async with cli_server(env={"TMPDIR": own_tmp}) as server:
            (engine,) = server.engine_pids()
            assert alive(engine)
            server.process.kill()
            await server.process.wait()
            await wait_gone(engine, 30)  # the engine's --parent-pid watch
        (left,) = os.listdir(own_tmp)
        assert left.startswith("trio-vllm-")
        assert {"handshake", "input", "output"} <= set(os.listdir(os.path.join(own_tmp, left)))
    finally:
        shutil.rmtree(own_tmp)


async def test_api_key_from_the_environment(anyio_backend: str) -> None:
    async with cli_server(env={"VLLM_API_KEY": "from-env"}) as server:
        body = b'{"prompt": "x", "max_tokens": 1}'
        status, _, _ = await raw_request(
            server.port, "POST", "/v1/completions", body, {"content-type": "application/json"}
        )
        assert status == 401
        status, _, _ = await raw_request(
            server.port, "POST", "/v1/completions", body,
            {"content-type": "application/json", "authorization": "Bearer from-env"},
        )  # fmt: skip
        assert status == 200
        server.process.send_signal(signal.SIGTERM)
        with anyio.fail_after(30):
            assert await server.process.wait() == 0


async def test_usage_errors_exit_2(anyio_backend: str) -> None:
    for args in (["--engine", "vllm"], ["--model", "/no/such/dir"], ["--engines", "0"],
                 ["--override-generation-config", "[1]"],
                 ["--connect", "tcp://127.0.0.1:1"]):  # fmt: skip
        done = await anyio.run_process(
            [sys.executable, "-m", "trio_vllm.cli", "serve", *args], check=False
        )
        assert done.returncode == 2, (args, done.stderr)
        assert b"trio-vllm serve: error:" in done.stderr


async def test_generation_config_options(anyio_backend: str, tmp_path: Path) -> None:
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text('{"max_new_tokens": 2, "temperature": 0}')
    args = ["--generation-config", str(folder), "--override-generation-config",
            '{"temperature": 0.5}']  # fmt: skip
    async with cli_server(*args) as server:
        body = b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 9, "n": 2}'
        status, _, data = await raw_request(
            server.port, "POST", "/v1/chat/completions", body,
            {"content-type": "application/json"},
        )  # fmt: skip
        # the directory caps max_tokens; the override's temperature makes n=2 valid
        assert status == 200, data
        assert json.loads(data)["usage"]["completion_tokens"] == 4
        server.process.send_signal(signal.SIGTERM)
        with anyio.fail_after(30):
            assert await server.process.wait() == 0
    done = await anyio.run_process(
        [sys.executable, "-m", "trio_vllm.cli", "serve", "--generation-config",
         str(tmp_path / "missing")], check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert b"generation config directory" in done.stderr


async def test_connect_to_an_engine_started_elsewhere(anyio_backend: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = await anyio.open_process(
        [sys.executable, "-m", "trio_vllm.reference_engine", "--handshake-address",
         f"tcp://127.0.0.1:{port}", "--model", "echo", "--model-dir", MODEL_DIR],
        stdin=None, stdout=None, stderr=None,
    )  # fmt: skip
    try:
        async with cli_server(
            "--connect", f"tcp://127.0.0.1:{port}", "--engines", "1", "--model", MODEL_DIR
        ) as server:
            assert server.engine_pids() == []  # nothing spawned
            status, _, data = await raw_request(
                server.port, "POST", "/v1/completions", b'{"prompt": "far", "max_tokens": 3}',
                {"content-type": "application/json"},
            )  # fmt: skip
            assert status == 200
            assert json.loads(data)["choices"][0]["text"] == "far"
            server.process.send_signal(signal.SIGTERM)
            with anyio.fail_after(30):
                assert await server.process.wait() == 0
    finally:
        with anyio.CancelScope(shield=True):
            if engine.returncode is None:
                engine.kill()
            await engine.wait()


async def _stopped_engine_stream(server: _Server) -> tuple[int, list[object]]:
    """Open a stream, SIGSTOP the engine once it streams; the stream's events."""
    (engine,) = server.engine_pids()
    first = anyio.Event()
    results: list[list[object]] = []

    async def one() -> None:
        body = {"prompt": "abc", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        results.append(await _stream(server.base_url, body, first))

    async with anyio.create_task_group() as tg:
        tg.start_soon(one)
        await first.wait()
        os.kill(engine, signal.SIGSTOP)
    return engine, results[0]


async def test_a_stopped_engine_ends_streams_and_exits_1(anyio_backend: str) -> None:
    """Issue 23 (2): a SIGSTOPped engine (alive, sockets open, silent) is a death."""
    async with cli_server("--engine-hang-timeout", "1", *_SLOWER) as server:
        engine, events = await _stopped_engine_stream(server)
        try:
            assert events[-1] == "[DONE]"
            error = events[-2]["error"]  # type: ignore[index]
            assert error["code"] == 503
            with anyio.fail_after(30):
                assert await server.process.wait() == 1
            assert b"did not answer heartbeats for 1 s" in server.stderr
        finally:
            with contextlib.suppress(ProcessLookupError):  # stopped by the server's exit
                os.kill(engine, signal.SIGCONT)


async def test_a_stopped_engine_makes_health_503_for_good(anyio_backend: str) -> None:
    async with cli_server(
        "--engine-hang-timeout", "1", "--keep-serving-on-engine-death", *_SLOWER
    ) as server:
        engine, events = await _stopped_engine_stream(server)
        try:
            assert events[-2]["error"]["code"] == 503  # type: ignore[index]
            assert (await raw_request(server.port, "GET", "/health"))[0] == 503
        finally:
            os.kill(engine, signal.SIGCONT)
        # Resumed, the engine reconnects and may send again: the death stands.
        await anyio.sleep(1)
        assert (await raw_request(server.port, "GET", "/health"))[0] == 503
        assert server.process.returncode is None
        server.process.send_signal(signal.SIGTERM)
        with anyio.fail_after(30):
            assert await server.process.wait() == 0


async def test_liveness_flags_are_checked(anyio_backend: str) -> None:
    done = await anyio.run_process(
        [sys.executable, "-m", "trio_vllm.cli", "serve", "--engine-stall-timeout", "0.01"],
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert b"--engine-stall-timeout: stall_timeout must be at least 0.1 seconds" in done.stderr
