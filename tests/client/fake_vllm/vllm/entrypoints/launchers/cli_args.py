"""Stand-in for tests: the arguments VllmEngines passes."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", required=True)
    parser.add_argument("--data-parallel-address", required=True)
    parser.add_argument("--data-parallel-rpc-port", type=int, required=True)
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--data-parallel-size-local", type=int, default=1)
    parser.add_argument("--data-parallel-start-rank", type=int, default=0)
    parser.add_argument("--api-server-count", type=int, default=0)
    parser.add_argument("--headless", action="store_true")
    parser.add_argument("--engine-arg", action="append", default=[])
    # A stand-in for an engine core's shared memory (see serve.py).
    parser.add_argument("--fake-shm", default=None)
    return parser
