"""The client shell carrying out the session's rules against real engines (issue 16
items 1, 3 and 4; the raw-interest fix of issue 11). Each failed on 56ccc27."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import zmq

from trio_vllm import EngineDeadError, EngineStartupError
from trio_vllm.client import ExternalEngines, ReferenceEngines, make_request, open_client
from trio_vllm.protocol import session as session_module
from trio_vllm.testing import EngineControl, open_reference_engines
from trio_vllm.transport import PrivateIpcDir

if TYPE_CHECKING:
    from anyio.abc import Process

    from trio_vllm.client import EngineCoreClient

pytestmark = pytest.mark.anyio


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _engine_command(handshake: str, rank: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "trio_vllm.reference_engine", "--handshake-address", handshake,
        "--index", str(rank), "--model", "echo", "--parent-pid", str(os.getpid()), *extra,
    ]  # fmt: skip


def _drain(client: EngineCoreClient) -> None:
    with contextlib.suppress(anyio.WouldBlock):
        while True:
            client.get_output_nowait()


async def test_raw_outputs_are_not_queued_once_the_raw_api_is_unused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_raw_mode`` was set by the first get_output and never reset: from then on every
    batch with scheduler stats was queued, without bound, for a caller that only
    streams."""
    monkeypatch.setattr(session_module, "RAW_INTEREST_S", 0.0)
    async with open_client(ReferenceEngines(model="echo"), ready_timeout=60) as client:
        with anyio.fail_after(30):
            await client.add_request(make_request([3], max_tokens=2, request_id="raw"))
            finished = False
            while not finished:
                batch = await client.get_output()
                finished = any(o.finish_reason is not None for o in batch.outputs)
            _drain(client)
            # Streams only from now on: their batches carry stats; none is queued.
            for i in range(3):
                async with client.generate(make_request([4], max_tokens=20)) as stream:
                    assert await stream.collect() == [4] * 20, i
            await anyio.sleep(0.05)
            with pytest.raises(anyio.WouldBlock):
                client.get_output_nowait()


async def test_retire_rank_fails_a_call_pending_on_the_retired_rank() -> None:
    """16.4: a utility call in flight on a stalled rank was left pending after
    retire_rank stopped the rank's process."""
    async with open_reference_engines(count=2, model="echo", shutdown_grace=0.5) as engines:
        client = engines.client
        await engines.control(1).stall()
        outcome: list[BaseException] = []

        async def call() -> None:
            try:
                await client.call_utility("is_sleeping", rank=1)
            except EngineDeadError as exc:
                outcome.append(exc)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                while client.pending_utility_calls == 0:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
                await client.retire_rank(1)
        assert len(outcome) == 1
        assert outcome[0].rank == 1
        assert "retired" in str(outcome[0])
        assert client.pending_utility_calls == 0
        assert not client.dead
        assert client.live_ranks == [0]


async def test_add_engines_reports_the_clients_death_at_once() -> None:
    """16.3: add_engines waited for its slow engine (here 30 s) although rank 0 died
    one second in."""
    async with open_client(ReferenceEngines(model="echo"), ready_timeout=60) as client:
        slow = ReferenceEngines(model="echo", start_rank=1, faults=["--startup-delay", "30"])
        pid = client.engine_pids[0]

        async def kill_rank_0() -> None:
            await anyio.sleep(0.5)
            os.kill(pid, signal.SIGKILL)

        with anyio.fail_after(20):  # well under the 30 s the slow engine would take
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill_rank_0)
                with pytest.raises(EngineDeadError, match="engine process died"):
                    await client.add_engines(slow)
        assert client.dead
        assert client.ranks == [0]


async def test_a_joins_late_answer_after_it_gave_up_is_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """16.1: an engine that answers after its join timed out made the input guard see a
    ready response "from unexpected identity 0100 (rank 1) after startup" and declare
    the client dead."""
    caplog.set_level(logging.DEBUG, logger="trio_vllm.client")
    first = f"tcp://127.0.0.1:{_free_port()}"
    joining = f"tcp://127.0.0.1:{_free_port()}"
    processes: list[Process] = []

    async def start(*command: str) -> None:
        processes.append(
            await anyio.open_process(
                list(command), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=None
            )
        )

    ipc = PrivateIpcDir(prefix="trio-vllm-test-")
    context: zmq.Context[Any] = zmq.Context()
    try:
        await start(*_engine_command(first, 0))
        async with open_client(ExternalEngines(first, count=1), ready_timeout=60) as client:
            # It gets its init metadata at once, then loads for 3 s: longer than the join waits.
            control_address = ipc.endpoint("control")
            await start(
                *_engine_command(
                    joining, 1, "--startup-delay", "3", "--control-address", control_address
                )
            )
            # Its interpreter is up (the control socket is bound right before HELLO):
            # on a loaded machine its startup alone could outlast the 1.5 s join, and
            # an engine that never got the init metadata never answers late.
            control = EngineControl(
                rank=1, address=control_address, pid=processes[-1].pid, context=context,
                timeout=60,
            )  # fmt: skip
            await control.status()
            with anyio.fail_after(30):
                with pytest.raises(EngineStartupError, match="did not become ready"):
                    await client.add_engines(
                        ExternalEngines(joining, count=1, start_rank=1), ready_timeout=1.5
                    )
                while "dropped a late message from rank 1" not in caplog.text:
                    assert not client.dead, client.dead_error()
                    await anyio.sleep(0.05)
                assert not client.dead
                assert client.ranks == [0]
                async with client.generate(make_request([6], max_tokens=3)) as stream:
                    assert await stream.collect() == [6, 6, 6]
    finally:
        with anyio.CancelScope(shield=True):
            for process in processes:
                if process.returncode is None:
                    process.kill()
                await process.aclose()
        context.destroy(linger=0)
        ipc.cleanup()
