"""Micro-benchmark: what one SSE chunk costs the server through each HTTP layer
(hypercorn's trio worker, trio-vllm's h11 server, uvicorn on uvloop) against a raw trio
socket send of the same bytes, in the same run.

A client process (plain blocking socket, its own process) reads as fast as it can; the
server sends ``--events`` copies of a typical ``/v1/completions`` token event
(~230 bytes) and times the sending loop with ``time.thread_time`` (the server's CPU)
and ``time.perf_counter``. Cases:

* ``hypercorn``: an ASGI app, one ``http.response.body`` per event (``more_body``) through
  ``trio_vllm.server.serve_app`` (hypercorn, h11, chunked framing);
* ``hypercorn x64``: the same app, 64 events per ``http.response.body`` (per event);
* ``h11``, ``h11 x64``: the same app on ``serve_app(http_server="h11")``, the default
  of ``trio-vllm serve`` on trio (``server/_h11.py``);
* ``uvicorn``, ``uvicorn x64``: the same app on ``serve_app(http_server="uvicorn")``
  under asyncio with uvloop (``trio-vllm serve --backend asyncio``; skipped without
  ``trio-vllm[asyncio]``);
* ``raw trio``: ``trio.SocketStream.send_all`` of each event with the same chunked
  framing hypercorn writes (the floor of "one send per token" on trio);
* ``raw trio x64``: 64 framed events per ``send_all`` (per event).

Prints CPU microseconds per event (best of ``--rounds``, cases interleaved) and the
ratio to ``raw trio``. Not a test: nothing here asserts.

    python bench/bench_sse_send.py [--events N] [--rounds N] [--json]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from functools import partial
from typing import Any

import anyio
import trio

EVENT = (
    b'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion",'
    b'"created":1764600000,"model":"tiny","choices":[{"index":0,"text":" tok",'
    b'"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,'
    b'"token_ids":null}]}\n\n'
)
BATCH = 64

# The client: connect, send one GET, read until the chunked body's end marker.
CLIENT = r"""
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"GET /sse HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
tail = b""
while True:
    data = s.recv(1 << 20)
    if not data:
        break
    tail = (tail + data)[-16:]
    if tail.endswith(b"0\r\n\r\n"):
        break
"""


def _framed(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _client(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", CLIENT, str(port)])


async def _asgi_case(events: int, per_send: int, server: str) -> tuple[float, float]:
    from trio_vllm.server import serve_app

    result: dict[str, float] = {}
    body = EVENT * per_send

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        cpu, wall = time.thread_time(), time.perf_counter()
        for _ in range(events // per_send):
            await send({"type": "http.response.body", "body": body, "more_body": True})
        result["cpu"] = time.thread_time() - cpu
        result["wall"] = time.perf_counter() - wall
        await send({"type": "http.response.body", "body": b""})
        done.set()

    done = anyio.Event()
    stop = anyio.Event()
    async with anyio.create_task_group() as nursery:
        port = await nursery.start(
            partial(
                serve_app,
                app,
                port=0,
                shutdown_trigger=stop.wait,
                graceful_timeout=1,
                http_server=server,
            )  # type: ignore[arg-type]
        )
        proc = _client(port)
        await done.wait()
        await anyio.to_thread.run_sync(proc.wait)
        stop.set()
    return result["cpu"] / events, result["wall"] / events


async def _raw_case(events: int, per_send: int) -> tuple[float, float]:
    result: dict[str, float] = {}
    data = _framed(EVENT) * per_send
    listener = trio.socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    await listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    proc = _client(port)
    conn, _ = await listener.accept()
    stream = trio.SocketStream(conn)
    request = b""
    while b"\r\n\r\n" not in request:
        request += await stream.receive_some(65536)
    await stream.send_all(b"HTTP/1.1 200 \r\ncontent-type: text/event-stream\r\n"
                          b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(events // per_send):
        await stream.send_all(data)
    result["cpu"] = time.thread_time() - cpu
    result["wall"] = time.perf_counter() - wall
    await stream.send_all(b"0\r\n\r\n")
    await trio.to_thread.run_sync(proc.wait)
    await stream.aclose()
    listener.close()
    return result["cpu"] / events, result["wall"] / events


CASES = {
    "hypercorn": partial(_asgi_case, per_send=1, server="hypercorn"),
    f"hypercorn x{BATCH}": partial(_asgi_case, per_send=BATCH, server="hypercorn"),
    "h11": partial(_asgi_case, per_send=1, server="h11"),
    f"h11 x{BATCH}": partial(_asgi_case, per_send=BATCH, server="h11"),
    "uvicorn": partial(_asgi_case, per_send=1, server="uvicorn"),
    f"uvicorn x{BATCH}": partial(_asgi_case, per_send=BATCH, server="uvicorn"),
    "raw trio": partial(_raw_case, per_send=1),
    f"raw trio x{BATCH}": partial(_raw_case, per_send=BATCH),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=BATCH * 200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from trio_vllm.server._serve import uvicorn_installed

    cases = {n: c for n, c in CASES.items() if uvicorn_installed() or "uvicorn" not in n}
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.rounds):
        for name, case in cases.items():
            if name.startswith("uvicorn"):  # asyncio's server: on uvloop, as the command
                cpu, wall = anyio.run(
                    case, args.events, backend="asyncio", backend_options={"use_uvloop": True}
                )
            else:
                cpu, wall = trio.run(case, args.events)
            old = best.get(name)
            best[name] = (cpu, wall) if old is None else (min(old[0], cpu), min(old[1], wall))
    floor = best["raw trio"][0]
    rows = {n: {"cpu_us_per_event": c * 1e6, "wall_us_per_event": w * 1e6, "ratio": c / floor}
            for n, (c, w) in best.items()}  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'case':16} {'CPU us/event':>13} {'wall us/event':>14} {'/ raw trio':>10}")
    for name, row in rows.items():
        print(f"{name:16} {row['cpu_us_per_event']:13.2f} {row['wall_us_per_event']:14.2f} "
              f"{row['ratio']:10.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
