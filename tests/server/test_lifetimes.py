"""Request lifetimes: disconnects abort at once, engine death ends every stream."""

from __future__ import annotations

import json
import os
import random
import signal

import anyio
import httpx
import pytest

from ._util import Served, raw_request, sse_events, wait_until

pytestmark = pytest.mark.anyio

_LONG = {"model": "fake", "prompt": "abc", "max_tokens": 1500, "ignore_eos": True,
         "temperature": 0}


@pytest.fixture
def engine_args() -> list[str]:
    return ["--output-delay-ms", "2"]  # a 1,500-token request takes > 3 s


def _idle(served: Served) -> bool:
    return not served.app.open_requests and not served.app.llm.client.live_requests


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
    await wait_until(lambda: _idle(served), timeout=5)


async def test_non_streaming_disconnect_aborts_on_the_engine(served: Served) -> None:
    stream = await _post(served.port, _LONG)
    await wait_until(lambda: bool(served.app.llm.client.live_requests), timeout=5)
    await stream.aclose()
    await wait_until(lambda: _idle(served), timeout=5)


async def test_many_streaming_clients_disconnecting_at_random_points(served: Served) -> None:
    # 1,000 clients, at most 200 at a time (2 shared cores); each leaves at a random point:
    # mid-headers, mid-body, after k events, or after reading the whole stream.
    rng = random.Random(1234)
    limiter = anyio.CapacityLimiter(200)
    outcomes = {"early": 0, "mid_stream": 0, "complete": 0}
    body = json.dumps({**_LONG, "max_tokens": 40, "stream": True}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"connection: close\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )

    async def client(cut: float) -> None:
        async with limiter, await anyio.connect_tcp("127.0.0.1", served.port) as stream:
            if cut < 0.1:  # leave before the request is complete
                await stream.send(request[: int(len(request) * cut * 10)])
                outcomes["early"] += 1
                return
            await stream.send(request)
            want = int(cut * 45)  # events to read; > 41 means read to the end
            received = b""
            try:
                while received.count(b"data: ") < want and b"data: [DONE]" not in received:
                    received += await stream.receive()
            except anyio.EndOfStream:
                pass
            outcomes["complete" if b"[DONE]" in received else "mid_stream"] += 1

    with anyio.fail_after(100):
        async with anyio.create_task_group() as tg:
            for _ in range(1000):
                tg.start_soon(client, rng.random())
    assert sum(outcomes.values()) == 1000
    assert min(outcomes.values()) > 50, outcomes
    await wait_until(lambda: _idle(served), timeout=10)
    # still serving
    status, _, data = await raw_request(
        served.port, "POST", "/v1/completions",
        json.dumps({"prompt": "xyz", "max_tokens": 3}).encode(),
        {"content-type": "application/json"},
    )
    assert status == 200, data
    assert json.loads(data)["choices"][0]["text"] == "xyz"


async def test_engine_sigkill_ends_every_stream_with_an_error(served: Served) -> None:
    async def one(results: list[list[object]]) -> None:
        async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as http:  # noqa: SIM117
            async with http.stream(
                "POST", "/v1/completions", json={**_LONG, "stream": True}
            ) as response:
                assert response.status_code == 200
                results.append(sse_events(await response.aread()))

    results: list[list[object]] = []
    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(one, results)
        await wait_until(lambda: len(served.app.llm.client.live_requests) == 20, timeout=10)
        (pid,) = served.app.llm.client.engine_pids.values()
        os.kill(pid, signal.SIGKILL)
    assert len(results) == 20
    for events in results:
        assert events[-1] == "[DONE]"
        error = events[-2]
        assert isinstance(error, dict)
        assert error["error"]["code"] == 503, error
        assert all("choices" in e for e in events[:-2] if isinstance(e, dict))
    assert served.app.dead
    status, _, _ = await raw_request(served.port, "GET", "/health")
    assert status == 503
    status, _, data = await raw_request(
        served.port, "POST", "/v1/completions", b'{"prompt": "x"}',
        {"content-type": "application/json"},
    )
    assert status == 503
    assert json.loads(data)["error"]["type"] == "ServiceUnavailableError"
    assert not served.app.open_requests
