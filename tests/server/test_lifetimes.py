"""Request lifetimes: disconnects abort at once, engine death ends every stream."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal

import anyio
import httpx
import pytest

from trio_vllm.llm import LLM

from ._util import Served, raw_request, sse_events, wait_until

pytestmark = pytest.mark.anyio

_LONG = {"prompt": "abc", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}


@pytest.fixture
def engine_args() -> list[str]:
    # A 1,500-token request takes >= 30 s: still running whenever a test looks (a
    # loaded machine can freeze this process for seconds), and longer than the 20 s
    # waits for an abort, so a missing abort fails them instead of ending on its own.
    return ["--step-interval-ms", "20"]


def _idle(served: Served) -> bool:
    llm = served.app.llm
    assert isinstance(llm, LLM)
    return not (served.app.open_requests or llm.live_request_ids or llm.client.live_requests)


async def _post(port: int, body: dict[str, object]) -> anyio.abc.SocketStream:
    data = json.dumps(body).encode()
    stream = await anyio.connect_tcp("127.0.0.1", port)
    await stream.send(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return stream


async def test_streaming_disconnect_aborts_on_the_engine(served: Served) -> None:
    stream = await _post(served.port, {**_LONG, "stream": True})
    received = b""
    while received.count(b"data: ") < 3:
        received += await stream.receive()
    assert served.app.open_requests
    assert served.app.llm.client.live_requests
    await stream.aclose()
    await wait_until(lambda: _idle(served), timeout=20)


async def test_non_streaming_disconnect_aborts_on_the_engine(served: Served) -> None:
    stream = await _post(served.port, _LONG)
    await wait_until(lambda: bool(served.app.llm.client.live_requests), timeout=20)
    await stream.aclose()
    await wait_until(lambda: _idle(served), timeout=20)


async def test_many_streaming_clients_disconnecting_at_random_points(served: Served) -> None:
    # 1,000 clients, at most 200 at a time (2 shared cores). Each leaves at a random
    # point: 10 % while sending the request, 80 % after a random number of bytes of a
    # long stream (1,500 tokens, >= 30 s), 10 % read a short stream to its end.
    rng = random.Random(1234)
    limiter = anyio.CapacityLimiter(200)
    outcomes = {"early": 0, "mid_stream": 0, "complete": 0}

    def request(max_tokens: int) -> bytes:
        body = json.dumps({**_LONG, "max_tokens": max_tokens, "stream": True}).encode()
        return (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"connection: close\r\n" + f"content-length: {len(body)}\r\n\r\n".encode() + body
        )

    long_request, short_request = request(1500), request(20)

    async def client(cut: float) -> None:
        async with limiter, await anyio.connect_tcp("127.0.0.1", served.port) as stream:
            if cut < 0.1:
                await stream.send(long_request[: int(len(long_request) * cut * 10)])
                outcomes["early"] += 1
                return
            short = cut >= 0.9
            await stream.send(short_request if short else long_request)
            want = 1 << 30 if short else int((cut - 0.1) * 1800)  # bytes to read
            received = b""
            with contextlib.suppress(anyio.EndOfStream):
                while len(received) < want and b"data: [DONE]" not in received:
                    received += await stream.receive()
            outcomes["complete" if b"[DONE]" in received else "mid_stream"] += 1

    with anyio.fail_after(100):
        async with anyio.create_task_group() as tg:
            for _ in range(1000):
                tg.start_soon(client, rng.random())
    assert sum(outcomes.values()) == 1000
    assert outcomes["early"] > 50, outcomes
    assert outcomes["mid_stream"] > 600, outcomes
    assert outcomes["complete"] > 50, outcomes
    await wait_until(lambda: _idle(served), timeout=20)
    # still serving
    status, _, data = await raw_request(
        served.port,
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "xyz", "max_tokens": 3}).encode(),
        {"content-type": "application/json"},
    )
    assert status == 200, data
    assert json.loads(data)["choices"][0]["text"] == "xyz"


# 1,500 tokens take >= 30 s (the module's engine_args), longer than the wait for all 20
# streams: the SIGKILL always lands while every stream is still open (no stream may end
# normally).
async def test_engine_sigkill_ends_every_stream_with_an_error(served: Served) -> None:
    streaming = 0

    async def one(results: list[list[object]]) -> None:
        nonlocal streaming
        async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as http:  # noqa: SIM117
            async with http.stream(
                "POST", "/v1/completions", json={**_LONG, "stream": True}
            ) as response:
                assert response.status_code == 200
                body = b""
                async for chunk in response.aiter_bytes():
                    if not body:
                        streaming += 1
                    body += chunk
                results.append(sse_events(body))

    results: list[list[object]] = []
    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(one, results)
        await wait_until(lambda: streaming == 20, timeout=30)
        assert not results, "a stream ended before the SIGKILL"
        (pid,) = served.app.llm.client.engine_pids.values()
        os.kill(pid, signal.SIGKILL)
    assert len(results) == 20
    for events in results:
        assert events[-1] == "[DONE]"
        error = events[-2]
        assert isinstance(error, dict)
        assert error.get("error", {}).get("code") == 503, events[-3:]
        assert all("choices" in e for e in events[:-2] if isinstance(e, dict))
    assert served.app.dead
    status, _, _ = await raw_request(served.port, "GET", "/health")
    assert status == 503
    status, _, data = await raw_request(
        served.port,
        "POST",
        "/v1/completions",
        b'{"prompt": "x"}',
        {"content-type": "application/json"},
    )
    assert status == 503
    assert json.loads(data)["error"]["type"] == "ServiceUnavailableError"
    assert not served.app.open_requests


async def test_begin_shutdown_ends_what_outlives_the_grace(served: Served) -> None:
    # Both backends, in-process: a stream gets an error event and [DONE], a non-streaming
    # request a 503; both are aborted on the engine. 1,500 tokens take >= 30 s.
    stream = await _post(served.port, {**_LONG, "stream": True})
    received = b""
    while received.count(b"data: ") < 2:
        received += await stream.receive()
    plain = await _post(served.port, _LONG)
    await wait_until(lambda: len(served.app.open_requests) == 2, timeout=20)
    served.app.begin_shutdown(0.5)
    with anyio.fail_after(30):  # a hang guard
        while not received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
            received += await stream.receive()
        body = b""
        with contextlib.suppress(anyio.EndOfStream):
            while b"ServiceUnavailableError" not in body:
                body += await plain.receive()
    await stream.aclose()
    await plain.aclose()
    events = re.findall(rb"data: (.*?)\n\n", received)
    assert events[-1] == b"[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["code"], error["type"]) == (503, "ServiceUnavailableError")
    assert body.startswith(b"HTTP/1.1 503"), body
    await wait_until(lambda: _idle(served), timeout=20)
