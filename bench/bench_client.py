"""Client benchmark: output throughput through ``open_client`` against a blocking anchor.

The reference engine runs in firehose mode (``--firehose BATCH``): every ADD joins a
stream of messages carrying BATCH one-token outputs, sent as fast as the socket takes
them, until the request's ``max_tokens``. What is measured is outputs (tokens) per
second received and routed by the client:

* ``anchor``: a blocking pyzmq + ClientCodec loop (the handshake done by the same
  sans-I/O state machine, then ``recv_multipart`` + decode in a tight loop): the
  ceiling this engine and codec allow on this machine;
* ``streams``: ``client.generate`` for every request, one consumer task each;
* ``raw``: ``client.add_request`` + ``client.get_output`` (vLLM's raw API);

each on trio and asyncio. Printed: outputs/s with ``ratio = ours / anchor`` (higher is
better), and this process's CPU time per output (``time.process_time``, ZeroMQ's I/O
threads included; the engine is another process) with ``cpu ratio = ours / anchor``
(lower is better; 1.0 = no overhead over the blocking loop). The engine (pure Python)
is usually the bottleneck, so outputs/s mostly measures it; the CPU figure measures the
client. Not a test: nothing asserts.

    python bench/bench_client.py [--requests 8] [--tokens 20000] [--batch 16] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

import anyio
import zmq

from trio_vllm import ReferenceEngines, make_request, open_client
from trio_vllm.protocol.codec import ClientCodec
from trio_vllm.protocol.handshake import ClientHandshake, HandshakeComplete, SendInitMetadata
from trio_vllm.protocol.profiles import profile_for_version


def _engine_args(batch: int) -> list[str]:
    return ["--firehose", str(batch), "--disable-log-stats", "--max-model-len", "10000000"]


def run_anchor(requests: int, tokens: int, batch: int) -> tuple[float, float]:
    """Blocking pyzmq loop; returns (outputs per second, CPU seconds per output)."""
    ctx = zmq.Context()
    tmp = tempfile.mkdtemp(prefix="trio-vllm-bench-")
    hs_sock, inp, out = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL)
    for s in (hs_sock, inp, out):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 0)
    hs_sock.bind(f"ipc://{tmp}/hs")
    inp.bind(f"ipc://{tmp}/in")
    out.bind(f"ipc://{tmp}/out")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trio_vllm.reference_engine", "--model", "echo",
         "--handshake-address", f"ipc://{tmp}/hs", *_engine_args(batch)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        hs = ClientHandshake([0], inputs=[f"ipc://{tmp}/in"], outputs=[f"ipc://{tmp}/out"])
        poller = zmq.Poller()
        poller.register(hs_sock, zmq.POLLIN)
        poller.register(inp, zmq.POLLIN)
        complete: HandshakeComplete | None = None
        while complete is None:
            for sock, _ in poller.poll(30_000):
                identity, payload = sock.recv_multipart()
                feed = hs.receive_handshake if sock is hs_sock else hs.receive_input
                for event in feed(identity, payload):
                    if isinstance(event, SendInitMetadata):
                        hs_sock.send_multipart([event.identity, event.payload])
                    elif isinstance(event, HandshakeComplete):
                        complete = event
        codec = ClientCodec(profile_for_version(complete.vllm_version or "0.32.0"))
        start = time.perf_counter()
        cpu = time.process_time()
        for _ in range(requests):
            request = make_request([1, 2, 3], max_tokens=tokens)
            inp.send_multipart([b"\x00\x00", *codec.encode_add(request)])
        received = 0
        finished = 0
        while finished < requests:
            outputs = codec.decode_outputs(out.recv_multipart(copy=True))
            for o in outputs.outputs:  # type: ignore[union-attr]
                received += len(o.new_token_ids)
                finished += o.finish_reason is not None
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu
    finally:
        proc.kill()
        proc.wait()
        for s in (hs_sock, inp, out):
            s.close()
        ctx.term()
    return received / elapsed, cpu / received


async def run_streams(requests: int, tokens: int, batch: int) -> tuple[float, float]:
    engines = ReferenceEngines(model="echo", extra_args=_engine_args(batch))
    async with open_client(engines, ready_timeout=60) as client:
        received = 0

        async def one() -> None:
            nonlocal received
            async with client.generate(make_request([1, 2, 3], max_tokens=tokens)) as stream:
                async for out in stream:
                    received += len(out.new_token_ids)

        start = time.perf_counter()
        cpu = time.process_time()
        async with anyio.create_task_group() as tg:
            for _ in range(requests):
                tg.start_soon(one)
        cpu = time.process_time() - cpu
        return received / (time.perf_counter() - start), cpu / received


async def run_raw(requests: int, tokens: int, batch: int) -> tuple[float, float]:
    engines = ReferenceEngines(model="echo", extra_args=_engine_args(batch))
    async with open_client(engines, ready_timeout=60) as client:
        start = time.perf_counter()
        cpu = time.process_time()
        for _ in range(requests):
            await client.add_request(make_request([1, 2, 3], max_tokens=tokens))
        received = finished = 0
        while finished < requests:
            batch_out = await client.get_output()
            for out in batch_out.outputs:
                received += len(out.new_token_ids)
                finished += out.finish_reason is not None
        cpu = time.process_time() - cpu
        return received / (time.perf_counter() - start), cpu / received


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=20000, help="outputs per request")
    parser.add_argument("--batch", type=int, default=16, help="outputs per message")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = (args.requests, args.tokens, args.batch)
    results: dict[str, tuple[float, float]] = {"anchor": run_anchor(*sizes)}
    for backend in ("trio", "asyncio"):
        results[f"streams/{backend}"] = anyio.run(run_streams, *sizes, backend=backend)
        results[f"raw/{backend}"] = anyio.run(run_raw, *sizes, backend=backend)
    rate0, cpu0 = results["anchor"]
    if args.json:
        report = {
            name: {
                "outputs_per_s": rate,
                "ratio": rate / rate0,
                "cpu_us_per_output": cpu * 1e6,
                "cpu_ratio": cpu / cpu0,
            }
            for name, (rate, cpu) in results.items()
        }
        print(json.dumps(report))
        return
    print(f"{args.requests} requests x {args.tokens} outputs, {args.batch} outputs/message")
    for name, (rate, cpu) in results.items():
        print(
            f"{name:16s} {rate:10,.0f} outputs/s  ratio {rate / rate0:5.2f}   "
            f"{cpu * 1e6:6.2f} us CPU/output  cpu ratio {cpu / cpu0:5.2f}"
        )


if __name__ == "__main__":
    main()
