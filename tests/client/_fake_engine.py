"""A minimal scripted engine for client protocol-violation tests (plain pyzmq + msgspec).

Not a model: it does the headless handshake of PROTOCOL.md §2.3 exactly, then answers
ADD with one token per step (the prompt, cycled) and utilities ``echo`` (returns its
args), ``sleep_ms`` (deferred reply), ``fail`` (failure message). Faults it can inject
that the reference engine does not: a wrong ``engine_index``, an output frame that is
valid msgpack of the wrong shape, a second unsolicited ready response, exit before
HELLO. Run as ``python _fake_engine.py HANDSHAKE_ADDR RANK [FAULT [N]]``.
"""

from __future__ import annotations

import sys
import time

import msgspec
import zmq

FIELDS_0_32 = 18


def output(rid: str, tokens: list[int], finish: int | None) -> list[object]:
    out: list[object] = [None] * FIELDS_0_32
    out[0], out[1], out[5], out[13] = rid, tokens, finish, 0
    return out


def outputs(rank: int, outs: list[object], utility: object = None) -> bytes:
    return msgspec.msgpack.encode(
        [rank, outs, None, time.monotonic(), utility, None, None, None, "default"]
    )


def main() -> None:
    address, rank = sys.argv[1], int(sys.argv[2])
    fault = sys.argv[3] if len(sys.argv) > 3 else ""
    fault_n = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    if fault == "ignore-sigterm":
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if fault == "exit-before-hello":
        print("fake engine: failing before HELLO", file=sys.stderr, flush=True)
        sys.exit(7)
    ctx = zmq.Context()
    identity = rank.to_bytes(2, "little")
    hs = ctx.socket(zmq.DEALER)
    hs.setsockopt(zmq.IDENTITY, 2 * identity if fault == "bad-identity" else identity)
    hs.setsockopt(zmq.LINGER, 5000)
    hs.connect(address)
    hs.send(msgspec.msgpack.encode({"status": "HELLO", "local": False, "headless": True}))
    init = msgspec.msgpack.decode(hs.recv())
    inp = ctx.socket(zmq.DEALER)
    inp.setsockopt(zmq.IDENTITY, identity)
    inp.connect(init["addresses"]["inputs"][0])
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 4000)
    out.connect(init["addresses"]["outputs"][0])
    ready_response = {"max_model_len": 256, "vllm_version": "0.32.0", "data_parallel_rank": rank}
    inp.send(msgspec.msgpack.encode(ready_response))
    if fault == "hang-before-ready":
        time.sleep(3600)
    hs.send(msgspec.msgpack.encode({"status": "READY", "local": False, "headless": True}))
    hs.close()
    print("fake engine ready", flush=True)

    running: dict[str, list[int]] = {}  # id -> [pos, max_tokens, *prompt]
    deferred: list[tuple[float, bytes]] = []
    steps = 0
    while True:
        while inp.poll(0 if running else 5):
            frames = inp.recv_multipart()
            kind, body = frames[0], msgspec.msgpack.decode(frames[1])
            if kind == b"\x00":
                running[body[0]] = [0, body[3].get("max_tokens", 16), *body[1]]
            elif kind == b"\x01":
                for rid in body:
                    running.pop(rid, None)
            elif kind == b"\x03":
                _, call_id, method, args = body
                if method == "echo":
                    out.send(outputs(rank, [], [call_id, None, [None, args]]))
                elif method == "sleep_ms":
                    reply = outputs(rank, [], [call_id, None, [None, args[0]]])
                    deferred.append((time.monotonic() + args[0] / 1000, reply))
                else:
                    msg = f"Call to {method} method failed: no"
                    out.send(outputs(rank, [], [call_id, msg, None]))
        now = time.monotonic()
        for item in [d for d in deferred if d[0] <= now]:
            deferred.remove(item)
            out.send(item[1])
        if not running:
            continue
        steps += 1
        if fault == "garbage" and steps == fault_n:
            out.send(b"\xc1 not msgpack")
        if fault == "wrong-shape" and steps == fault_n:
            out.send(msgspec.msgpack.encode({"engine_index": rank}))
        if fault == "bad-index" and steps == fault_n:
            out.send(outputs(rank + 7, []))
        if fault == "dead" and steps == fault_n:
            out.send(b"ENGINE_CORE_DEAD")
            time.sleep(0.2)
            sys.exit(1)
        if fault == "rogue" and steps == fault_n:
            rogue = ctx.socket(zmq.DEALER)
            rogue.setsockopt(zmq.IDENTITY, b"\x09\x00")
            rogue.connect(init["addresses"]["inputs"][0])
            rogue.send(msgspec.msgpack.encode(ready_response))
        if fault == "second-ready" and steps == fault_n:
            inp.send(msgspec.msgpack.encode(ready_response))
        if fault == "flush-exit" and steps == fault_n:
            inp.close(linger=0)
            out.close(linger=4000)  # every output sent so far leaves the process
            ctx.term()
            sys.exit(5)
        if fault == "exit" and steps == fault_n:
            sys.exit(5)
        batch: list[object] = []
        for rid, state in list(running.items()):
            pos, max_tokens, prompt = state[0], state[1], state[2:]
            token = prompt[pos % len(prompt)]
            state[0] += 1
            finish = 1 if state[0] >= max_tokens else None
            batch.append(output(rid, [token], finish))
            if finish is not None:
                del running[rid]
        out.send(outputs(rank, batch))
        time.sleep(0.002)


if __name__ == "__main__":
    main()
