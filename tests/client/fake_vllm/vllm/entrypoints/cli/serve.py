"""Stand-in for tests: ``run_headless`` runs reference engines as vLLM's launcher would.

One engine process per local rank (``--data-parallel-start-rank`` upward), each doing
the headless handshake with ``tcp://ADDRESS:RPC_PORT``; the launcher waits for them
and stops them on SIGTERM, like ``vllm serve --headless``.

``--fake-shm NAME`` models what stock vLLM (CPU) does with its engine cores' shared
memory: a ``multiprocessing`` spawn child creates the POSIX segment ``NAME`` (so the
launcher's resource tracker has it registered); on SIGTERM the launcher SIGKILLs that
child at once (vLLM's ``shutdown_timeout`` 0), so only the tracker can unlink it; and
the launcher's interpreter teardown is slow (an atexit handler sleeps a minute).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from multiprocessing import shared_memory
from typing import Any


def _hold_shared_memory(name: str) -> None:
    segment = shared_memory.SharedMemory(name=name, create=True, size=4096)
    print(f"fake engine core created {segment.name}", flush=True)
    time.sleep(3600)


def run_headless(args: Any) -> None:
    assert args.headless
    address = f"tcp://{args.data_parallel_address}:{args.data_parallel_rpc_port}"
    print(f"fake vllm launcher pid {os.getpid()} model={args.model}", flush=True)
    engines = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trio_vllm.reference_engine",
                "--model",
                "echo",
                "--handshake-address",
                address,
                "--index",
                str(rank),
                *args.engine_arg,
            ]
        )
        for rank in range(
            args.data_parallel_start_rank,
            args.data_parallel_start_rank + args.data_parallel_size_local,
        )
    ]

    holder = None
    if args.fake_shm:
        holder = multiprocessing.get_context("spawn").Process(
            target=_hold_shared_memory, args=(args.fake_shm,)
        )
        holder.start()
        atexit.register(time.sleep, 60)

    def stop(signum: int, frame: object) -> None:
        if holder is not None:
            holder.kill()
            holder.join()
        for engine in engines:
            engine.terminate()

    signal.signal(signal.SIGTERM, stop)
    codes = [engine.wait() for engine in engines]
    sys.exit(max(codes))
