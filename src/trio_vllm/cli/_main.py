"""The ``trio-vllm`` command's parser and error handling (``trio_vllm.cli.main`` runs it).

Kept out of the package's ``__init__``: ``main`` must be inside its Ctrl-C handler before
this module's own imports run (see the package documentation).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
import textwrap
from typing import TYPE_CHECKING, NamedTuple

from .._version import __version__

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

__all__ = ["run"]


class _Subcommand(NamedTuple):
    module: str  # relative to this package
    add: str = "add_parser"  # add(subparsers) -> None
    run: str = "run"  # run(args: argparse.Namespace) -> int


# Order is the order of ``trio-vllm --help``.
_SUBCOMMANDS: tuple[_Subcommand, ...] = (
    _Subcommand("._wire"),
    _Subcommand("._generate", "add_generate_parser", "run_generate"),
    _Subcommand("._serve"),
    _Subcommand("._bench"),
    _Subcommand("._model"),
)

# ``literal``, `target` and `name` in docstring-derived texts.
_REST = re.compile(r"``([^`]+)``|:[a-z]+:`(~?)([^`<]+?)(?:\s*<[^>]*>)?`")


def _plain(text: str) -> str:
    def sub(match: re.Match[str]) -> str:
        if match.group(1) is not None:
            return match.group(1)
        target = match.group(3)
        return target.rsplit(".", 1)[-1] if match.group(2) else target

    return _REST.sub(sub, text)


class _PlainFormatter(argparse.HelpFormatter):
    """Help as plain text: reST markup removed, prose paragraphs re-wrapped to the
    terminal, blocks with indented lines (examples) kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for para in re.split(r"\n[ \t]*\n", _plain(text).strip("\n")):
            lines = para.splitlines()
            if any(line[:1].isspace() for line in lines[1:]):
                paragraphs.append("\n".join(indent + line for line in lines))
            else:
                paragraphs.append(
                    textwrap.fill(
                        " ".join(para.split()),
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent,
                        break_on_hyphens=False,  # never split an option name
                    )
                )
        return "\n\n".join(paragraphs)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(_plain(text).split()), width, break_on_hyphens=False)


def _walk(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    seen: set[int] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                if id(sub) not in seen:  # aliases share a parser
                    seen.add(id(sub))
                    yield from _walk(sub)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-vllm",
        description="A trio-native client for vLLM engine-core processes.",
    )
    parser.add_argument("--version", action="version", version=f"trio-vllm {__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        dest="log_verbosity",  # not "verbose": subcommands have their own -v
        help="log to stderr: -v for INFO (engine output included), -vv for DEBUG",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        metavar="LEVEL",
        help="log the trio_vllm loggers at LEVEL (debug, info, warning, error) to stderr",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for sub in _SUBCOMMANDS:
        module = importlib.import_module(sub.module, __package__)
        before = set(commands.choices)
        getattr(module, sub.add)(commands)
        run: Callable[[argparse.Namespace], int] = getattr(module, sub.run)
        for name in set(commands.choices) - before:
            commands.choices[name].set_defaults(cli_run=run)
    for p in _walk(parser):
        p.formatter_class = _PlainFormatter
        # The deepest parser wins: its defaults are applied last.
        p.set_defaults(cli_parser=p)
    return parser


def _configure_logging(args: argparse.Namespace) -> logging.Handler | None:
    level = args.log_level or {0: None, 1: "INFO"}.get(args.log_verbosity, "DEBUG")
    if level is None:
        return None
    handler = logging.StreamHandler(sys.stderr)
    # On a terminal, clear a progress line (written with \r and no newline) first.
    clear = "\r\x1b[K" if sys.stderr.isatty() else ""
    handler.setFormatter(
        logging.Formatter(
            clear + "%(asctime)s.%(msecs)03d %(name)s %(levelname)s: %(message)s", "%H:%M:%S"
        )
    )
    log = logging.getLogger("trio_vllm")
    log.addHandler(handler)
    log.setLevel(level)
    return handler


def _unwrap(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _silence_stdout() -> None:
    # What is still buffered would fail again when the interpreter flushes at exit.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _before_command(argv: Sequence[str] | None, command: str, extra: Sequence[str]) -> bool:
    """Whether an unrecognized argument comes before the subcommand's name in ``argv``."""
    words = list(sys.argv[1:] if argv is None else argv)
    at = next(
        (
            i
            for i, w in enumerate(words)
            if w == command and (i == 0 or words[i - 1] != "--log-level")
        ),
        len(words),
    )
    return any(word in extra for word in words[:at])


def run(argv: Sequence[str] | None) -> int:
    """Parse ``argv`` and run its subcommand; returns the exit status. A
    ``KeyboardInterrupt`` propagates (``main`` turns it into 130)."""
    parser = _build_parser()
    prog = parser.prog
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            # argparse hands back the top level's unknown options with the subcommand's:
            # blame the parser whose part of the command line holds the first one.
            blamed = parser if _before_command(argv, args.command, extra) else args.cli_parser
            blamed.error(f"unrecognized arguments: {' '.join(extra)}")
        prog = args.cli_parser.prog
        # serve --api-server-count N starts N copies of this command line.
        args.cli_argv = list(sys.argv[1:] if argv is None else argv)
        handler = _configure_logging(args)
        try:
            status: int = args.cli_run(args)
        finally:
            if handler is not None:
                from .._log import flush_engine_logs

                flush_engine_logs(1.0)
                # main() may run again in this process (tests, an embedding program).
                log = logging.getLogger("trio_vllm")
                log.removeHandler(handler)
                log.setLevel(logging.NOTSET)
        sys.stdout.flush()
    except BaseException as raised:
        error = _unwrap(raised)
        if isinstance(error, KeyboardInterrupt):
            raise error from None
        if isinstance(error, BrokenPipeError):
            _silence_stdout()  # the reader went away (`| head`): not an error
            return 0
        if isinstance(error, OSError):
            # Most often the output: a full disk, a broken device.
            _silence_stdout()
            where = f": {error.filename}" if error.filename else ""
            sys.stderr.write(f"{prog}: error: {error.strerror or error}{where}\n")
            return 1
        raise
    return status
