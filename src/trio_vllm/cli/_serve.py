"""``trio-vllm serve``: vLLM's OpenAI-compatible API server, on trio.

The same endpoints, field names and status codes as ``vllm serve``'s API server
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/version``, ``/metrics``), served by hypercorn's trio worker over the text frontend.
Engines as for ``trio-vllm generate``: the bundled reference engine (default), stock
vLLM engine cores (``--engine vllm --vllm-python PY``), or headless engines started
elsewhere that connect to ``--connect tcp://HOST:PORT`` (``--engines N``, data
parallel included).

Exit status: 0 after SIGTERM or Ctrl-C (no new connections, running requests finish
within --shutdown-grace, then the engines stop); 1 when the engines fail to start or die
(every open stream ends with an error event first) unless
--keep-serving-on-engine-death; 2 on bad arguments.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import argparse

    from ..client import EngineSource

__all__ = ["add_parser", "run"]

_REFERENCE_MODELS = ("echo", "tiny")


class _UsageError(Exception):
    pass


def add_parser(commands: Any) -> None:
    """Register ``serve`` on an argparse subparsers object."""
    p = commands.add_parser(
        "serve",
        help="serve vLLM's OpenAI-compatible API (completions, chat) over HTTP",
        description=__doc__,
        epilog=(
            "examples:\n"
            "  trio-vllm serve --port 8000\n"
            "  trio-vllm serve --model ./tiny-llama --reference-model tiny --api-key s3cret\n"
            "  trio-vllm serve --engine vllm --model ./tiny-llama --vllm-python PY \\\n"
            '      --engine-args "--load-format dummy"\n'
            "  trio-vllm serve --model ./tiny-llama --connect tcp://0.0.0.0:29555 "
            "--engines 2 --advertise-host 10.0.0.5"
        ),
    )
    p.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL",
        help="the model, as vllm serve's positional argument (same as --model)",
    )  # fmt: skip
    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    h.add_argument("--port", type=int, default=8000, help="port to bind (default 8000; 0: any)")
    h.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/* (repeatable; default "
        "VLLM_API_KEY)",
    )
    h.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model name(s) clients send; the first is the one responses carry "
        "(default: the model directory's name)",
    )
    h.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        metavar="N",
        help="larger request bodies get HTTP 413 (default 32 MiB)",
    )
    h.add_argument(
        "--shutdown-grace",
        type=float,
        default=None,
        metavar="S",
        help="after SIGTERM: seconds running requests may take before they are cancelled "
        "(default 30)",
    )
    h.add_argument(
        "--keep-serving-on-engine-death",
        action="store_true",
        help="when the engines die keep serving /health (503) and errors instead of "
        "exiting with status 1",
    )
    h.add_argument("--access-log", action="store_true", help="log every request (hypercorn)")
    e = p.add_argument_group("engines")
    e.add_argument(
        "--engine",
        choices=("reference", "vllm"),
        default="reference",
        help="spawn the bundled reference engine (default) or stock vLLM",
    )
    e.add_argument(
        "--model",
        default=None,
        help="the model directory (tokenizer, chat template, generation config); "
        "reference engine: also echo (default) or tiny with its own byte-level tokenizer; "
        "vllm: the model path, as for vllm serve",
    )
    e.add_argument(
        "--reference-model",
        choices=_REFERENCE_MODELS,
        default=None,
        help="the reference engine's model when --model is a directory (default echo)",
    )
    e.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="sampling defaults, as vllm serve's: auto (the model's generation_config.json, "
        "default), vllm (none), or a directory whose generation_config.json also caps "
        "max_tokens",
    )
    e.add_argument(
        "--override-generation-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help='overrides the generation config, e.g. \'{"temperature": 0.5}\'',
    )
    e.add_argument("--vllm-python", metavar="PY", help="python with vLLM (--engine vllm)")
    e.add_argument(
        "--engine-args",
        default="",
        metavar="ARGS",
        help="more engine arguments as one string: `vllm serve`'s with --engine vllm, the "
        'reference engine\'s otherwise (e.g. "--max-num-seqs=256")',
    )
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


def _json_object(text: str) -> dict[str, object]:
    import argparse
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _model_plan(args: argparse.Namespace) -> tuple[str, str | None]:
    """``(model directory for the tokenizer, reference model or None)``."""
    from ..reference_engine import MODEL_DIR

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise _UsageError("give the model once: as MODEL or as --model")
        args.model = args.model_tag
    if args.connect is not None:
        if args.engine != "reference" or args.reference_model is not None:
            raise _UsageError(
                "--connect waits for engines started elsewhere: drop --engine and "
                "--reference-model (--model DIR still names the tokenizer)"
            )
        return (args.model or MODEL_DIR), None
    if args.engine == "vllm":
        if not args.model:
            raise _UsageError("--engine vllm needs --model (a path, as for vllm serve)")
        if not args.vllm_python:
            raise _UsageError("--engine vllm needs --vllm-python, a python with vLLM installed")
        return args.model, None
    model = args.model or "echo"
    if model in _REFERENCE_MODELS and not os.path.isdir(model):
        if args.reference_model is not None:
            raise _UsageError("--reference-model goes with --model DIR")
        return MODEL_DIR, model
    if not os.path.isdir(model):
        raise _UsageError(
            f"the reference engine has models echo and tiny, or give a model directory: "
            f"{model!r} is neither"
        )
    return model, args.reference_model or "echo"


def _engine_source(
    args: argparse.Namespace, model_dir: str, reference_model: str | None
) -> EngineSource:
    from ..client import ExternalEngines, ReferenceEngines, VllmEngines
    from ..reference_engine import MODEL_DIR

    if args.engines < 1:
        raise _UsageError("--engines must be at least 1")
    try:
        engine_args = shlex.split(args.engine_args)
    except ValueError as exc:
        raise _UsageError(f"--engine-args: {exc}") from None
    if args.connect is not None:
        try:
            return ExternalEngines(
                args.connect, count=args.engines, advertise_host=args.advertise_host
            )
        except ValueError as exc:
            raise _UsageError(f"--connect: {exc}") from None
    if args.engine == "vllm":
        return VllmEngines(
            args.model, python=args.vllm_python, extra_args=engine_args, count=args.engines
        )
    assert reference_model is not None
    if model_dir != MODEL_DIR:
        engine_args = ["--model-dir", model_dir, *engine_args]
    return ReferenceEngines(args.engines, model=reference_model, extra_args=engine_args)


def _log_to_stderr(args: argparse.Namespace) -> None:
    # vllm serve logs at INFO by default; so does this, unless -v/--log-level chose.
    if getattr(args, "log_level", None) or getattr(args, "log_verbosity", 0):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    for name in ("trio_vllm.server", "hypercorn.error"):
        log = logging.getLogger(name)
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def run(args: argparse.Namespace) -> int:
    """Run ``trio-vllm serve``; returns the exit status."""
    import trio

    from .._exceptions import EngineStartupError
    from ..server import DEFAULT_MAX_BODY_BYTES, DEFAULT_SHUTDOWN_GRACE
    from ..server._run import run_openai_server

    prog = "trio-vllm serve"
    import importlib.util

    missing = [m for m in ("hypercorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        sys.stderr.write(
            f"{prog}: error: needs {' and '.join(missing)}: pip install 'trio-vllm[serve]'\n"
        )
        return 2
    try:
        model_dir, reference_model = _model_plan(args)
        engines = _engine_source(args, model_dir, reference_model)
        if not 0 <= args.port <= 65535:
            raise _UsageError(f"--port must be in [0, 65535], got {args.port}")
        body_limit = args.max_request_body_bytes or DEFAULT_MAX_BODY_BYTES
        if body_limit < 1:
            raise _UsageError("--max-request-body-bytes must be at least 1")
        grace = DEFAULT_SHUTDOWN_GRACE if args.shutdown_grace is None else args.shutdown_grace
        if grace < 0:
            raise _UsageError("--shutdown-grace must be >= 0")
    except _UsageError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        return 2
    keys = args.api_key or ([os.environ["VLLM_API_KEY"]] if os.environ.get("VLLM_API_KEY") else [])
    _log_to_stderr(args)
    options: dict[str, Any] = {}
    if args.ready_timeout is not None:
        options["ready_timeout"] = args.ready_timeout
    try:
        return trio.run(
            lambda: run_openai_server(
                engines,
                model=model_dir,
                served_model_names=args.served_model_name,
                host=args.host,
                port=args.port,
                api_keys=keys,
                max_body_bytes=body_limit,
                shutdown_grace=grace,
                keep_serving_on_engine_death=args.keep_serving_on_engine_death,
                access_log=args.access_log,
                generation_config=args.generation_config,
                override_generation_config=args.override_generation_config,
                client_options=options,
            )
        )
    except BaseException as raised:
        error = raised
        while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
            error = error.exceptions[0]
        if isinstance(error, EngineStartupError):
            sys.stderr.write(f"{prog}: engines did not start:\n{error}\n")
            return 1
        if isinstance(error, (OSError, ValueError)) and not isinstance(error, BrokenPipeError):
            sys.stderr.write(f"{prog}: error: {error}\n")
            return 1
        if error is not raised:
            raise error from None
        raise
