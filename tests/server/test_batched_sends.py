"""One ASGI send per wakeup: the outputs a stream has buffered go out together, one SSE
event per output, and a disconnect during such a send still aborts the request.

The app is called in-process with a recording ``send`` that holds the request task
until the engine's outputs are buffered (no timing: it waits on the client stream's
state).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from trio_vllm.server import OpenAIServer

from ._util import sse_events, wait_until

if TYPE_CHECKING:
    from collections.abc import Callable

    from trio_vllm.llm import LLM

pytestmark = pytest.mark.anyio


@pytest.fixture
def engine_args() -> list[str]:
    # 20 ms a token: a 1,500-token request is still running when the test disconnects.
    return ["--step-interval-ms", "20"]


def _client_stream(llm: LLM) -> Any:
    [[stream]] = llm._streams.values()
    return stream._children[0].stream


def _scope(path: str, body: bytes) -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
    }


def _receive(body: bytes, disconnect: anyio.Event) -> Callable[[], Any]:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    return receive


async def _answer_held_until_buffered(
    frontend: LLM, path: str, *, merge_outputs: bool, **fields: Any
) -> tuple[list[dict[str, Any]], list[str], list[Any], str, OpenAIServer]:
    """One 12-token streaming request whose task is held at the response head until
    the engine's whole answer is buffered: the messages sent, the content chunks' texts
    (chat: after the role chunk, checked), every SSE event, the text expected, the app."""
    app = OpenAIServer(frontend, merge_outputs=merge_outputs)
    request: dict[str, Any] = {"max_tokens": 12, "stream": True, "temperature": 0, **fields}
    if path == "/v1/completions":
        request["prompt"] = prompt = "abcdefgh"
    else:
        request["messages"] = [{"role": "user", "content": "abcdefgh"}]
        prompt, _ = frontend.render_chat(request["messages"])
    # The echo model repeats the prompt's tokens (bytes: ASCII here).
    expected = (prompt * 2).encode()[:12].decode()
    body = json.dumps(request).encode()
    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)
        if message["type"] == "http.response.start":
            await wait_until(lambda: _client_stream(frontend).finished, timeout=30)

    with anyio.fail_after(60):
        await app(_scope(path, body), _receive(body, anyio.Event()), send)
    events = sse_events(b"".join(m.get("body", b"") for m in messages[1:]))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    if path == "/v1/chat/completions":
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        chunks = chunks[1:]
        texts = [c["choices"][0]["delta"]["content"] for c in chunks]
    else:
        texts = [c["choices"][0]["text"] for c in chunks]
    return messages, texts, chunks, expected, app


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_buffered_outputs_go_out_in_one_send(frontend: LLM, path: str) -> None:
    messages, texts, chunks, expected, app = await _answer_held_until_buffered(
        frontend, path, merge_outputs=False, stream_options={"include_usage": True}
    )
    assert [m["type"] for m in messages] == ["http.response.start", "http.response.body"]
    assert not messages[1].get("more_body", False)
    events = sse_events(messages[1]["body"])
    usage = events[-2]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 12
    # One event per token, in order, the last one finishing.
    assert len(chunks) == 12
    assert "".join(texts) == expected
    assert all(len(t) == 1 for t in texts)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 11 + ["length"]
    assert app.open_requests == []
    assert frontend.num_requests == 0


async def test_disconnect_during_a_batched_send_aborts(frontend: LLM) -> None:
    app = OpenAIServer(frontend)
    body = json.dumps(
        {"prompt": "abc", "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True}
    ).encode()
    disconnect = anyio.Event()
    bodies: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] != "http.response.body":
            return
        bodies.append(message["body"])
        if len(bodies) == 1:
            # Let at least three outputs pile up: the next send carries all of them.
            await wait_until(lambda: len(_client_stream(frontend)._pending) >= 3, timeout=30)
        else:
            disconnect.set()
            await anyio.sleep_forever()  # a client that stopped reading, then left

    with anyio.fail_after(60):
        await app(_scope("/v1/completions", body), _receive(body, disconnect), send)
    assert len(bodies) == 2
    assert bodies[1].count(b"data: ") >= 3
    assert b"[DONE]" not in bodies[1]
    await wait_until(
        lambda: (
            not (app.open_requests or frontend.live_request_ids or frontend.client.live_requests)
        ),
        timeout=20,
    )


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_merge_outputs_sends_what_piled_up_as_one_event(frontend: LLM, path: str) -> None:
    _, texts, chunks, expected, app = await _answer_held_until_buffered(
        frontend, path, merge_outputs=True
    )
    # The whole buffered answer, merged: one event, the finishing one.
    assert texts == [expected]
    assert chunks[0]["choices"][0]["finish_reason"] == "length"
    assert app.open_requests == []
