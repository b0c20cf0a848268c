"""``trio-vllm generate``: run prompts through engines and stream what they produce.

Engines: the bundled reference engine (default), stock vLLM engine cores spawned with
another python (``--engine vllm``), or engines started elsewhere that connect to
``--connect tcp://HOST:PORT``. trio-vllm has no tokenizer: a text prompt is encoded
byte-level (UTF-8 bytes are the token ids, the reference engine's vocabulary) and
output ids below 256 are decoded back the same way; ``--prompt-token-ids`` sends ids
as they are and prints ids. ``--json`` prints one JSON line per request instead.

Exit status: 0 on success, 1 when engines fail to start or die, 2 on bad arguments,
130 after Ctrl-C (the first Ctrl-C cancels and shuts the engines down cleanly).
"""

from __future__ import annotations

import argparse
import codecs
import json
import math
import os
import shlex
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from ..client import EngineCoreClient, EngineSource, StartupProgress

__all__ = ["add_generate_parser", "run_generate"]

_BYTE_VOCAB = 256  # ids 0-255 are bytes in the reference engine's vocabulary


def add_generate_parser(commands: Any) -> None:
    """Register the ``generate`` subcommand on an argparse subparsers object."""
    p = commands.add_parser(
        "generate",
        help="generate from prompts and stream the output",
        description=__doc__.split("\n\n")[1].replace("\n", " ") if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            '  trio-vllm generate "hello" --max-tokens 16\n'
            "  trio-vllm generate --prompt-token-ids 1,5,7,9 --max-tokens 8 --json\n"
            "  trio-vllm generate --engine vllm --model ./tiny-llama --vllm-python PY \\\n"
            '      --engine-args "--load-format dummy --skip-tokenizer-init" '
            "--prompt-token-ids 1,5,7,9\n"
            "  trio-vllm generate --connect tcp://127.0.0.1:29555 --engines 1 "
            "--prompt-token-ids 1,5,7,9 --json"
        ),
    )
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="text prompt(s), byte-encoded")
    p.add_argument(
        "--prompt-token-ids",
        action="append",
        default=[],
        metavar="ID,ID,...",
        help="a prompt as comma-separated token ids (repeat for more requests)",
    )
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=16, metavar="N", help="default: 16")
    s.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="default: 0 (greedy)"
    )
    s.add_argument("--seed", type=int, default=None, metavar="S")
    s.add_argument("--top-p", type=float, default=1.0, metavar="P")
    s.add_argument("--top-k", type=int, default=0, metavar="K")
    s.add_argument(
        "--eos-token-id",
        type=int,
        default=None,
        metavar="ID",
        help="stop at this id (default: the reference engine's EOS; none for vLLM)",
    )
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
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
        help="reference: echo (default; repeats the prompt) or tiny; vllm: model path",
    )
    e.add_argument("--vllm-python", metavar="PY", help="python with vLLM (--engine vllm)")
    e.add_argument(
        "--engine-args",
        default="",
        metavar="ARGS",
        help="more engine arguments as one string: `vllm serve`'s with --engine vllm "
        '(e.g. "--load-format dummy"), the reference engine\'s otherwise',
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
    o = p.add_argument_group("output")
    o.add_argument(
        "--json",
        action="store_true",
        help='one line per request: {"request_id", "token_ids", "finish_reason"}; no progress',
    )


# ---------------------------------------------------------------------- arguments


class _UsageError(Exception):
    pass


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise _UsageError(
            f"--prompt-token-ids: expected comma-separated ints, got {text!r}"
        ) from None
    if not ids:
        raise _UsageError("--prompt-token-ids: empty prompt")
    return ids


def _engine_source(args: argparse.Namespace) -> EngineSource:
    from ..client import ExternalEngines, ReferenceEngines, VllmEngines

    if args.engines < 1:
        raise _UsageError("--engines must be at least 1")
    if args.connect is not None:
        if args.engine != "reference" or args.model is not None:
            raise _UsageError(
                "--connect waits for engines started elsewhere: drop --engine/--model"
            )
        try:
            return ExternalEngines(
                args.connect, count=args.engines, advertise_host=args.advertise_host
            )
        except ValueError as exc:
            raise _UsageError(f"--connect: {exc}") from None
    if args.engine == "vllm":
        if not args.model:
            raise _UsageError("--engine vllm needs --model (a path or name, as for vllm serve)")
        if not args.vllm_python:
            raise _UsageError("--engine vllm needs --vllm-python, a python with vLLM installed")
        return VllmEngines(
            args.model,
            python=args.vllm_python,
            extra_args=shlex.split(args.engine_args),
            count=args.engines,
        )
    model = args.model or "echo"
    if model not in ("echo", "tiny"):
        raise _UsageError(f"the reference engine has models echo and tiny, not {model!r}")
    return ReferenceEngines(args.engines, model=model, extra_args=shlex.split(args.engine_args))


# ---------------------------------------------------------------------- progress


class _Progress:
    """Live startup progress on stderr: one rewritten line on a terminal, else lines."""

    def __init__(self, stream: TextIO, what: str, enabled: bool) -> None:
        self._stream = stream
        self._what = what
        self._enabled = enabled
        self._tty = enabled and stream.isatty()
        self._last: StartupProgress | None = None
        self._started = time.monotonic()
        self._printed = ""
        self._last_line_at = 0.0
        self.finished = False

    def _line(self) -> str:
        p = self._last
        elapsed = time.monotonic() - self._started
        if p is None:
            return f"starting {self._what} ... {elapsed:.1f} s"
        n = len(p.expected)
        return (
            f"waiting for {self._what}: {len(p.connected)}/{n} connected, "
            f"{len(p.ready)}/{n} ready, {elapsed:.1f} s"
        )

    def _show(self, force: bool = False) -> None:
        if not self._enabled or self.finished:
            return
        line = self._line()
        if self._tty:
            self._stream.write("\r\x1b[K" + line)
            self._stream.flush()
        else:
            # Lines when something changed, and a heartbeat every 10 s.
            key = line.rpartition(",")[0]
            now = time.monotonic()
            if force or key != self._printed or now - self._last_line_at >= 10:
                self._stream.write(line + "\n")
                self._stream.flush()
                self._printed = key
                self._last_line_at = now

    def update(self, progress: StartupProgress) -> None:
        self._last = progress
        self._show()

    async def tick(self) -> None:
        import anyio

        while not self.finished:
            await anyio.sleep(0.2 if self._tty else 1.0)
            self._show()

    def done(self, message: str | None) -> None:
        if self.finished:
            return
        if self._enabled:
            elapsed = time.monotonic() - self._started
            if self._tty:
                self._stream.write("\r\x1b[K")
            if message is not None:
                self._stream.write(f"{message} in {elapsed:.1f} s\n")
            self._stream.flush()
        self.finished = True


# ---------------------------------------------------------------------- running


class _Printer:
    """Streams one request's output to stdout (text or ids)."""

    def __init__(self, out: TextIO, as_text: bool) -> None:
        self._out = out
        self._as_text = as_text
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._any = False

    def tokens(self, ids: list[int]) -> None:
        if self._as_text:
            text = self._decoder.decode(bytes(t for t in ids if 0 <= t < _BYTE_VOCAB))
        elif ids:
            text = (" " if self._any else "") + " ".join(map(str, ids))
            self._any = True
        else:
            text = ""
        if text:
            self._out.write(text)
            self._out.flush()

    def end(self) -> None:
        if self._as_text:
            self._out.write(self._decoder.decode(b"", final=True))
        self._out.write("\n")
        self._out.flush()


def _decode_text(ids: list[int]) -> str:
    return bytes(t for t in ids if 0 <= t < _BYTE_VOCAB).decode("utf-8", "replace")


def _short_name(args: argparse.Namespace) -> str:
    plural = "s" if args.engines > 1 else ""
    if args.connect is not None:
        return f"{args.engines} engine{plural} at {args.connect}"
    if args.engine == "vllm":
        return f"{args.engines} vLLM engine{plural}"
    return f"{args.engines} reference engine{plural} ({args.model or 'echo'})"


async def _generate(args: argparse.Namespace, prompts: list[tuple[list[int], bool]]) -> int:
    import anyio

    from ..client import ReferenceEngines, make_request, open_client

    engines = _engine_source(args)
    out, err = sys.stdout, sys.stderr
    progress = _Progress(err, _short_name(args), enabled=not args.json)
    text_prompts = any(as_text for _, as_text in prompts)
    if not args.json and text_prompts and not isinstance(engines, ReferenceEngines):
        err.write(
            "note: text prompts are encoded byte-level (token id = UTF-8 byte), the "
            "reference engine's vocabulary; give --prompt-token-ids for other models\n"
        )
    async with anyio.create_task_group() as tg:
        tg.start_soon(progress.tick)
        try:
            async with open_client(
                engines, ready_timeout=args.ready_timeout, on_progress=progress.update
            ) as client:
                progress.done(
                    f"{len(client.ranks)} engine(s) ready (protocol of vLLM {client.vllm_version})"
                )
                eos = args.eos_token_id
                if eos is None and isinstance(engines, ReferenceEngines):
                    # The reference engine's worker reports its vocabulary's EOS id.
                    (info, *_) = await client.collective_rpc("reference_engine_info")
                    assert isinstance(info, dict)
                    eos = int(info["eos_token_id"])
                requests = [
                    make_request(
                        ids,
                        max_tokens=args.max_tokens,
                        temperature=args.temperature,
                        seed=args.seed,
                        top_p=args.top_p,
                        top_k=args.top_k,
                        eos_token_id=None if args.ignore_eos else eos,
                        ignore_eos=args.ignore_eos,
                        max_model_len=client.max_model_len,
                    )
                    for ids, _ in prompts
                ]
                await _run_requests(client, args, requests, [t for _, t in prompts], out, err)
        finally:
            progress.done(None)
            tg.cancel_scope.cancel()
    return 0


async def _run_requests(
    client: EngineCoreClient,
    args: argparse.Namespace,
    requests: list[Any],
    as_text: list[bool],
    out: TextIO,
    err: TextIO,
) -> None:
    import anyio

    live = len(requests) == 1 and not args.json

    async def one(request: Any, text: bool) -> None:
        printer = _Printer(out, text) if live else None
        tokens: list[int] = []
        async with client.generate(request) as stream:
            async for output in stream:
                tokens.extend(output.new_token_ids)
                if printer is not None:
                    printer.tokens(list(output.new_token_ids))
        reason = str(stream.finish_reason) if stream.finish_reason is not None else None
        if args.json:
            line = {"request_id": request.request_id, "token_ids": tokens, "finish_reason": reason}
            out.write(json.dumps(line) + "\n")
        elif printer is not None:
            printer.end()
            err.write(f"[{request.request_id}: {len(tokens)} tokens, finish_reason={reason}]\n")
        else:
            body = _decode_text(tokens) if text else " ".join(map(str, tokens))
            out.write(f"--- {request.request_id} ({len(tokens)} tokens, {reason})\n{body}\n")
        out.flush()

    async with anyio.create_task_group() as tg:
        for request, text in zip(requests, as_text, strict=True):
            tg.start_soon(one, request, text)


def _unwrap(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


async def _main(args: argparse.Namespace, prompts: list[tuple[list[int], bool]]) -> int:
    import trio

    interrupted = False
    status = 0
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:

            async def on_sigint() -> None:
                nonlocal interrupted
                with trio.open_signal_receiver(signal.SIGINT) as signals:
                    async for _ in signals:
                        # First Ctrl-C: cancel; open_client stops the engines (bounded
                        # by its grace period). Later ones are ignored meanwhile.
                        if not interrupted:
                            interrupted = True
                            scope.cancel()

            nursery.start_soon(on_sigint)
            status = await _generate(args, prompts)
            nursery.cancel_scope.cancel()
    if interrupted:
        sys.stderr.write("interrupted\n")
        return 130
    return status


def run_generate(args: argparse.Namespace) -> int:
    """Run ``trio-vllm generate``; returns the exit status."""
    import trio

    from .._exceptions import EngineDeadError, EngineStartupError, TrioVllmError

    try:
        prompts = [(list(text.encode("utf-8")), True) for text in args.prompts]
        prompts += [(_parse_ids(ids), False) for ids in args.prompt_token_ids]
        if not prompts:
            raise _UsageError("give a PROMPT or --prompt-token-ids")
        if any(not ids for ids, _ in prompts):
            raise _UsageError("empty prompt")
        if args.max_tokens < 1:
            raise _UsageError("--max-tokens must be at least 1")
        if not math.isfinite(args.temperature) or args.temperature < 0:
            raise _UsageError("--temperature must be >= 0")
        _engine_source(args)  # validate early, before anything starts
    except _UsageError as exc:
        sys.stderr.write(f"trio-vllm generate: error: {exc}\n")
        return 2
    try:
        return trio.run(_main, args, prompts)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")  # Ctrl-C before our handler was installed
        return 130
    except BaseException as group:
        error = _unwrap(group)
        if isinstance(error, BrokenPipeError):
            # stdout went away (e.g. `| head`): not an error; silence the final flush.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return 0
        if isinstance(error, EngineStartupError):
            sys.stderr.write(f"trio-vllm generate: engines did not start:\n{error}\n")
            return 1
        if isinstance(error, EngineDeadError):
            sys.stderr.write(f"trio-vllm generate: engine died: {error}\n")
            return 1
        if isinstance(error, (TrioVllmError, ValueError)):
            sys.stderr.write(f"trio-vllm generate: error: {error}\n")
            return 1
        if error is not group:
            raise error from None
        raise
