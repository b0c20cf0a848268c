"""Time to first byte of a burst of new requests while streams run, per HTTP layer.

Isolates the HTTP layer from the engine and the text layer (issue 25: TTFT p99 at
concurrency 256 was 4-6 x its p50). A server process (pinned to ``--server-core``) runs
an ASGI app on ``serve_app``: ``/stream`` sends one small SSE event per "engine step"
(a ticker sets an event every ``--step-ms``, as the client's receive loop wakes every
running stream once per engine message) for ``--steps`` steps; ``/first`` answers at
once (the head and one event). A client process (pinned to ``--client-core``, asyncio,
raw sockets) opens ``--streams`` streams, waits until every one has its first event,
then opens ``--burst`` connections at once, each sending ``GET /first``, and records
connect -> first byte for each. Servers:

* ``h11``: ``serve_app(http_server="h11")``, which accepts every waiting connection per
  wake-up;
* ``h11-1pass``: the same with one accept per scheduler pass (``trio``'s socket
  ``accept`` and hypercorn's loop do that): the accept loop is patched here, in this
  benchmark only, to yield after each accept;
* ``hypercorn``: hypercorn's trio worker;
* ``uvicorn``: ``serve_app(http_server="uvicorn")`` on asyncio with uvloop, as
  ``trio-vllm serve --backend asyncio`` (the app and ticker on anyio).

Prints p50, p99 and max of the burst's time to first byte, and p99 / p50; the server's
CPU per streamed event. Not a test: nothing asserts.

    python bench/bench_http_fairness.py [--servers h11,h11-1pass,hypercorn,uvicorn]
        [--streams 256] [--burst 256] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

EVENT = b'data: {"choices":[{"index":0,"text":" tok"}]}\n\n'

_SERVER = r"""
import os, sys, time, anyio, trio
from functools import partial
from trio_vllm.server import serve_app
import trio_vllm.server._h11 as h11mod

kind, step_ms, steps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
EVENT = sys.argv[4].encode()
if kind == "h11-1pass":
    async def _accept_loop(listener, server, nursery, accepting):
        import socket as s
        with accepting:
            while True:
                try:
                    client, _ = listener.accept()
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(listener)
                    continue
                client.setblocking(False)
                client.setsockopt(s.IPPROTO_TCP, s.TCP_NODELAY, 1)
                server.open += 1
                nursery.start_soon(h11mod._run_connection, server, client)
                await trio.lowlevel.checkpoint()  # one accept per scheduler pass
    h11mod._accept_loop = _accept_loop

tick = None
events = 0

async def ticker():
    global tick
    while True:
        await anyio.sleep(step_ms / 1000)
        old, tick = tick, anyio.Event()
        old.set()

async def app(scope, receive, send):
    global events
    if scope["type"] == "lifespan":  # hypercorn waits for its answers
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await receive()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    if scope["path"] == "/first":
        await send({"type": "http.response.body", "body": EVENT})
        return
    for _ in range(steps):
        await tick.wait()
        await send({"type": "http.response.body", "body": EVENT, "more_body": True})
        events += 1
    await send({"type": "http.response.body", "body": b""})

async def main():
    global tick
    tick = anyio.Event()
    stop = anyio.Event()
    server = kind if kind in ("hypercorn", "uvicorn") else "h11"
    async with anyio.create_task_group() as n:
        n.start_soon(ticker)
        port = await n.start(partial(serve_app, app, port=0, shutdown_trigger=stop.wait,
                                     graceful_timeout=1, http_server=server))
        print(port, flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        cpu0, ev0 = time.process_time(), events
        await anyio.to_thread.run_sync(sys.stdin.readline)
        print(json.dumps({"cpu_s": time.process_time() - cpu0, "events": events - ev0}),
              flush=True)
        stop.set()
        n.cancel_scope.cancel()

import json
if kind == "uvicorn":
    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
else:
    trio.run(main)
"""

_CLIENT = r"""
import asyncio, json, sys, time
port, streams, burst = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

async def stream(started):
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
    await r.read(1)  # the head (with the first event, or before it)
    started.release()
    while await r.read(65536):
        pass

async def first():
    t0 = time.perf_counter()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /first HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    await r.read(1)
    t = time.perf_counter() - t0
    while await r.read(65536):
        pass
    w.close()
    return t

async def main():
    started = asyncio.Semaphore(0)
    tasks = [asyncio.create_task(stream(started)) for _ in range(streams)]
    for _ in range(streams):
        await started.acquire()
    print("running", flush=True)
    sys.stdin.readline()
    times = await asyncio.gather(*(first() for _ in range(burst)))
    print(json.dumps(sorted(times)), flush=True)
    for t in tasks:
        t.cancel()

asyncio.run(main())
"""


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def _round(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    server = subprocess.Popen(
        ["taskset", "-c", args.server_core, sys.executable, "-c", _SERVER, kind,
         str(args.step_ms), str(args.steps), EVENT.decode()],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert server.stdin is not None
    assert server.stdout is not None
    port = int(server.stdout.readline())
    client = subprocess.Popen(
        ["taskset", "-c", args.client_core, sys.executable, "-c", _CLIENT, str(port),
         str(args.streams), str(args.burst)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert client.stdin is not None
    assert client.stdout is not None
    assert client.stdout.readline().strip() == "running"
    server.stdin.write("go\n")
    server.stdin.flush()
    time.sleep(0.5)  # the streams' steady state
    client.stdin.write("go\n")
    client.stdin.flush()
    times = json.loads(client.stdout.readline())
    server.stdin.write("stop\n")
    server.stdin.flush()
    cpu = json.loads(server.stdout.readline())
    for proc in (client, server):
        proc.terminate()
        proc.wait(10)
    p50, p99 = _pct(times, 0.5) * 1000, _pct(times, 0.99) * 1000
    return {
        "ttfb_p50_ms": p50,
        "ttfb_p99_ms": p99,
        "ttfb_max_ms": times[-1] * 1000,
        "p99_over_p50": p99 / p50 if p50 else None,
        "server_cpu_us_per_event": cpu["cpu_s"] / max(cpu["events"], 1) * 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="h11,h11-1pass,hypercorn")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--burst", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server-core", default="0")
    parser.add_argument("--client-core", default="1")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results: dict[str, Any] = {"load_avg_start": os.getloadavg(), "runs": {}}
    for r in range(args.rounds):
        for kind in args.servers.split(","):
            results["runs"][f"{kind}/{r}"] = out = _round(kind, args)
            if not args.json:
                print(kind, r, json.dumps({k: round(v, 2) for k, v in out.items() if v}),
                      flush=True)  # fmt: skip
    results["load_avg_end"] = os.getloadavg()
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
