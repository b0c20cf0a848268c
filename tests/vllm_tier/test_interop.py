"""trio-vllm against stock vLLM 0.32.0 engine cores (spawned headless with VllmEngines).

One engine per backend serves the whole module (a stock engine takes ~50 s to start on
2 cores): the module-scoped fixture is a :class:`~trio_vllm.SyncClient` running the
client on trio, then on asyncio, in its own thread, and the async API is exercised
through its portal. The tests run in file order per backend; the last one kills the
engine.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import pytest

from trio_vllm import EngineDeadError, EngineStartupError, UtilityCallError
from trio_vllm.client import VllmEngines, make_request
from trio_vllm.sync import SyncClient

from .conftest import ENGINE_ARGS, ENGINE_ENV, EXPECTED_GREEDY, TINY_MODEL, vllm_python

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def client(request: pytest.FixtureRequest) -> Iterator[SyncClient]:
    """One engine per event-loop backend; pytest runs each backend's tests in a group."""
    engines = VllmEngines(
        str(TINY_MODEL), python=vllm_python(), extra_args=ENGINE_ARGS, env=ENGINE_ENV
    )
    with SyncClient(engines, backend=request.param, ready_timeout=500) as sync_client:
        yield sync_client


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            text = Path(f"/proc/{pid}/task/{task}/children").read_text()
        except OSError:
            continue
        found.extend(int(p) for p in text.split())
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_handshake_facts(client: SyncClient) -> None:
    assert client.vllm_version == "0.32.0"
    assert client.ranks == [0]
    assert client.max_model_len == 256
    (ready,) = client.ready_responses.values()
    assert ready["data_parallel_rank"] == 0


def test_greedy_tokens_match_vllms_frontend(client: SyncClient) -> None:
    stream = client.generate(make_request([1, 5, 7, 9], max_tokens=8, temperature=0.0))
    outputs = list(stream)
    assert [t for o in outputs for t in o.new_token_ids] == EXPECTED_GREEDY
    assert str(outputs[-1].finish_reason) == "length"
    assert all(o.finish_reason is None for o in outputs[:-1])

    # The same through the async API (in the facade's thread, on its backend).
    async def with_async_api() -> list[int]:
        request = make_request([1, 5, 7, 9], max_tokens=8, temperature=0.0)
        with anyio.fail_after(60):
            async with client.async_client.generate(request) as s:
                return await s.collect()

    assert client.portal.call(with_async_api) == EXPECTED_GREEDY


def test_raw_api_and_concurrent_requests(client: SyncClient) -> None:
    requests = [make_request([1, 5, 7, 9], max_tokens=8) for _ in range(3)]
    for request in requests:
        client.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finished: set[str] = set()
    deadline = time.monotonic() + 60
    while len(finished) < len(requests):
        assert time.monotonic() < deadline
        for out in client.get_output(timeout=30).outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished.add(out.request_id)
    assert all(t == EXPECTED_GREEDY for t in tokens.values())
    assert client.live_requests == []


def test_abort_mid_stream(client: SyncClient) -> None:
    long_request = make_request([1, 5, 7, 9], max_tokens=240)
    stream = client.generate(long_request)
    first = [next(stream), next(stream)]
    assert [t for o in first for t in o.new_token_ids] == EXPECTED_GREEDY[:2]
    stream.close()  # sends ABORT
    assert stream.aborted
    assert client.live_requests == []
    # The engine dropped it: a request sent after the abort runs alone (scheduler stats),
    # and no output of the aborted request reaches the raw queue.
    probe = make_request([1, 5, 7, 9], max_tokens=8)
    client.add_request(probe)
    running: list[int] = []
    done = False
    while not done:
        batch = client.get_output(timeout=30)
        if batch.scheduler_stats is not None:
            running.append(batch.scheduler_stats.num_running_reqs)
        for out in batch.outputs:
            assert out.request_id == probe.request_id
            done = out.finish_reason is not None
    assert running, "the engine sent no scheduler stats"
    assert max(running) == 1, f"the aborted request still runs: {running}"
    # Its id is free again.
    again = client.generate(
        make_request([1, 5, 7, 9], max_tokens=2, request_id=long_request.request_id)
    )
    assert again.collect() == EXPECTED_GREEDY[:2]


def test_break_out_of_async_stream_aborts(client: SyncClient) -> None:
    async def scenario() -> tuple[bool, list[str]]:
        request = make_request([1, 5, 7, 9], max_tokens=240)
        with anyio.fail_after(60):
            async with client.async_client.generate(request) as s:
                async for _ in s:
                    break
        return s.aborted, client.async_client.live_requests

    assert client.portal.call(scenario) == (True, [])


def test_utilities(client: SyncClient) -> None:
    assert client.get_supported_tasks() == ("generate",)
    assert client.is_sleeping() is False
    assert client.reset_prefix_cache() is True
    client.set_weight_version("interop-1")
    assert client.get_weight_version() == "interop-1"
    assert client.is_scheduler_paused() is False
    client.pause_scheduler("abort", False)
    assert client.is_scheduler_paused() is True
    client.resume_scheduler()
    assert client.is_scheduler_paused() is False
    assert client.call_utility_all("is_sleeping") == [False]
    with pytest.raises(UtilityCallError, match="no_such_method"):
        client.call_utility("no_such_method")
    # Still generating correctly after the utilities.
    assert (
        client.generate(make_request([1, 5, 7, 9], max_tokens=4)).collect() == (EXPECTED_GREEDY[:4])
    )


def test_killing_the_engine_core_raises_engine_dead(client: SyncClient) -> None:
    """Runs last: SIGKILL the EngineCore process (the headless launcher's child) mid-stream.

    The engine core is not our child: our launcher script notices its death (its
    sentinel), SIGTERMs the other cores and exits at once, and the client sees that
    exit. The stock launcher would first shut down and tear down its interpreter
    (7-38 s measured); the bound here is the launcher's reaction plus process exit.
    """
    (launcher,) = client.engine_pids.values()
    cores = [pid for pid in _children(launcher) if "EngineCore" in _cmdline(pid)]
    assert len(cores) == 1, f"expected one EngineCore child of the launcher: {cores}"
    stream = client.generate(make_request([1, 5, 7, 9], max_tokens=240))
    next(stream)
    os.kill(cores[0], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(EngineDeadError) as info:
        for _ in stream:
            pass
    elapsed = time.monotonic() - started
    print(f"EngineDeadError {elapsed:.2f} s after SIGKILL of the engine core: {info.value}")
    assert elapsed < 5, elapsed
    assert f"(pid {cores[0]}) exited with code -9" in str(info.value)
    assert "launcher" in str(info.value)
    with pytest.raises(EngineDeadError):
        client.get_supported_tasks()
    assert client.dead


def test_startup_failure_reports_the_engine_output() -> None:
    engines = VllmEngines(
        "/nonexistent/model-dir", python=vllm_python(), extra_args=ENGINE_ARGS, env=ENGINE_ENV
    )
    with pytest.raises(EngineStartupError) as info, SyncClient(engines, ready_timeout=300):
        pytest.fail("must not start")
    assert "nonexistent" in str(info.value)
