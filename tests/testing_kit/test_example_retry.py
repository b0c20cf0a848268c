"""docs/testing.md, example 2: a retry policy against an engine that dies.

The policy reconnects to fresh engines when the engine dies (an EngineDeadError makes
the whole client unusable, so retrying means opening a new one) and backs off
exponentially between attempts. Public API only.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import anyio
import pytest
import trio

from trio_vllm import EngineDeadError
from trio_vllm.client import make_request
from trio_vllm.reference_engine import echo_continuation
from trio_vllm.testing import (
    EngineConfig,
    ReferenceEngineSet,
    engine_mock_clock,
    open_reference_engines,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence
    from contextlib import AbstractAsyncContextManager

    from trio_vllm.client import EngineCoreClient

# ---------------------------------------------------------------- the code under test


async def generate_with_retry(
    connect: Callable[[], AbstractAsyncContextManager[EngineCoreClient]],
    prompt: Sequence[int],
    *,
    max_tokens: int,
    attempts: int = 3,
    backoff: float = 1.0,
) -> list[int]:
    """The whole completion of ``prompt``; on engine death reconnect and start over."""
    delay = backoff
    for attempt in range(1, attempts + 1):
        try:
            async with connect() as client:
                request = make_request(prompt, max_tokens=max_tokens)
                async with client.generate(request) as stream:
                    return await stream.collect()
        except EngineDeadError:
            if attempt == attempts:
                raise
        await anyio.sleep(delay)
        delay *= 2
    raise AssertionError("unreachable")


# ---------------------------------------------------------------- the tests


class Engines:
    """A ``connect`` for the policy: each call starts fresh reference engines."""

    def __init__(self, *configs: EngineConfig) -> None:
        self.configs = list(configs)
        self.opened: list[ReferenceEngineSet] = []
        self.first_opened = anyio.Event()

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[EngineCoreClient]:
        config = self.configs[min(len(self.opened), len(self.configs) - 1)]
        async with open_reference_engines(config) as engines:
            self.opened.append(engines)
            self.first_opened.set()
            yield engines.client


@pytest.mark.anyio
async def test_retry_after_the_engine_dies_mid_stream() -> None:
    # The first engine dies after three steps (a fault fixed at startup).
    engines = Engines(EngineConfig(faults=("--die-after-steps", "3")), EngineConfig())
    with anyio.fail_after(30):
        tokens = await generate_with_retry(engines.connect, [1, 2, 3], max_tokens=10, backoff=0.01)
    assert tokens == echo_continuation([1, 2, 3], 10)
    assert len(engines.opened) == 2


@pytest.mark.anyio
async def test_retry_when_killed_at_run_time() -> None:
    # The first engine hangs after three steps; a second task notices through the
    # control socket and kills it, as a supervisor would (a run-time fault).
    engines = Engines(EngineConfig(faults=("--stall-after-steps", "3")), EngineConfig())

    async def kill_first_engine_when_hung() -> None:
        await engines.first_opened.wait()
        control = engines.opened[0].control()
        while not (await control.status()).stalled:  # noqa: ASYNC110 - another process
            await anyio.sleep(0.005)
        await control.kill()

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_first_engine_when_hung)
            tokens = await generate_with_retry(engines.connect, [4, 5], max_tokens=8, backoff=0.01)
    assert tokens == echo_continuation([4, 5], 8)
    assert len(engines.opened) == 2


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_gives_up_after_the_last_attempt() -> None:
    engines = Engines(EngineConfig(faults=("--dead-after-steps", "1")))
    with anyio.fail_after(30), pytest.raises(EngineDeadError, match="ENGINE_CORE_DEAD"):
        await generate_with_retry(engines.connect, [6], max_tokens=5, attempts=2, backoff=0.01)
    assert len(engines.opened) == 2


@pytest.mark.trio
async def test_backoff_in_virtual_time(engine_clock: trio.testing.MockClock) -> None:
    # Back-off of 60 s then 120 s: virtual under the mock clock, so the test takes
    # about a second of real time; engine startup and shutdown still run in real time.
    engines = Engines(
        EngineConfig(faults=("--die-after-steps", "1")),
        EngineConfig(faults=("--die-after-steps", "1")),
        EngineConfig(),
    )
    virtual, real = trio.current_time(), time.monotonic()
    tokens = await generate_with_retry(engines.connect, [8, 9], max_tokens=4, backoff=60.0)
    assert tokens == echo_continuation([8, 9], 4)
    assert len(engines.opened) == 3
    assert trio.current_time() - virtual >= 180.0
    assert time.monotonic() - real < 60.0


@pytest.mark.anyio
@pytest.mark.parametrize(
    "anyio_backend", [pytest.param(("trio", {"clock": engine_mock_clock()}), id="trio-mock-clock")]
)
async def test_backoff_in_virtual_time_with_anyio() -> None:
    # The same with anyio's plugin: the clock goes in through the backend options.
    engines = Engines(EngineConfig(faults=("--die-after-steps", "1")), EngineConfig())
    virtual, real = trio.current_time(), time.monotonic()
    tokens = await generate_with_retry(engines.connect, [3], max_tokens=2, backoff=90.0)
    assert tokens == [3, 3]
    assert trio.current_time() - virtual >= 90.0
    assert time.monotonic() - real < 60.0
