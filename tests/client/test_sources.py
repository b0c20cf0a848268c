"""Engine sources, socket layouts and protocol profiles."""

from __future__ import annotations

import itertools
import socket
import subprocess
import sys

import anyio
import pytest

from trio_vllm import EngineDeadError, EngineStartupError
from trio_vllm.client import (
    ExternalEngines,
    ReferenceEngines,
    StartupProgress,
    VllmEngines,
    make_request,
    open_client,
)

pytestmark = pytest.mark.anyio


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_elsewhere(address: str, rank: int) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "trio_vllm.reference_engine", "--model", "echo"]
    command += ["--handshake-address", address, "--index", str(rank)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop_elsewhere(engines: list[subprocess.Popen[bytes]]) -> None:
    for p in engines:
        p.kill()
        p.wait()


@pytest.mark.parametrize("version", ["0.25.1", "0.32.0", "0.33.0"])
async def test_profile_follows_the_ready_response(version: str) -> None:
    engines = ReferenceEngines(model="echo", protocol=version)
    async with open_client(engines, ready_timeout=30) as client:
        assert client.vllm_version == version
        assert client.protocol_profile.vllm_version == version
        async with client.generate(make_request([3, 1], max_tokens=5)) as stream:
            assert await stream.collect() == [3, 1, 3, 1, 3]
        assert await client.get_supported_tasks()


async def test_pinned_profile() -> None:
    engines = ReferenceEngines(model="echo", protocol="0.25.1")
    async with open_client(engines, ready_timeout=30, profile="0.25.1") as client:
        assert client.protocol_profile.vllm_version == "0.25.1"
        async with client.generate(make_request([2], max_tokens=3)) as stream:
            assert await stream.collect() == [2, 2, 2]


async def test_tcp_transport_and_progress_reports() -> None:
    progress: list[StartupProgress] = []
    engines = ReferenceEngines(2, model="echo", transport="tcp")
    async with open_client(engines, ready_timeout=30, on_progress=progress.append) as client:
        assert all(a.startswith("tcp://127.0.0.1:") for a in client.addresses.values())
        async with client.generate(make_request([6], max_tokens=2)) as stream:
            assert await stream.collect() == [6, 6]
    assert progress[0].connected == ()
    assert progress[-1].ready == (0, 1)
    assert progress[-1].responded == (0, 1)
    assert progress[-1].expected == (0, 1)
    assert all(b.elapsed >= a.elapsed for a, b in itertools.pairwise(progress))


async def test_external_engines_join_over_tcp() -> None:
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    # Started "elsewhere" before the client exists: ZMQ queues the HELLO until we bind.
    engines = [_start_elsewhere(address, rank) for rank in (3, 4)]
    try:
        source = ExternalEngines(address, 2, start_rank=3)
        async with open_client(source, ready_timeout=30) as client:
            assert client.ranks == [3, 4]
            assert client.engine_pids == {}  # nothing spawned, nothing to stop
            async with client.generate(make_request([9, 8], max_tokens=4)) as stream:
                assert await stream.collect() == [9, 8, 9, 8]
            assert stream.rank in (3, 4)
        # The client does not own external engines: they are still running.
        assert all(p.poll() is None for p in engines)
    finally:
        _stop_elsewhere(engines)


async def test_external_engine_death_is_noticed_by_its_connection() -> None:
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    (engine,) = [_start_elsewhere(address, 0)]
    try:
        async with open_client(ExternalEngines(address), ready_timeout=30) as client:
            async with client.generate(make_request([5], max_tokens=3)) as stream:
                assert await stream.collect() == [5, 5, 5]
            engine.kill()  # no ENGINE_CORE_DEAD, no process we could watch
            with anyio.fail_after(30):
                error = await client.wait_dead()
            assert "lost the connection to an engine" in str(error)
            with pytest.raises(EngineDeadError):
                await client.call_utility("get_supported_tasks")
    finally:
        _stop_elsewhere([engine])


async def test_external_engines_timeout_explains_how_to_start_them() -> None:
    port = _free_port()
    with pytest.raises(EngineStartupError) as info:
        async with open_client(ExternalEngines(f"tcp://127.0.0.1:{port}"), ready_timeout=0.5):
            pytest.fail("nothing should connect")
    message = str(info.value)
    assert "no HELLO yet from rank(s) [0]" in message
    assert f"--data-parallel-rpc-port {port}" in message


async def test_handshake_port_in_use_is_a_startup_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(EngineStartupError, match=f"cannot bind the handshake socket .*{port}"):
            async with open_client(ExternalEngines(f"tcp://127.0.0.1:{port}"), ready_timeout=5):
                pytest.fail("must not start")


def test_external_engines_wildcard_needs_advertise_host() -> None:
    with pytest.raises(ValueError, match="advertise_host"):
        ExternalEngines("tcp://0.0.0.0:29550").layout()
    layout = ExternalEngines("tcp://0.0.0.0:29550", advertise_host="10.0.0.5").layout()
    assert layout.data_host == "10.0.0.5"
    assert layout.data_bind_host == "0.0.0.0"
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        ExternalEngines("ipc:///tmp/x")


def test_vllm_engines_command_line() -> None:
    source = VllmEngines(
        "/models/tiny", python="/opt/vllm/bin/python", extra_args=["--dtype", "float32"]
    )
    cmd = source.command("tcp://127.0.0.1:29555")
    assert cmd[0] == "/opt/vllm/bin/python"
    assert cmd[1].endswith("_vllm_headless.py")
    assert cmd[2:] == [
        "--model", "/models/tiny",
        "--data-parallel-address", "127.0.0.1",
        "--data-parallel-rpc-port", "29555",
        "--dtype", "float32",
    ]  # fmt: skip
    dp = VllmEngines("m", python="p", count=2, start_rank=2).command("tcp://127.0.0.1:1")
    assert dp[dp.index("--data-parallel-size-local") + 1] == "2"
    assert dp[dp.index("--data-parallel-start-rank") + 1] == "2"
    assert source.layout().handshake_bind == "tcp://127.0.0.1:0"


async def test_vllm_engines_without_vllm_fail_startup_clearly() -> None:
    # This python has no vLLM: the launcher exits at once, and the error says so.
    source = VllmEngines("/nonexistent-model", python=sys.executable)
    with pytest.raises(EngineStartupError) as info:
        async with open_client(source, ready_timeout=30):
            pytest.fail("must not start")
    assert "vllm" in str(info.value)
    assert "exited with code 1" in str(info.value)


async def test_missing_python_is_a_startup_error() -> None:
    source = VllmEngines("m", python="/nonexistent/bin/python")
    with pytest.raises(EngineStartupError, match=r"cannot start .*nonexistent"):
        async with open_client(source, ready_timeout=30):
            pytest.fail("must not start")


async def test_tiny_model_with_logprobs() -> None:
    engines = ReferenceEngines(model="tiny", device="cpu")
    async with open_client(engines, ready_timeout=60) as client:
        request = make_request([1, 2, 3, 4], max_tokens=6, logprobs=2)
        with anyio.fail_after(30):
            async with client.generate(request) as stream:
                outputs = [out async for out in stream]
        tokens = [t for out in outputs for t in out.new_token_ids]
        assert len(tokens) == 6
        for out in outputs:
            lp = out.new_logprobs
            assert lp is not None
            assert lp.logprob_token_ids.shape == (len(out.new_token_ids), 3)
            assert list(lp.logprob_token_ids[:, 0]) == list(out.new_token_ids)
