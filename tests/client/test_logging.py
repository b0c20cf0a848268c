"""The ``trio_vllm.client`` logger: startup steps, readiness, deaths with their cause."""

from __future__ import annotations

import logging
import os
import signal

import anyio
import pytest

from trio_vllm import EngineDeadError
from trio_vllm.client import ReferenceEngines, make_request, open_client

pytestmark = pytest.mark.anyio


async def test_startup_and_death_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trio_vllm.client")
    async with open_client(ReferenceEngines(model="echo"), ready_timeout=60) as client:
        ready = [r for r in caplog.records if r.getMessage().startswith("engines ready")]
        assert len(ready) == 1
        assert ready[0].levelno == logging.INFO
        assert any(r.getMessage().startswith("starting 1 reference engine") for r in caplog.records)
        caplog.clear()
        async with client.generate(make_request([1], max_tokens=4)) as stream:
            await stream.collect()
        assert caplog.records == []  # nothing per request or output at INFO
        os.kill(client.engine_pids[0], signal.SIGKILL)
        with anyio.fail_after(30):
            await client.wait_dead()
        with pytest.raises(EngineDeadError):
            await client.call_utility("is_sleeping")
    dead = [r for r in caplog.records if r.getMessage().startswith("client dead")]
    assert len(dead) == 1
    assert dead[0].levelno == logging.WARNING
    assert "killed by SIGKILL" in dead[0].getMessage()
