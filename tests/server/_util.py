"""Helpers for the server tests: serve an app on a free port, raw HTTP, SSE parsing."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio

from trio_vllm.server import OpenAIServer, serve_app

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from trio_vllm.server import TextFrontend


@dataclass
class Served:
    app: OpenAIServer
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@asynccontextmanager
async def serving(llm: TextFrontend, **options: Any) -> AsyncIterator[Served]:
    """Serve ``OpenAIServer(llm, **options)`` with hypercorn on 127.0.0.1, a free port."""
    app = OpenAIServer(llm, **options)
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        port = await tg.start(
            partial(serve_app, app, port=0, shutdown_trigger=stop.wait, graceful_timeout=5)
        )
        try:
            yield Served(app, port)
        finally:
            stop.set()


async def raw_request(
    port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request on a fresh connection; (status, headers, body)."""
    head = {"host": "127.0.0.1", "connection": "close", "content-length": str(len(body))}
    head.update(headers or {})
    lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in head.items()), "", ""]
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        try:
            await stream.send("\r\n".join(lines).encode() + body)
        except anyio.BrokenResourceError as exc:
            # Reset while sending: the connection sat in the backlog of a listener that
            # closed (a server that stops accepting); the same as a refused connect.
            raise ConnectionResetError("the server reset the connection") from exc
        data = b""
        try:
            while not _complete(data):
                data += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
    if not data:  # accepted, then closed unanswered (a listener going away)
        raise ConnectionResetError("the server closed the connection without a response")
    header_blob, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = header_blob.decode("latin-1").split("\r\n")
    parsed = _headers(header_lines)
    if parsed.get("transfer-encoding") == "chunked":
        rest = _dechunk(rest)
    return int(status_line.split()[1]), parsed, rest


def _headers(lines: list[str]) -> dict[str, str]:
    parsed = {}
    for line in lines:
        k, _, v = line.partition(":")
        parsed[k.strip().lower()] = v.strip()
    return parsed


def _complete(data: bytes) -> bool:
    """Whether ``data`` holds a whole response (the server need not close first)."""
    if b"\r\n\r\n" not in data:
        return False
    header_blob, _, rest = data.partition(b"\r\n\r\n")
    headers = _headers(header_blob.decode("latin-1").split("\r\n")[1:])
    if headers.get("transfer-encoding") == "chunked":
        return rest.endswith(b"0\r\n\r\n")
    if "content-length" in headers:
        return len(rest) >= int(headers["content-length"])
    return False


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2 :]
    return out


def sse_events(body: bytes) -> list[Any]:
    """The JSON payloads of an SSE body, ``"[DONE]"`` as the string."""
    events: list[Any] = []
    for block in body.decode().split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def wait_until(predicate: Any, timeout: float = 10.0) -> None:  # noqa: ASYNC109
    """Poll ``predicate()`` every 10 ms until true; fail after ``timeout`` s.

    Polling on purpose: the state watched (the engine's live requests, the server's
    registry) has no event to wait on, and the test must not add one to the code.
    """
    with anyio.fail_after(timeout):
        while not predicate():  # noqa: ASYNC110
            await anyio.sleep(0.01)
