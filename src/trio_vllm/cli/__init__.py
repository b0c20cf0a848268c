"""The ``trio-vllm`` command.

Each subcommand is a private module of this package with two functions: one that adds
its parser to the subparsers object and one that runs it and returns the exit status.
The modules import only the standard library at the top, so ``trio-vllm --help`` stays
fast and needs neither torch nor a running engine; what a command needs is imported
when it runs.

Adding a subcommand is one line in ``_SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
from typing import TYPE_CHECKING, NamedTuple

from .._version import __version__

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["main"]


class _Subcommand(NamedTuple):
    module: str  # relative to this package
    add: str = "add_parser"  # add(subparsers) -> None
    run: str = "run"  # run(args: argparse.Namespace) -> int


# Order is the order of ``trio-vllm --help``.
_SUBCOMMANDS: tuple[_Subcommand, ...] = (
    _Subcommand("._wire"),
    _Subcommand("._generate", "add_generate_parser", "run_generate"),
    _Subcommand("._bench"),
)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-vllm",
        description="A trio-native client for vLLM engine-core processes.",
    )
    parser.add_argument("--version", action="version", version=f"trio-vllm {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for sub in _SUBCOMMANDS:
        module = importlib.import_module(sub.module, __name__)
        before = set(commands.choices)
        getattr(module, sub.add)(commands)
        run: Callable[[argparse.Namespace], int] = getattr(module, sub.run)
        for name in set(commands.choices) - before:
            commands.choices[name].set_defaults(_run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status."""
    args = _build_parser().parse_args(argv)
    status: int = args._run(args)
    return status
