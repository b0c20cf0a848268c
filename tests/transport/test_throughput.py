"""Volume and idle cost: 10^6 messages end to end, and no CPU while waiting."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from typing import Any

import anyio
import pytest
import zmq

from trio_vllm.transport import AsyncSocket

N_MESSAGES = 1_000_000

SENDER = textwrap.dedent(
    """
    import struct, sys, zmq
    endpoint, n = sys.argv[1], int(sys.argv[2])
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDTIMEO, 60_000)
    push.connect(endpoint)
    pack, send = struct.Struct("<Q").pack, push.send
    for i in range(n):
        send(pack(i))
    # Stay connected until the receiver has everything: libzmq drops what the
    # receiving side has not yet taken in when the peer disconnects while the
    # receiver is at its high-water mark (a plain blocking receiver sees it too).
    sys.stdin.readline()
    push.close(linger=0)
    ctx.term()
    """
)


@pytest.mark.anyio
@pytest.mark.slow
async def test_one_million_messages_end_to_end(ctx: zmq.Context[Any]) -> None:
    """A PUSH sender in another process, receive_batch here: every message, in order."""
    unpack = struct.Struct("<Q").unpack
    with AsyncSocket.create(ctx, zmq.PULL) as pull:
        endpoint = pull.bind_ipc()
        proc = await anyio.open_process(
            [sys.executable, "-c", SENDER, endpoint, str(N_MESSAGES)],
            stdin=subprocess.PIPE,
            stdout=None,
            stderr=None,
        )
        try:
            expected = 0
            with anyio.fail_after(90):
                while expected < N_MESSAGES:
                    for message in await pull.receive_batch(256):
                        if unpack(message[0])[0] != expected:
                            pytest.fail(f"got {unpack(message[0])[0]} where {expected} was due")
                        expected += 1
            assert proc.stdin is not None
            await proc.stdin.send(b"done\n")
            with anyio.fail_after(30):
                assert await proc.wait() == 0
        finally:
            if proc.returncode is None:
                proc.kill()
            with anyio.CancelScope(shield=True):
                await proc.aclose()
    assert expected == N_MESSAGES


IDLE_PROBE = textwrap.dedent(
    """
    import json, sys, time
    import anyio, zmq
    from trio_vllm.transport import AsyncSocket

    async def main():
        ctx = zmq.Context()
        with AsyncSocket.create(ctx, zmq.PULL) as pull:
            endpoint = pull.bind_ipc()
            peer = ctx.socket(zmq.PUSH)  # a connected, silent peer
            peer.connect(endpoint)
            await anyio.sleep(0.2)
            cpu0, wall0 = time.process_time(), time.monotonic()
            with anyio.move_on_after(3.0):
                await pull.receive()
            cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
            peer.close(linger=0)
        ctx.term()
        print(json.dumps({"cpu": cpu, "wall": wall}))

    backend, options = sys.argv[1], {}
    if sys.argv[2] == "uvloop":
        import uvloop
        options["loop_factory"] = uvloop.new_event_loop
    anyio.run(main, backend=backend, backend_options=options)
    """
)


def test_idle_cpu_while_waiting_on_an_idle_socket() -> None:
    """A process waiting 3 s on an idle socket uses < 20 ms CPU (trio, asyncio, uvloop).

    The three probes run at the same time, each in its own process, and measure
    process CPU time (all threads, libzmq's I/O thread included).
    """
    variants = [("trio", "-"), ("asyncio", "-")]
    try:
        import uvloop  # noqa: F401
    except ImportError:  # pragma: no cover
        pass
    else:
        variants.append(("asyncio", "uvloop"))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", IDLE_PROBE, backend, loop],
            stdout=subprocess.PIPE,
            text=True,
        )
        for backend, loop in variants
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        results.append(json.loads(out))
    for (backend, loop), result in zip(variants, results, strict=True):
        assert result["wall"] >= 2.9, (backend, loop, result)
        assert result["cpu"] < 0.020, f"{backend}/{loop} used {result['cpu'] * 1e3:.1f} ms CPU"
