"""``trio-vllm serve``: vLLM's OpenAI-compatible API server, on trio.

The same endpoints, field names and status codes as ``vllm serve``'s API server
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/version``, ``/metrics``), over the text frontend, served on trio by this package's
HTTP/1.1 server on h11 (or hypercorn's trio worker).
Engines as for ``trio-vllm generate``: the bundled reference engine (default), stock
vLLM engine cores (``--engine vllm --vllm-python PY``), or headless engines started
elsewhere that connect to ``--connect tcp://HOST:PORT`` (``--engines N``, data
parallel included).

--api-server-count N runs N such servers on one listening socket, all sharing the
engines (as vllm serve --api-server-count N; /metrics sums over them).

--backend asyncio runs the same server on asyncio (uvloop), served by uvicorn with
httptools (as vllm serve) or hypercorn's asyncio worker (--http-server hypercorn).

Exit status: 0 after SIGTERM or Ctrl-C (no new connections, running requests finish
within --shutdown-grace, then the engines stop); 1 when the engines fail to start or die
(every open stream ends with an error event first) unless
--keep-serving-on-engine-death; 2 on bad arguments.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from ._engines import EnginePlan, UsageError, add_engine_arguments, engine_plan, engine_source

if TYPE_CHECKING:
    import argparse
    from collections.abc import Awaitable, Callable

    from ..client import ClientOptions, EngineSource
    from ..server._tools import ToolOptions

__all__ = ["add_parser", "run"]


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
        help="require 'Authorization: Bearer KEY' on /v1/* (repeatable; default VLLM_API_KEY)",
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
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="MODULE",
        help="LoRA adapters served as model names: 'name=path' or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\' (as vllm serve; the '
        "engines need LoRA enabled, e.g. --engine-args='--enable-lora ...')",
    )
    h.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a request's own chat_template (chat completions, /tokenize); "
        "without it such a request gets HTTP 400, as from vllm serve",
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
    h.add_argument(
        "--merge-outputs",
        action="store_true",
        help="streaming: send the tokens that piled up while a connection was busy as one "
        "SSE event, as vllm serve does (default: one event per engine output)",
    )
    h.add_argument("--access-log", action="store_true", help="log every request")
    h.add_argument(
        "--backend",
        choices=("trio", "asyncio"),
        default="trio",
        help="the event loop: trio (default) or asyncio (on uvloop; needs 'trio-vllm[asyncio]')",
    )
    h.add_argument(
        "--http-server",
        choices=("h11", "hypercorn", "uvicorn"),
        default=None,
        help="the HTTP/1.1 server: h11 (trio's default; this package's, on h11 over trio "
        "sockets), uvicorn (asyncio's default; with httptools, as vllm serve) or "
        "hypercorn (hypercorn's worker for the backend)",
    )
    t = p.add_argument_group("tool calling and reasoning (as vllm serve)")
    t.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='parse tool calls for tool_choice "auto" (needs --tool-call-parser)',
    )
    t.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help=(
            "the model's tool-call format: hermes, llama3_json, pythonic or mistral "
            "(pre-v11 tokenizers)"
        ),
    )
    t.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="split the model's reasoning into the `reasoning` field: deepseek_r1 or qwen3",
    )
    h.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        metavar="N",
        help="run N API-server processes on one listening socket, all sharing the "
        "engines (as vllm serve --api-server-count; default 1: this process serves)",
    )
    # One server of an --api-server-count group (set by its parent, not by hand).
    import argparse

    for flag, kind in (
        ("--attach-engines", str),
        ("--api-server-index", int),
        ("--listen-fd", int),
        ("--api-server-parent", int),
    ):
        h.add_argument(flag, type=kind, default=None, help=argparse.SUPPRESS)
    e = add_engine_arguments(
        p,
        model_help="the model directory (tokenizer, chat template, generation config); "
        "reference engine: also echo (default) or tiny with its own byte-level tokenizer; "
        "vllm: the model path, as for vllm serve",
        engine_args_help="more engine arguments as one string: `vllm serve`'s with --engine "
        'vllm, the reference engine\'s otherwise (e.g. "--max-num-seqs=256")',
    )
    e.add_argument(
        "--engine-hang-timeout",
        type=float,
        default=None,
        metavar="S",
        help="an engine that leaves heartbeats unanswered S seconds (stopped, frozen, host "
        "or network gone) is dead: open streams end with an error, /health answers 503 "
        "(default 30; 0: no heartbeats)",
    )
    e.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=None,
        metavar="S",
        help="an engine silent S seconds with requests in flight gets a probe; unanswered "
        "S more seconds, it is dead (a stuck loop). Longer than the longest step "
        "(default: off)",
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
        help="overrides the generation config, e.g. '{\"temperature\": 0.5}'",
    )


def _liveness_options(args: argparse.Namespace) -> ClientOptions:
    """``--engine-hang-timeout`` / ``--engine-stall-timeout`` as client options (0:
    off); raises `UsageError` for a value the client would refuse."""
    from ..client._options import resolve_options

    options: ClientOptions = {}
    for flag, key, value in (
        ("--engine-hang-timeout", "hang_timeout", args.engine_hang_timeout),
        ("--engine-stall-timeout", "stall_timeout", args.engine_stall_timeout),
    ):
        if value is None:
            continue
        seconds = None if value == 0 else float(value)
        try:
            resolve_options({key: seconds})
        except (TypeError, ValueError) as exc:
            raise UsageError(f"{flag}: {exc} (0: off)") from None
        options[key] = seconds  # type: ignore[literal-required]  # key is one of the two
    return options


def _tool_options(args: argparse.Namespace) -> ToolOptions:
    """The tool/reasoning flags; `UsageError` as vllm serve refuses to start."""
    from ..server._tools import ToolOptions

    try:
        return ToolOptions(
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


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


def _engine_plan(args: argparse.Namespace) -> EnginePlan:
    """The engine options, with vllm serve's positional MODEL as ``--model``."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise UsageError("give the model once: as MODEL or as --model")
        args.model = args.model_tag
    return engine_plan(args)


def _log_to_stderr(args: argparse.Namespace) -> None:
    # vllm serve logs at INFO by default; so does this, unless -v/--log-level chose.
    if getattr(args, "log_level", None) or getattr(args, "log_verbosity", 0):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    # The HTTP servers' access logs (--access-log) at INFO; uvicorn's INFO lines
    # ("Waiting for connections to close. (CTRL+C to force quit)") do not fit this
    # command's shutdown (run_openai_server logs it): its warnings and errors only.
    for name, level in (
        ("trio_vllm.server", logging.INFO),
        ("hypercorn.error", logging.INFO),
        ("hypercorn.access", logging.INFO),
        ("uvicorn.error", logging.WARNING),
        ("uvicorn.access", logging.INFO),
    ):
        log = logging.getLogger(name)
        log.addHandler(handler)
        log.setLevel(level)
        log.propagate = False


# What `--backend asyncio` imports: uvloop always, uvicorn with httptools to serve.
_ASYNCIO_EXTRA = "pip install 'trio-vllm[asyncio]'"


def _http_server(args: argparse.Namespace) -> str:
    """``--http-server`` for ``--backend``: its default, or `UsageError`."""
    import importlib.util

    trio_backend = args.backend == "trio"
    server: str = args.http_server or ("h11" if trio_backend else "uvicorn")
    if server == "h11" and not trio_backend:
        raise UsageError(
            "--http-server h11 runs on --backend trio only (asyncio: uvicorn or hypercorn)"
        )
    if server == "uvicorn" and trio_backend:
        raise UsageError(
            "--http-server uvicorn runs on --backend asyncio only (trio: h11 or hypercorn)"
        )
    if not trio_backend:
        needed = ("uvloop", *(("uvicorn", "httptools") if server == "uvicorn" else ()))
        missing = [m for m in needed if importlib.util.find_spec(m) is None]
        if missing:
            raise UsageError(f"--backend asyncio needs {' and '.join(missing)}: {_ASYNCIO_EXTRA}")
    return server


def _run_on(backend: str, main: Callable[[], Awaitable[int]]) -> int:
    """``main()`` on trio, or on asyncio with uvloop's event loop."""
    if backend == "trio":
        import trio

        return trio.run(main)
    import anyio

    return anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})


def run(args: argparse.Namespace) -> int:
    """Run ``trio-vllm serve``; returns the exit status."""
    from .._exceptions import EngineStartupError
    from ..server import DEFAULT_MAX_BODY_BYTES, DEFAULT_SHUTDOWN_GRACE
    from ..server._lora import parse_lora_modules
    from ..server._run import run_openai_server

    prog = "trio-vllm serve"
    import importlib.util

    needed = ("hypercorn", "h11", "prometheus_client")
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        sys.stderr.write(
            f"{prog}: error: needs {' and '.join(missing)}: pip install 'trio-vllm[serve]'\n"
        )
        return 2
    attached = args.attach_engines is not None
    try:
        http_server = _http_server(args)
        plan = _engine_plan(args)
        if plan.model_dir is None:
            raise UsageError(
                "--connect without --model: the server renders text and chat with the "
                "engines' model directory (tokenizer, chat template); give --model DIR"
            )
        engines: EngineSource
        if attached:
            from ..client import EngineAttachment

            engines = EngineAttachment.from_json(args.attach_engines).client(args.api_server_index)
        else:
            engines = engine_source(args, plan)
        if args.api_server_count < 1:
            raise UsageError("--api-server-count must be at least 1")
        if not 0 <= args.port <= 65535:
            raise UsageError(f"--port must be in [0, 65535], got {args.port}")
        body_limit = args.max_request_body_bytes or DEFAULT_MAX_BODY_BYTES
        if body_limit < 1:
            raise UsageError("--max-request-body-bytes must be at least 1")
        grace = DEFAULT_SHUTDOWN_GRACE if args.shutdown_grace is None else args.shutdown_grace
        if grace < 0:
            raise UsageError("--shutdown-grace must be >= 0")
        liveness = _liveness_options(args)
        tool_options = _tool_options(args)
    except UsageError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        return 2
    try:
        loras = parse_lora_modules(args.lora_modules or ())
    except ValueError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        return 2
    keys = args.api_key or ([os.environ["VLLM_API_KEY"]] if os.environ.get("VLLM_API_KEY") else [])
    _log_to_stderr(args)
    options: ClientOptions = {**liveness}
    if args.ready_timeout is not None:
        options["ready_timeout"] = args.ready_timeout
    try:
        if args.api_server_count > 1 and not attached:
            from ._api_servers import run_api_servers

            return _run_on(
                args.backend,
                lambda: run_api_servers(
                    engines,
                    count=args.api_server_count,
                    child_argv=args.cli_argv,
                    host=args.host,
                    port=args.port,
                    shutdown_grace=grace,
                    ready_timeout=args.ready_timeout,
                ),
            )
        return _run_on(
            args.backend,
            lambda: run_openai_server(
                engines,
                model=plan.model_dir,
                served_model_names=args.served_model_name,
                host=args.host,
                port=args.port,
                api_keys=keys,
                max_body_bytes=body_limit,
                shutdown_grace=grace,
                keep_serving_on_engine_death=args.keep_serving_on_engine_death,
                merge_outputs=args.merge_outputs,
                tool_options=tool_options,
                freeze_gc=True,
                access_log=args.access_log,
                http_server=http_server,  # type: ignore[arg-type]  # one of the names
                generation_config=args.generation_config,
                override_generation_config=args.override_generation_config,
                client_options=options,
                lora_modules=loras,
                trust_request_chat_template=args.trust_request_chat_template,
                listen_fd=args.listen_fd,
                server_index=args.api_server_index,
                parent_pid=args.api_server_parent,
            ),
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
