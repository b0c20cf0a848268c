"""The ``trio-vllm`` command.

Each subcommand is a private module of this package with two functions: one that adds
its parser to the subparsers object and one that runs it and returns the exit status.
The modules import only the standard library at the top, so ``trio-vllm --help`` stays
fast and needs neither torch nor a running engine; what a command needs is imported
when it runs.

Adding a subcommand is one line in ``_SUBCOMMANDS`` (in ``_main``).

``main`` turns what a user can cause into one line on stderr and an exit status: a
usage error (2, with the usage of the subcommand at fault), an output that cannot be
written (1; a closed pipe exits 0 quietly), Ctrl-C at any moment (130, quietly).

That includes Ctrl-C while the command is still importing: ``import trio_vllm`` loads
only a few pure-Python modules (everything else is loaded on first use), and this
module none, so the console script (``from trio_vllm.cli import main``) reaches
``main``'s handler within a couple of milliseconds; argparse, the subcommands and what
they need are imported inside it.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not from typing: see trio_vllm/__init__.py
if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["main"]

_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status."""
    try:
        from ._main import run

        return run(argv)
    except KeyboardInterrupt:
        return _INTERRUPTED
