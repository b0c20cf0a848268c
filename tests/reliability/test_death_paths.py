"""Issue 16 class (b): a death noticed first through each path, outputs queued before it.

An engine sends its last outputs, then dies. Whichever way the client notices the death
first (its next send fails, the input socket's monitor reports the dropped connection,
the process exit, an ``ENGINE_CORE_DEAD`` frame, a garbage frame), every output that
reached the client's socket before must still be delivered, in order, and only then the
:class:`~trio_vllm.EngineDeadError` raised (docs/client.md, docs/reliability.md).

The engine is a scripted peer (``_scripted.py``) that queues its outputs without a
checkpoint and then blocks the event loop while ZeroMQ moves them, so they are all in the
client's queue, unread, when the death becomes observable: the client's loop was "busy"
(issue 16 item 2: an engine flushed 49 outputs and exited; the next ``call_utility`` or
``generate`` failed to send and the client died without reading them). 1,000 outputs
need four receive batches, so a death path that does not drain first loses some on
every run, not only on unlucky ones.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from trio_vllm import EngineDeadError, ExternalEngines, make_request
from trio_vllm.protocol.codec import ENGINE_CORE_DEAD

from ._scripted import (
    ExternalAddress,
    ScriptedPeer,
    ScriptedSource,
    free_tcp_port,
    kill,
    scripted_client,
)

if TYPE_CHECKING:
    from trio_vllm import EngineCoreClient

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

QUEUED = 1000


async def _consume_stream(stream: Any) -> tuple[list[int], BaseException | None]:
    tokens: list[int] = []
    try:
        async for output in stream:
            tokens.extend(output.new_token_ids)
    except EngineDeadError as exc:
        return tokens, exc
    return tokens, None


async def _consume_raw(client: EngineCoreClient) -> tuple[list[int], BaseException | None]:
    tokens: list[int] = []
    try:
        while True:
            batch = await client.get_output()
            for output in batch.outputs:
                tokens.extend(output.new_token_ids)
    except EngineDeadError as exc:
        return tokens, exc


async def _trigger_send(client: EngineCoreClient, how: str) -> None:
    """The client's next send after the engine left: it must fail as a death."""
    request = make_request([1], max_tokens=2, request_id="next")
    if how == "call_utility":
        with pytest.raises(EngineDeadError):
            await client.call_utility("echo", 1)
    elif how == "generate":
        with pytest.raises(EngineDeadError):
            await client.generate(request).__aenter__()
    else:
        with pytest.raises(EngineDeadError):
            await client.add_request(request)


async def _run(
    client: EngineCoreClient,
    peer: ScriptedPeer,
    consumer: str,
    die: Any,
    *,
    queued: int = QUEUED,
) -> None:
    """Start a request, let the peer queue ``queued`` outputs for it, ``die()``, then
    consume: every queued token first, then EngineDeadError."""
    request = make_request([7, 8], max_tokens=5000, request_id="victim")
    with anyio.fail_after(30):
        if consumer == "stream":
            async with client.generate(request, max_pending=4096) as stream:
                await peer.wait_for(1)
                peer.queue_outputs(peer.token_outputs("victim", queued))
                await die()
                tokens, error = await _consume_stream(stream)
        else:
            await client.add_request(request)
            await peer.wait_for(1)
            peer.queue_outputs(peer.token_outputs("victim", queued))
            await die()
            tokens, error = await _consume_raw(client)
    assert len(tokens) == queued, f"{len(tokens)} of {queued} queued tokens delivered"
    assert tokens == [i % 256 for i in range(queued)]
    assert isinstance(error, EngineDeadError)
    assert client.dead


@pytest.mark.parametrize("trigger", ["call_utility", "generate", "add_request"])
@pytest.mark.parametrize("consumer", ["stream", "raw"])
async def test_send_failure_first(consumer: str, trigger: str) -> None:
    """Issue 16 item 2: the engine left; the client's next send notices it first."""
    peer = ScriptedPeer()
    async with scripted_client([peer], ScriptedSource()) as client:

        async def die() -> None:
            peer.close_input()
            # Blocking again: the client's I/O thread sees the dropped connection while
            # no task of the client runs, so the send below is the first to notice.
            time.sleep(0.2)  # noqa: ASYNC251 - blocking the loop is the point
            await _trigger_send(client, trigger)

        await _run(client, peer, consumer, die)


@pytest.mark.parametrize("consumer", ["stream", "raw"])
async def test_socket_monitor_first(consumer: str) -> None:
    """An external engine's connection drops; the input socket's monitor notices first."""
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    peer = ScriptedPeer()
    async with scripted_client(
        [peer], ExternalEngines(address), address=ExternalAddress(address)
    ) as client:

        async def die() -> None:
            peer.close_input()
            # Blocking again: the disconnect event is queued on the monitor socket
            # beside the outputs before either task of the client runs.
            time.sleep(0.2)  # noqa: ASYNC251 - blocking the loop is the point
            await client.wait_dead()

        await _run(client, peer, consumer, die)


@pytest.mark.parametrize("consumer", ["stream", "raw"])
async def test_process_exit_first(consumer: str) -> None:
    """The engine process exits (SIGKILL); the process watcher notices first."""
    peer = ScriptedPeer()
    source = ScriptedSource(processes=True)
    async with scripted_client([peer], source) as client:

        async def die() -> None:
            kill(source.processes[0])
            await client.wait_dead()

        # 49 (the count): the exit path drains for at most 30 ms, a bound a
        # 2-core machine under load can miss for 1,000 outputs.
        await _run(client, peer, consumer, die, queued=49)


@pytest.mark.parametrize("consumer", ["stream", "raw"])
async def test_engine_core_dead_first(consumer: str) -> None:
    """``ENGINE_CORE_DEAD`` after the outputs, on the same socket."""
    peer = ScriptedPeer()
    async with scripted_client([peer], ScriptedSource()) as client:

        async def die() -> None:
            peer.queue_outputs([[ENGINE_CORE_DEAD]], settle=0.05)

        await _run(client, peer, consumer, die)


@pytest.mark.parametrize("consumer", ["stream", "raw"])
async def test_garbage_first(consumer: str) -> None:
    """An undecodable frame after the outputs, on the same socket."""
    peer = ScriptedPeer()
    async with scripted_client([peer], ScriptedSource()) as client:

        async def die() -> None:
            peer.queue_outputs([[b"\xc1 not msgpack"]], settle=0.05)

        await _run(client, peer, consumer, die)
