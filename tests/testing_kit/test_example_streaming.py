"""docs/testing.md, example 1: a streaming handler, client disconnects, and the harness.

Uses only the public API, as a user's project would: the fixtures come from the
``trio_vllm`` pytest plugin (entry point), the helpers from ``trio_vllm.testing``.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import anyio
import pytest

from trio_vllm.client import make_request
from trio_vllm.testing import (
    ReferenceEngineSet,
    assert_engine_idle,
    assert_no_inflight_requests,
    check_cancellation,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from anyio.abc import ObjectReceiveStream, ObjectSendStream

    from trio_vllm.client import EngineCoreClient

pytestmark = pytest.mark.anyio

# A context so long that a request nobody aborts keeps the engine busy for minutes.
LONG = ("--max-model-len", "1000000", "--num-gpu-blocks", "1000000")


# ---------------------------------------------------------------- the code under test


def parse(line: str) -> tuple[int, list[int]]:
    """``"GENERATE <max_tokens> <token> <token> ..."`` -> (max_tokens, prompt)."""
    verb, max_tokens, *prompt = line.split()
    if verb != "GENERATE" or not prompt:
        raise ValueError(f"bad request line {line!r}")
    return int(max_tokens), [int(t) for t in prompt]


class Session:
    """One client connection of a small server-sent-events style endpoint.

    ``handle`` streams one ``data:`` line per engine step to ``send``. If the client
    disconnects, ``send`` raises and leaving the ``async with`` aborts the request.
    """

    def __init__(self, client: EngineCoreClient, send: ObjectSendStream[str]) -> None:
        self.client = client
        self.send = send

    async def handle(self, line: str) -> None:
        max_tokens, prompt = parse(line)
        request = make_request(prompt, max_tokens=max_tokens)
        async with self.client.generate(request) as stream:
            async for out in stream:
                await self.send.send("data: " + " ".join(map(str, out.new_token_ids)))
        await self.send.send("data: [DONE]")


class LeakySession(Session):
    """The same endpoint with a bug: it closes its stream only when generation ends.

    It keeps open streams on the session (to close them with the connection, which its
    server forgets on disconnect). A disconnect or a cancellation mid-stream leaves the
    request running on the engine.
    """

    def __init__(self, client: EngineCoreClient, send: ObjectSendStream[str]) -> None:
        super().__init__(client, send)
        self.streams = contextlib.AsyncExitStack()

    async def handle(self, line: str) -> None:
        max_tokens, prompt = parse(line)
        request = make_request(prompt, max_tokens=max_tokens)
        stream = await self.streams.enter_async_context(self.client.generate(request))
        async for out in stream:
            await self.send.send("data: " + " ".join(map(str, out.new_token_ids)))
        await self.streams.aclose()  # BUG: not reached when send() raises or on cancel
        await self.send.send("data: [DONE]")


async def read_lines(receive: ObjectReceiveStream[str], limit: int | None = None) -> list[str]:
    """The HTTP client: read ``limit`` lines (all if None), then disconnect."""
    lines: list[str] = []
    async with receive:
        async for line in receive:
            lines.append(line)
            if len(lines) == limit:
                break
    return lines


# ---------------------------------------------------------------- disconnects


@pytest.mark.reference_engines(extra_args=LONG)
async def test_client_disconnect_aborts_the_request(reference_engines: ReferenceEngineSet) -> None:
    client = reference_engines.client
    send, receive = anyio.create_memory_object_stream[str]()
    session = Session(client, send)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_lines, receive, 3)  # disconnects after three lines
            with pytest.raises(anyio.BrokenResourceError), send:
                await session.handle("GENERATE 500000 1 2 3")
    assert_no_inflight_requests(client)
    await assert_engine_idle(reference_engines)


@pytest.mark.reference_engines(extra_args=LONG)
async def test_leaky_session_leaves_the_request_running(
    reference_engines: ReferenceEngineSet,
) -> None:
    client = reference_engines.client
    send, receive = anyio.create_memory_object_stream[str]()
    session = LeakySession(client, send)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_lines, receive, 3)
            with pytest.raises(anyio.BrokenResourceError), send:
                await session.handle("GENERATE 500000 1 2 3")
        with pytest.raises(AssertionError, match="live requests"):
            assert_no_inflight_requests(client)
        with pytest.raises(AssertionError, match="still holds 1 request"):
            await assert_engine_idle(reference_engines, within=0.3)
        await session.streams.aclose()  # what the server should have done
    assert_no_inflight_requests(client)
    await assert_engine_idle(reference_engines)


# ---------------------------------------------------------------- the harness


def complete_exchange(
    client: EngineCoreClient, session_type: type[Session], sessions: list[Session]
) -> Callable[[], Awaitable[None]]:
    """A scenario for the harness: one request, read to the end by the HTTP client."""

    async def scenario() -> None:
        send, receive = anyio.create_memory_object_stream[str]()
        session = session_type(client, send)
        sessions.append(session)
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_lines, receive)
            # As the HTTP layer of a server does, a disconnect ends the exchange quietly.
            # The reader is cancelled with the exchange and closes its end; on asyncio
            # that can wake handle()'s pending send (a disconnect) before anyio delivers
            # the cancellation to it, which is a correct outcome too.
            with send, contextlib.suppress(anyio.BrokenResourceError):
                await session.handle("GENERATE 6 4 5 6")

    return scenario


async def test_harness_finds_the_leaky_session(reference_engines: ReferenceEngineSet) -> None:
    sessions: list[Session] = []
    scenario = complete_exchange(reference_engines.client, LeakySession, sessions)
    try:
        with anyio.fail_after(60):
            report = await check_cancellation(scenario, engines=reference_engines)
    finally:
        for session in sessions:
            assert isinstance(session, LeakySession)
            await session.streams.aclose()
    assert not report.ok
    first = report.runs[0]
    assert first.checkpoint is None
    assert first.outcome == "returned"
    assert first.ok
    leaking = report.broken_at("client-requests")
    assert leaking, str(report)
    # Cancelled while the stream was open: inside handle(), after the stream opened
    # (the run ends cancelled, or by the disconnect that the cancellation caused).
    for run in report.failures:
        assert run.cancel_requested
        assert run.outcome in ("cancelled", "returned")
        assert "test_example_streaming.py" in run.location
        assert "in handle" in run.location
    text = str(report)
    assert f"checkpoint {leaking[0]} at " in text
    assert "client-requests: request(s)" in text
    # The first checkpoint is before the request is sent: nothing can leak there.
    assert 1 not in leaking


async def test_harness_passes_the_fixed_session(reference_engines: ReferenceEngineSet) -> None:
    sessions: list[Session] = []
    scenario = complete_exchange(reference_engines.client, Session, sessions)
    with anyio.fail_after(60):
        report = await check_cancellation(scenario, engines=reference_engines)
    report.assert_ok()
    assert report.checkpoints >= 10
    # Timing changes the count per run (a wait that finds data ready yields less), so
    # later runs may end before their checkpoint, more of them the faster the machine:
    # how many is not asserted. The first checkpoint comes before any output, in every
    # run, so that run is cancelled whatever the machine.
    assert report.runs[1].checkpoint == 1
    assert report.runs[1].outcome == "cancelled", report
    assert len(sessions) == len(report.runs)
    assert_no_inflight_requests(reference_engines.client)
    await assert_engine_idle(reference_engines)
