"""Stand-in for tests: ``run_headless`` runs reference engines as vLLM's launcher would.

One engine process per local rank (``--data-parallel-start-rank`` upward), each doing
the headless handshake with ``tcp://ADDRESS:RPC_PORT``; the launcher waits for them
and stops them on SIGTERM, like ``vllm serve --headless``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any


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

    def stop(signum: int, frame: object) -> None:
        for engine in engines:
            engine.terminate()

    signal.signal(signal.SIGTERM, stop)
    codes = [engine.wait() for engine in engines]
    sys.exit(max(codes))
