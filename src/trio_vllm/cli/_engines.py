"""The engine choice shared by ``trio-vllm generate`` and ``trio-vllm serve``.

Three kinds of engines, one set of options: the bundled reference engine (default;
``--model echo|tiny`` or a model directory, ``--reference-model``), stock vLLM engine
cores spawned with another python (``--engine vllm --model M --vllm-python PY``), or
engines started elsewhere that connect to ``--connect tcp://HOST:PORT``. `engine_plan`
checks the arguments before anything starts; `engine_source` builds the source.
Standard library only at the top (see the package documentation).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

    from ..client import EngineSource

__all__ = [
    "REFERENCE_MODELS",
    "EnginePlan",
    "UsageError",
    "add_engine_arguments",
    "engine_plan",
    "engine_source",
]

REFERENCE_MODELS = ("echo", "tiny")


class UsageError(Exception):
    """A bad argument: the subcommand prints it after its name and exits 2."""


@dataclass(frozen=True)
class EnginePlan:
    """What the engine options mean, checked before anything starts."""

    # The model directory: tokenizer, chat template, generation config. None with
    # --connect and no --model: engines started elsewhere, whose model is unknown here.
    model_dir: str | None
    reference_model: str | None  # None: not the reference engine
    engine_args: list[str]  # --engine-args, split


def add_engine_arguments(
    parser: argparse.ArgumentParser, *, model_help: str, engine_args_help: str
) -> argparse._ArgumentGroup:
    """Add the "engines" option group to ``parser``; returns the group."""
    e = parser.add_argument_group("engines")
    e.add_argument(
        "--engine",
        choices=("reference", "vllm"),
        default="reference",
        help="spawn the bundled reference engine (default) or stock vLLM",
    )
    e.add_argument("--model", default=None, help=model_help)
    e.add_argument(
        "--reference-model",
        choices=REFERENCE_MODELS,
        default=None,
        help="the reference engine's model when --model is a directory (default echo)",
    )
    e.add_argument("--vllm-python", metavar="PY", help="python with vLLM (--engine vllm)")
    e.add_argument("--engine-args", default="", metavar="ARGS", help=engine_args_help)
    e.add_argument(
        "--connect",
        metavar="tcp://HOST:PORT",
        help="bind this handshake address and wait for engines started elsewhere",
    )
    e.add_argument("--engines", type=int, default=1, metavar="N", help="engine count")
    e.add_argument(
        "--advertise-host",
        metavar="HOST",
        help="with --connect on a wildcard address: the host engines reach us at",
    )
    e.add_argument(
        "--ready-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds to wait for engines (default: VLLM_ENGINE_READY_TIMEOUT_S or 600)",
    )
    return e


def engine_plan(args: argparse.Namespace) -> EnginePlan:
    """Check the engine options; raises `UsageError`."""
    from ..reference_engine import MODEL_DIR

    if args.engines < 1:
        raise UsageError("--engines must be at least 1")
    try:
        engine_args = shlex.split(args.engine_args)
    except ValueError as exc:
        raise UsageError(f"--engine-args: {exc}") from None
    if args.connect is not None:
        if args.engine != "reference" or args.reference_model is not None:
            raise UsageError(
                "--connect waits for engines started elsewhere: drop --engine and "
                "--reference-model (--model DIR still names the tokenizer)"
            )
        # No bundled tokenizer stands in for an engine this process knows nothing of.
        return EnginePlan(args.model, None, engine_args)
    if args.engine == "vllm":
        if not args.model:
            raise UsageError("--engine vllm needs --model (a path or name, as for vllm serve)")
        if not args.vllm_python:
            raise UsageError("--engine vllm needs --vllm-python, a python with vLLM installed")
        return EnginePlan(args.model, None, engine_args)
    model = args.model or "echo"
    if model in REFERENCE_MODELS and not os.path.isdir(model):
        if args.reference_model is not None:
            raise UsageError("--reference-model goes with --model DIR")
        return EnginePlan(MODEL_DIR, model, engine_args)
    if not os.path.isdir(model):
        raise UsageError(
            f"the reference engine has models echo and tiny, or give a model directory: "
            f"{model!r} is neither"
        )
    return EnginePlan(model, args.reference_model or "echo", engine_args)


def engine_source(args: argparse.Namespace, plan: EnginePlan) -> EngineSource:
    """The engine source the options and ``plan`` describe (nothing starts yet);
    raises `UsageError` for a bad ``--connect`` address."""
    from ..client import ExternalEngines, ReferenceEngines, VllmEngines
    from ..reference_engine import MODEL_DIR

    if args.connect is not None:
        try:
            return ExternalEngines(
                args.connect, count=args.engines, advertise_host=args.advertise_host
            )
        except ValueError as exc:
            raise UsageError(f"--connect: {exc}") from None
    if args.engine == "vllm":
        return VllmEngines(
            args.model, python=args.vllm_python, extra_args=plan.engine_args, count=args.engines
        )
    assert plan.reference_model is not None
    assert plan.model_dir is not None  # engine_plan's: the reference engine's directory
    extra = list(plan.engine_args)
    if plan.model_dir != MODEL_DIR:
        extra = ["--model-dir", plan.model_dir, *extra]
    return ReferenceEngines(args.engines, model=plan.reference_model, extra_args=extra)
