"""Streamed token events written from the receive task (`SEND_NOWAIT` + `set_direct`).

On the h11 server the token events of a streamed response go out from the client's
receive task, the request's task waking only for the first output, the last, and a
socket that did not take an event whole. These tests hold that path to the same
bytes as the request's own task writes, through a client that stops reading.
"""

from __future__ import annotations

import json
import socket
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import trio_vllm as tv
from trio_vllm.llm import LLM, open_llm
from trio_vllm.server import _app, _h11

from ._util import serving, sse_events

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]


@pytest.fixture
def anyio_backend() -> str:
    return "trio"  # the h11 server, the only one offering SEND_NOWAIT


@pytest.fixture
async def frontend() -> AsyncIterator[LLM]:
    # A step interval: between engine steps the request's task is parked.
    engines = tv.ReferenceEngines(1, model="echo", extra_args=["--step-interval-ms", "2"])
    async with open_llm(engines) as llm:
        yield llm


class _Counts:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.direct = 0  # events written by _Direct
        self.partial = 0  # send_nowait calls the socket did not take whole
        direct_call = _app._Direct.__call__
        send_nowait = _h11._Connection.send_nowait

        def counted_call(d: Any, outs: Any) -> None:
            self.direct += 1
            direct_call(d, outs)

        def counted_send(conn: Any, data: bytes) -> bool:
            whole: bool = send_nowait(conn, data)
            self.partial += not whole
            return whole

        monkeypatch.setattr(_app._Direct, "__call__", counted_call)
        monkeypatch.setattr(_h11._Connection, "send_nowait", counted_send)


def _request(body: dict[str, Any], *, rcvbuf: int | None = None) -> tuple[socket.socket, bytes]:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    data = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
        f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
    )
    return sock, head.encode() + data


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(60)
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    sock.close()
    return b"".join(chunks)


def _events(raw: bytes) -> list[Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0], head
    assert b"transfer-encoding: chunked" in head.lower()
    return sse_events(_dechunk(body))


def _dechunk(body: bytes) -> bytes:
    # Strict: every chunk's size line must frame exactly, and the body must end with
    # the last chunk (a byte lost or doubled by a partial write shows here).
    out = bytearray()
    while True:
        size_line, sep, body = body.partition(b"\r\n")
        assert sep, "truncated chunk framing"
        size = int(size_line, 16)
        chunk, crlf, body = body[:size], body[size : size + 2], body[size + 2 :]
        assert crlf == b"\r\n", (size, chunk[-20:], crlf)
        if size == 0:
            assert body == b""
            return bytes(out)
        out += chunk


async def _stream(port: int, body: dict[str, Any], *, rcvbuf: int | None = None,
                  stall: float = 0.0) -> list[Any]:  # fmt: skip
    sock, request = _request(body, rcvbuf=rcvbuf)

    def run() -> bytes:
        sock.connect(("127.0.0.1", port))
        sock.sendall(request)
        if stall:
            import time

            time.sleep(stall)  # the client stops reading: the server's socket fills
        return _read_all(sock)

    return _events(await anyio.to_thread.run_sync(run))


def _text(events: list[Any]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if e != "[DONE]" and e["choices"])


async def test_token_events_go_out_from_the_receive_task(
    frontend: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = _Counts(monkeypatch)
    body = {"model": "trio-vllm-reference", "prompt": "abcdefgh", "max_tokens": 48,
            "stream": True, "temperature": 0}  # fmt: skip
    async with serving(frontend) as served:
        events = await _stream(served.port, body)
    assert events[-1] == "[DONE]"
    assert _text(events) == "abcdefgh" * 6
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    # One event per token, as from the request's task; most of them written directly.
    assert len([e for e in events[:-1] if e["choices"]]) == 48
    assert counts.direct >= 24
    assert frontend.num_requests == 0


async def test_a_client_that_stops_reading_gets_every_byte(
    frontend: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = _Counts(monkeypatch)
    init = _h11._Connection.__init__

    def small_buffer(conn: Any, server: Any, sock: socket.socket) -> None:
        init(conn, server, sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    monkeypatch.setattr(_h11._Connection, "__init__", small_buffer)
    n = 1500
    prompt = "0123456789" * 5
    body = {"model": "trio-vllm-reference", "prompt": prompt, "max_tokens": n,
            "stream": True, "temperature": 0}  # fmt: skip
    async with serving(frontend) as served:
        events = await _stream(served.port, body, rcvbuf=4096, stall=1.5)
    assert counts.partial >= 1  # the socket filled while direct writes ran
    assert counts.direct >= 1
    assert events[-1] == "[DONE]"
    # (fewer events than tokens: the client stream coalesced while the task waited)
    assert _text(events) == (prompt * (n // len(prompt) + 1))[:n]
    assert frontend.num_requests == 0
