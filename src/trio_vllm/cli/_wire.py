"""``trio-vllm wire check``: the codec against folders of captured wire vectors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import argparse

__all__ = ["add_parser", "run"]


def add_parser(commands: Any) -> None:
    """Add the ``wire`` subcommand to the ``trio-vllm`` subparsers ``commands``."""
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


def run(args: argparse.Namespace) -> int:
    """Run ``trio-vllm wire check``; returns the exit status."""
    from .._wirecheck import run_wire_check

    return run_wire_check(args.dirs, verbose=args.verbose)
