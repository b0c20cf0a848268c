"""Helpers for the server tests: serve an app on a free port, a ``trio-vllm serve``
process, raw HTTP, SSE parsing."""

from __future__ import annotations

import json
import re
import signal
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from trio_vllm.server import OpenAIServer, serve_app

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence

    from anyio.abc import Process

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


SERVING = re.compile(rb"serving \S+ on http://127\.0\.0\.1:(\d+)")


class ServeProcess:
    """A ``trio-vllm serve`` process: its port once it listens, and its stderr so far
    (read for as long as `serve_process` runs)."""

    def __init__(self, process: Process) -> None:
        self.process = process
        self.port = 0
        self.stderr = b""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


S = TypeVar("S", bound=ServeProcess)


@asynccontextmanager
async def serve_process(
    command: Sequence[str],
    make: Callable[[Process], S],
    *,
    env: dict[str, str] | None = None,
    servers: int = 1,
    ready_timeout: float = 60,
    stop_timeout: float = 30,
) -> AsyncIterator[S]:
    """Run ``command`` (a ``trio-vllm serve --port 0 ...``) until ``servers`` servers
    logged ``serving NAME on http://127.0.0.1:PORT`` (the first one's port is
    ``.port``; `AssertionError` with the stderr after ``ready_timeout`` s), then yield
    ``make(process)``. At the end, cancelled or not: SIGTERM if still running (the way
    it removes what it made), SIGKILL only if it has not exited ``stop_timeout`` s
    later, and reaped."""
    process = await anyio.open_process(command, env=env, stdin=None, stdout=None)
    served = make(process)
    try:
        async with anyio.create_task_group() as tg:
            ready = anyio.Event()

            async def read_stderr() -> None:
                assert process.stderr is not None
                async for chunk in process.stderr:
                    served.stderr += chunk
                    found = SERVING.findall(served.stderr)
                    if len(found) >= servers and not ready.is_set():
                        served.port = int(found[0])
                        ready.set()

            tg.start_soon(read_stderr)
            with anyio.move_on_after(ready_timeout):
                await ready.wait()
            assert ready.is_set(), served.stderr.decode(errors="replace")
            yield served
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                with anyio.move_on_after(stop_timeout):
                    await process.wait()
            if process.returncode is None:
                process.kill()
            await process.wait()
