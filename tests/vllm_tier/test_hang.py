"""Issue 23 (2) against stock vLLM: a SIGSTOPped engine (launcher, engine core and
worker stopped, sockets open, silent) is declared dead by the heartbeats, through
`SyncClient` (the client's loop in its own thread, trio and asyncio), and a resumed one
stays dead. Normal generation with the same ``hang_timeout`` comes first: a stock
engine's steps (and the machine freezing 1-4 s while it streams) do not trip it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from trio_vllm import EngineDeadError
from trio_vllm.client import VllmEngines, make_request
from trio_vllm.sync import SyncClient

from .conftest import ENGINE_ARGS, ENGINE_ENV, EXPECTED_GREEDY, TINY_MODEL, vllm_python

pytestmark = pytest.mark.timeout(600)

HANG = 5.0


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_a_stopped_stock_engine_is_declared_dead(backend: str) -> None:
    engines = VllmEngines(
        str(TINY_MODEL), python=vllm_python(), extra_args=ENGINE_ARGS, env=ENGINE_ENV
    )
    with SyncClient(engines, backend=backend, ready_timeout=500, hang_timeout=HANG) as client:
        (launcher,) = client.engine_pids.values()
        request = make_request([1, 5, 7, 9], max_tokens=8, request_id="greedy")
        tokens = [t for out in client.generate(request) for t in out.new_token_ids]
        assert tokens == EXPECTED_GREEDY
        assert not client.dead
        long = make_request([1, 5, 7, 9], max_tokens=200, ignore_eos=True, request_id="long")
        stopped = 0.0
        try:
            with pytest.raises(EngineDeadError) as caught:  # noqa: PT012
                for _ in client.generate(long):
                    if not stopped:
                        os.killpg(launcher, signal.SIGSTOP)
                        stopped = time.monotonic()
            took = time.monotonic() - stopped
            print(f"stock engine SIGSTOP -> EngineDeadError: {took:.2f} s (hang {HANG:g} s)")
            assert "did not answer heartbeats for 5 s" in str(caught.value)
            assert caught.value.rank == 0
            assert took < HANG + 30  # a hang guard; the figure is printed
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher, signal.SIGCONT)
        time.sleep(2)  # resumed: it reconnects and may send; the death stands
        assert client.dead
        with pytest.raises(EngineDeadError, match="did not answer heartbeats"):
            client.call_utility("is_sleeping")
