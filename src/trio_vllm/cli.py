"""The ``trio-vllm`` command.

Each subcommand lives with the layer it belongs to and is imported only when used,
so ``trio-vllm --help`` stays fast and needs neither torch nor a running engine.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ._version import __version__

if TYPE_CHECKING:
    from collections.abc import Sequence


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-vllm",
        description="A trio-native client for vLLM engine-core processes.",
    )
    parser.add_argument("--version", action="version", version=f"trio-vllm {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    wire = commands.add_parser("wire", help="wire-protocol tools")
    wire_commands = wire.add_subparsers(dest="wire_command", metavar="WIRE_COMMAND", required=True)
    check = wire_commands.add_parser(
        "check",
        help="check the codec against folders of captured wire vectors",
        description=(
            "Decode every engine->client vector and compare with its value; build every "
            "client->engine message from its value and compare the encoded bytes exactly. "
            "Prints one line per failing vector and a final 'N passed, M failed'."
        ),
    )
    check.add_argument("dirs", nargs="+", metavar="DIR", help="folder of *.json wire vectors")
    check.add_argument("-v", "--verbose", action="store_true", help="also list passing vectors")

    from ._cli_generate import add_generate_parser

    add_generate_parser(commands)

    from .bench import add_bench_parser

    add_bench_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status."""
    args = _build_parser().parse_args(argv)
    if args.command == "wire" and args.wire_command == "check":
        from ._wirecheck import run_wire_check

        return run_wire_check(args.dirs, verbose=args.verbose)
    if args.command == "generate":
        from ._cli_generate import run_generate

        return run_generate(args)
    if args.command == "bench":
        from .bench import run_bench

        return run_bench(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse enforces choices


if __name__ == "__main__":
    sys.exit(main())
