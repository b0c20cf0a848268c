"""Reference engine throughput: how fast it produces output messages, against an anchor.

A blocking pyzmq PULL receiver (no decoding) counts messages for ``--seconds`` from:

* ``anchor``: a separate process that sends one pre-encoded message of the same shape
  in a tight ``send_multipart`` loop (the ceiling for one sender process and this
  receiver on this machine);
* ``firehose BATCH``: the reference engine with ``--firehose BATCH`` (one request, BATCH
  one-token outputs per message, scheduler stats attached);
* ``decode B``: the reference engine's real path (scheduler + echo model + sampler) with
  B concurrent greedy requests, one message per step carrying B outputs.

Prints messages/s, outputs/s and ``ratio = engine / anchor`` for the same message shape
(higher is better; 1.0 = as fast as a bare sender). Not a test: nothing here asserts.

    python bench/bench_reference_engine.py [--seconds S] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import zmq

from trio_vllm.protocol import (
    ClientCodec,
    EngineCodec,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineHandshakeMetadata,
    EngineZmqAddresses,
    SamplingParams,
    SchedulerStats,
    encode_handshake_metadata,
    profile_for_version,
)
from trio_vllm.protocol.structs import PrefixCacheStats

_ANCHOR = """
import sys, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.PUSH)
sock.connect(sys.argv[1])
frame = sys.stdin.buffer.read()
while True:
    sock.send(frame)
"""


def _addr() -> str:
    return f"ipc://{tempfile.gettempdir()}/tv-bench-ref-{uuid.uuid4().hex[:12]}"


def _count(sock: zmq.Socket[bytes], seconds: float) -> tuple[int, int]:
    """Messages received in ``seconds`` after the first one, and bytes of the last."""
    if not sock.poll(30_000):
        raise TimeoutError("no message within 30 s")
    last = sock.recv_multipart(copy=False)
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        last = sock.recv_multipart(copy=False)
        n += 1
    return n, sum(len(f.bytes) for f in last)


def _sample_message(batch: int) -> bytes:
    outs = EngineCoreOutputs(
        0,
        [EngineCoreOutput("req-1", [104]) for _ in range(batch)],
        SchedulerStats(
            num_running_reqs=1,
            step_counter=7,
            kv_cache_usage=0.01,
            prefix_cache_stats=PrefixCacheStats(),
        ),
        weight_version="default",
    )
    frames = EngineCodec(profile_for_version("0.32.0")).encode_outputs(outs)
    return bytes(frames[0])


def run_anchor(batch: int, seconds: float) -> dict[str, Any]:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    addr = _addr()
    pull.bind(addr)
    proc = subprocess.Popen([sys.executable, "-c", _ANCHOR, addr], stdin=subprocess.PIPE)
    try:
        assert proc.stdin is not None
        proc.stdin.write(_sample_message(batch))
        proc.stdin.close()
        n, size = _count(pull, seconds)
    finally:
        proc.kill()
        proc.wait()
        pull.close()
        ctx.term()
        with contextlib.suppress(OSError):
            os.unlink(addr[len("ipc://") :])
    return {"msgs_per_s": n / seconds, "outputs_per_s": n * batch / seconds, "bytes": size}


def run_engine(args: list[str], requests: int, batch: int, seconds: float) -> dict[str, Any]:
    ctx = zmq.Context()
    socks = {kind: ctx.socket(kind) for kind in (zmq.ROUTER, zmq.PULL)}
    hs = ctx.socket(zmq.ROUTER)
    addrs = {}
    for name, sock in (("in", socks[zmq.ROUTER]), ("out", socks[zmq.PULL]), ("hs", hs)):
        sock.setsockopt(zmq.LINGER, 0)
        addrs[name] = _addr()
        sock.bind(addrs[name])
    cmd = [
        sys.executable,
        "-m",
        "trio_vllm.reference_engine",
        "--model",
        "echo",
        "--handshake-address",
        addrs["hs"],
        "--max-model-len",
        "100000000",
        *args,
    ]
    proc = subprocess.Popen(cmd)
    codec = ClientCodec(profile_for_version("0.32.0"))
    try:
        if not hs.poll(30_000):
            raise TimeoutError("no HELLO")
        ident, _ = hs.recv_multipart()
        hs.send_multipart(
            [
                ident,
                encode_handshake_metadata(
                    EngineHandshakeMetadata(EngineZmqAddresses([addrs["in"]], [addrs["out"]]))
                ),
            ]
        )
        inp = socks[zmq.ROUTER]
        if not inp.poll(30_000):
            raise TimeoutError("no ready response")
        inp.recv_multipart()
        for i in range(requests):
            req = EngineCoreRequest(
                f"bench-{i}",
                prompt_token_ids=list(b"hello world"),
                sampling_params=SamplingParams(max_tokens=10**9, temperature=0.0),
            )
            inp.send_multipart([ident, *codec.encode_add(req)])
        n, size = _count(socks[zmq.PULL], seconds)
    finally:
        proc.kill()
        proc.wait()
        for sock in (*socks.values(), hs):
            sock.close()
        ctx.term()
        for address in addrs.values():
            with contextlib.suppress(OSError):
                os.unlink(address[len("ipc://") :])
    return {"msgs_per_s": n / seconds, "outputs_per_s": n * batch / seconds, "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    cases = [
        ("firehose 1", ["--firehose", "1"], 1, 1),
        ("firehose 64", ["--firehose", "64"], 1, 64),
        ("decode 1", [], 1, 1),
        ("decode 64", ["--max-num-seqs", "64"], 64, 64),
    ]
    results = []
    anchors: dict[int, dict[str, Any]] = {}
    for name, args, requests, batch in cases:
        if batch not in anchors:
            anchors[batch] = run_anchor(batch, opts.seconds)
        engine = run_engine(args, requests, batch, opts.seconds)
        anchor = anchors[batch]
        results.append(
            {
                "case": name,
                "engine_msgs_per_s": round(engine["msgs_per_s"]),
                "engine_outputs_per_s": round(engine["outputs_per_s"]),
                "anchor_msgs_per_s": round(anchor["msgs_per_s"]),
                "message_bytes": engine["bytes"],
                "ratio": engine["msgs_per_s"] / anchor["msgs_per_s"],
            }
        )
    if opts.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"{'case':<14}{'engine msg/s':>14}{'outputs/s':>12}{'anchor msg/s':>14}"
        f"{'bytes':>8}{'ratio':>8}"
    )
    for r in results:
        print(
            f"{r['case']:<14}{r['engine_msgs_per_s']:>14}{r['engine_outputs_per_s']:>12}"
            f"{r['anchor_msgs_per_s']:>14}{r['message_bytes']:>8}{r['ratio']:>8.2f}"
        )


if __name__ == "__main__":
    main()
