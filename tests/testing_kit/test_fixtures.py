"""The plugin's fixtures and run-time fault injection, on anyio (both backends) and
pytest-trio. Public API only: fixtures come through the ``pytest11`` entry point."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio
import pytest
import trio
import trio.testing

from trio_vllm import EngineDeadError, ProtocolError, UtilityCallError
from trio_vllm.client import make_request
from trio_vllm.reference_engine import echo_continuation
from trio_vllm.testing import (
    EngineConfig,
    EngineControl,
    ReferenceEngineSet,
    assert_client_dies,
    assert_engine_idle,
    assert_no_inflight_requests,
)

if TYPE_CHECKING:
    from trio_vllm.client import EngineCoreClient

LONG = ("--max-model-len", "1000000", "--num-gpu-blocks", "1000000")
asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])
trio_only = pytest.mark.parametrize("anyio_backend", ["trio"])


# ---------------------------------------------------------------- anyio plugin


@pytest.mark.anyio
async def test_client_and_control_fixtures(
    engine_client: EngineCoreClient, engine_control: EngineControl
) -> None:
    with anyio.fail_after(30):
        async with engine_client.generate(make_request([3, 1, 4], max_tokens=7)) as stream:
            assert await stream.collect() == echo_continuation([3, 1, 4], 7)
        status = await engine_control.status()
    assert status.pid == engine_control.pid == engine_client.engine_pids[0]
    assert status.steps >= 7
    assert status.requests == 0
    assert not status.stalled
    assert_no_inflight_requests(engine_client)


@pytest.mark.anyio
@pytest.mark.reference_engines(count=2, protocol="0.25.1")
async def test_marker_configures_the_engines(reference_engines: ReferenceEngineSet) -> None:
    client = reference_engines.client
    assert reference_engines.config.count == 2
    assert client.vllm_version == "0.25.1"
    assert reference_engines.ranks == client.ranks == [0, 1]
    with anyio.fail_after(30):
        statuses = await reference_engines.statuses()
    assert [s.pid for s in statuses] == [client.engine_pids[0], client.engine_pids[1]]
    assert reference_engines.control(1).pid == client.engine_pids[1]
    with pytest.raises(ValueError, match="no engine with rank 5"):
        reference_engines.control(5)


@pytest.mark.anyio
@pytest.mark.reference_engines(extra_args=LONG)
async def test_kill_while_streaming(
    engine_client: EngineCoreClient, engine_control: EngineControl
) -> None:
    with anyio.fail_after(30):
        async with engine_client.generate(make_request([1, 2], max_tokens=500_000)) as stream:
            await stream.receive()
            started = time.monotonic()
            await engine_control.kill()
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
    # Within the fail_after: the death comes by itself. How soon measures the machine.
    print(f"stream raised {time.monotonic() - started:.3f} s after the kill command")
    assert engine_client.dead
    assert_no_inflight_requests(engine_client)


@pytest.mark.anyio
@trio_only
@pytest.mark.reference_engines(faults=("--die-after-steps", "3"))
async def test_startup_fault_flags(engine_client: EngineCoreClient) -> None:
    with anyio.fail_after(30):
        async with engine_client.generate(make_request([1, 2], max_tokens=50)) as stream:
            with pytest.raises(EngineDeadError, match="engine process died"):
                await stream.collect()


@pytest.mark.anyio
@asyncio_only
@pytest.mark.reference_engines(extra_args=LONG)
async def test_engine_core_dead_now(reference_engines: ReferenceEngineSet) -> None:
    client = reference_engines.client
    with anyio.fail_after(30):
        async with client.generate(make_request([5, 6], max_tokens=500_000)) as stream:
            await stream.receive()
            await reference_engines.control().send_engine_dead()
            error = await assert_client_dies(client, within=10.0)  # a hang guard
            with pytest.raises(EngineDeadError):
                await stream.collect()
    assert "ENGINE_CORE_DEAD" in str(error)


@pytest.mark.anyio
@asyncio_only
async def test_garbage_frame_now(
    engine_client: EngineCoreClient, engine_control: EngineControl
) -> None:
    with anyio.fail_after(30):
        await engine_control.send_garbage()
        error = await assert_client_dies(engine_client, within=10.0)  # a hang guard
    assert isinstance(error.__cause__, ProtocolError)


@pytest.mark.anyio
@trio_only
async def test_stall_delay_and_failing_utility(
    engine_client: EngineCoreClient, engine_control: EngineControl
) -> None:
    with anyio.fail_after(30):
        await engine_control.stall()
        assert (await engine_control.status()).stalled
        async with engine_client.generate(make_request([7, 8], max_tokens=4)) as stream:
            with anyio.move_on_after(0.3) as waited:
                await stream.receive()
            assert waited.cancelled_caught  # nothing comes out of a stalled engine
            await engine_control.unstall()
            assert await stream.collect() == echo_continuation([7, 8], 4)

        await engine_control.delay_outputs(300)
        started = time.monotonic()
        async with engine_client.generate(make_request([9], max_tokens=1)) as stream:
            assert await stream.collect() == [9]
        assert time.monotonic() - started >= 0.3
        await engine_control.delay_outputs(0)

        await engine_control.fail_utility("get_supported_tasks")
        with pytest.raises(UtilityCallError, match="injected failure"):
            await engine_client.get_supported_tasks()
        await engine_control.unfail_utility("get_supported_tasks")
        assert "generate" in await engine_client.get_supported_tasks()
        with pytest.raises(RuntimeError, match="refused control command"):
            await engine_control.command("no-such-command")
    await assert_engine_idle(engine_control)


# ---------------------------------------------------------------- pytest-trio


@pytest.mark.trio
@pytest.mark.parametrize(
    "reference_engine_config",
    [{"protocol": "0.33.0"}, EngineConfig(count=2, protocol="0.32.0")],
    indirect=True,
    ids=["dict", "config"],
)
async def test_pytest_trio_and_indirect_parametrization(
    reference_engine_config: EngineConfig, reference_engines: ReferenceEngineSet
) -> None:
    client = reference_engines.client
    assert client.vllm_version == reference_engine_config.protocol
    assert len(client.ranks) == reference_engine_config.count
    with trio.fail_after(30):
        async with client.generate(make_request([2, 7], max_tokens=5)) as stream:
            assert await stream.collect() == echo_continuation([2, 7], 5)


@pytest.mark.trio
async def test_pytest_trio_engine_clock(
    engine_clock: trio.testing.MockClock,
    engine_client: EngineCoreClient,
    engine_control: EngineControl,
) -> None:
    assert trio.lowlevel.current_clock() is engine_clock
    real = time.monotonic()
    virtual = trio.current_time()
    await trio.sleep(3600)  # virtual: jumps after 0.25 s of real idleness
    assert trio.current_time() - virtual >= 3600
    assert time.monotonic() - real < 30
    async with engine_client.generate(make_request([4, 4, 2], max_tokens=6)) as stream:
        assert await stream.collect() == echo_continuation([4, 4, 2], 6)
    assert (await engine_control.status()).requests == 0


@pytest.mark.trio
async def test_pytest_trio_kill_by_signal(
    engine_client: EngineCoreClient, engine_control: EngineControl
) -> None:
    engine_control.send_signal()  # SIGKILL
    error = await assert_client_dies(engine_client, within=5.0)
    assert "engine process died" in str(error)
    engine_control.timeout = 0.2
    with pytest.raises(TimeoutError):
        await engine_control.status()
