"""``trio-vllm model write DIR``: a copy of a model directory shipped with the package.

The docs' examples that need a real model directory (a stock vLLM engine, a tokenizer
other than the reference engine's bytes) use ``./tiny-llama``; this command writes it, so
they run with the package alone.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import argparse

__all__ = ["add_parser", "run"]

_MODELS = ("tiny-llama", "trio-vllm-reference")


def _source(name: str) -> Path:
    from ..reference_engine import MODEL_DIR, TINY_LLAMA_DIR

    return Path(TINY_LLAMA_DIR if name == "tiny-llama" else MODEL_DIR)


def add_parser(commands: Any) -> None:
    """Add the ``model`` subcommand to the ``trio-vllm`` subparsers ``commands``."""
    model = commands.add_parser("model", help="model directories shipped with trio-vllm")
    model_commands = model.add_subparsers(
        dest="model_command", metavar="MODEL_COMMAND", required=True
    )
    write = model_commands.add_parser(
        "write",
        help="write a shipped model directory (default tiny-llama) into DIR",
        description=(
            "Copy a model directory shipped with trio-vllm into DIR (created if missing): "
            "tiny-llama (config.json with no weights, a 512-token BPE tokenizer.json, "
            "tokenizer_config.json with its chat template, generation_config.json; stock "
            "vLLM serves it with --load-format dummy) or trio-vllm-reference (the reference "
            "engine's byte-level vocabulary). Existing files are not overwritten unless "
            "--force is given. Prints the directory's path."
        ),
    )
    write.add_argument("dir", metavar="DIR", help="directory to write (e.g. ./tiny-llama)")
    write.add_argument(
        "--name", choices=_MODELS, default="tiny-llama", help="which model (default tiny-llama)"
    )
    write.add_argument("--force", action="store_true", help="overwrite existing files")


def run(args: argparse.Namespace) -> int:
    """Run ``trio-vllm model write``; returns the exit status (2 if a file exists)."""
    source = _source(args.name)
    out = Path(args.dir)
    names = sorted(p.name for p in source.iterdir() if p.is_file())
    existing = [name for name in names if (out / name).exists()]
    if existing and not args.force:
        args.cli_parser.error(f"{out / existing[0]} exists (--force overwrites it)")
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(source / name, out / name)
    sys.stdout.write(f"{out}\n")
    return 0
