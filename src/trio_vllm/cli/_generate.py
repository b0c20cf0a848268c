"""``trio-vllm generate``: run prompts through engines, text in and text out.

Engines: the bundled reference engine (default), stock vLLM engine cores spawned with
another python (``--engine vllm``), or engines started elsewhere that connect to
``--connect tcp://HOST:PORT``. Prompts go through the text layer: the model directory
(``--model DIR``; the reference engine's own byte-level one by default) gives the
tokenizer, the chat template (``--chat``) and the EOS ids; output is detokenized
incrementally and stop strings (``--stop``) are applied as vLLM's frontend does.
``--prompt-token-ids`` sends ids as they are. ``--json`` prints one JSON line per
completion, in prompt order. With ``--connect`` and no ``--model`` there is no model
directory: no tokenizer is applied, prompts are token ids (checked against
``--vocab-size`` if given, else left to the engines) and the output is token ids.

Exit status: 0 on success, 1 when engines fail to start or die or a request ends in
error (its reason on stderr), 2 on bad arguments (sampling values and prompts are checked
before any engine starts), 130 after Ctrl-C (the first Ctrl-C cancels and shuts the
engines down cleanly).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from ._engines import EnginePlan, UsageError, add_engine_arguments, engine_plan, engine_source

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..client import EngineCoreClient, StartupProgress
    from ..llm import LLM
    from ..protocol import SamplingParams
    from ..text import CompletionOutput, RequestOutput

__all__ = ["add_generate_parser", "run_generate"]

# Options whose value may itself look like an option (``--engine-args "--x=1"``).
_RAW_VALUE_OPTIONS = ("--engine-args",)


def _join_raw_values(args: Sequence[str]) -> list[str]:
    """``--engine-args VALUE`` -> ``--engine-args=VALUE`` when VALUE starts with ``-``:
    argparse would otherwise take ``--startup-delay=1`` for an unknown option."""
    out: list[str] = []
    it = iter(args)
    for arg in it:
        if arg in _RAW_VALUE_OPTIONS:
            value = next(it, None)
            if value is None:
                out.append(arg)
            else:
                out.append(f"{arg}={value}")
        elif arg == "--":
            out.append(arg)
            out.extend(it)
        else:
            out.append(arg)
    return out


def add_generate_parser(commands: Any) -> None:
    """Register the ``generate`` subcommand on an argparse subparsers object."""
    base: type[argparse.ArgumentParser] = commands._parser_class

    class _GenerateParser(base):  # type: ignore[valid-type,misc]
        def parse_known_args(
            self, args: Sequence[str] | None = None, namespace: Any = None
        ) -> tuple[argparse.Namespace, list[str]]:
            if args is None:
                args = sys.argv[1:]
            parsed: tuple[argparse.Namespace, list[str]] = super().parse_known_args(
                _join_raw_values(args), namespace
            )
            return parsed

    commands._parser_class = _GenerateParser
    try:
        p = commands.add_parser(
            "generate",
            help="generate text from prompts and stream it",
            description=__doc__.split("\n\n")[1].replace("\n", " ") if __doc__ else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=(
                "examples:\n"
                '  trio-vllm generate "hello" --max-tokens 16\n'
                '  trio-vllm generate "hello" --stop lo --n 2 --temperature 1 --seed 3 --json\n'
                '  trio-vllm generate --chat --system "be brief" "hi there"\n'
                "  trio-vllm generate --prompt-token-ids 1,5,7,9 --max-tokens 8 --json\n"
                "  trio-vllm generate --engine vllm --model ./tiny-llama --vllm-python PY \\\n"
                '      --engine-args "--load-format dummy" "hello"\n'
                "  trio-vllm generate --connect tcp://127.0.0.1:29555 --model ./tiny-llama "
                '"hello" --json'
            ),
        )
    finally:
        commands._parser_class = base
    p.add_argument(
        "prompts",
        nargs="*",
        metavar="PROMPT",
        help="text prompt(s); '-' (or no prompt at all, with standard input not a terminal) "
        "reads prompts from standard input, one per line",
    )
    p.add_argument(
        "--prompt-token-ids",
        action="append",
        default=[],
        metavar="ID,ID,...",
        help="a prompt as comma-separated token ids (repeat for more requests)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="each PROMPT is a user message, rendered with the model's chat template",
    )
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system message first")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=16, metavar="N", help="default: 16")
    s.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="default: 0 (greedy)"
    )
    s.add_argument("--seed", type=int, default=None, metavar="S")
    s.add_argument("--top-p", type=float, default=None, metavar="P")
    s.add_argument("--top-k", type=int, default=None, metavar="K")
    s.add_argument("--n", type=int, default=1, metavar="N", help="completions per prompt")
    s.add_argument(
        "--stop", action="append", default=[], metavar="S", help="stop string (repeatable)"
    )
    s.add_argument(
        "--include-stop-str-in-output",
        action="store_true",
        help="keep the matched stop string in the text",
    )
    s.add_argument("--min-tokens", type=int, default=0, metavar="N")
    s.add_argument(
        "--logprobs", type=int, default=None, metavar="K", help="top-K logprobs per token"
    )
    s.add_argument(
        "--eos-token-id",
        type=int,
        default=None,
        metavar="ID",
        help="also stop at this id (the model directory's EOS ids always apply)",
    )
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    s.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help="with --connect and no --model: refuse prompt ids >= N before sending (without "
        "it the engines check them)",
    )
    add_engine_arguments(
        p,
        model_help="the model directory (tokenizer, chat template, EOS); reference engine: "
        "also echo (default) or tiny, its own models with its own tokenizer; vllm: the model "
        "path, as for vllm serve",
        engine_args_help="more engine arguments as one string: `vllm serve`'s with --engine "
        'vllm (e.g. "--load-format dummy"), the reference engine\'s otherwise; a value '
        'starting with a dash works ("--startup-delay=1")',
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--json",
        action="store_true",
        help='one line per completion, in prompt order: {"prompt_index", "index", '
        '"request_id", "text", "token_ids", "finish_reason", "stop_reason"} (and '
        '"logprobs" with --logprobs)',
    )
    o.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no startup progress and no per-request summary on stderr",
    )


# ---------------------------------------------------------------------- arguments


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise UsageError(
            f"--prompt-token-ids: expected comma-separated ints, got {text!r}"
        ) from None
    if not ids:
        raise UsageError("--prompt-token-ids: empty prompt")
    return ids


@dataclass
class _Plan:
    """What the arguments mean, checked before anything starts."""

    engines: EnginePlan
    prompts: list[str | list[int]]
    params: SamplingParams
    messages: list[list[dict[str, str]]] | None = None

    @property
    def model_dir(self) -> str | None:
        """None: engines started elsewhere and no --model, so token ids in and out."""
        return self.engines.model_dir


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    from ..protocol import RequestOutputKind, SamplingParams

    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be at least 1")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UsageError("--temperature must be >= 0")
    if args.n < 1:
        raise UsageError("--n must be at least 1")
    # Checked here: SamplingParams resets top_p/top_k for greedy requests, as vLLM does
    # after its own checks, so the text layer never sees a bad value given with T=0.
    if args.top_p is not None and not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k is not None and args.top_k < -1:
        raise UsageError(f"--top-k must be -1 or 0 (off) or at least 1, got {args.top_k}")
    values: dict[str, Any] = {
        "n": args.n,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "min_tokens": args.min_tokens,
        "stop": list(args.stop),
        "include_stop_str_in_output": args.include_stop_str_in_output,
        "logprobs": args.logprobs,
        "ignore_eos": args.ignore_eos,
        "output_kind": RequestOutputKind.DELTA,
    }
    if args.top_p is not None:
        values["top_p"] = args.top_p
    if args.top_k is not None:
        values["top_k"] = args.top_k
    if args.eos_token_id is not None:
        values["stop_token_ids"] = [args.eos_token_id]
    return SamplingParams(**values)


def _stdin_prompts() -> list[str]:
    """Prompts from standard input, one per line (blank lines skipped), as Unix filters
    read their input."""
    return [line for line in sys.stdin.read().splitlines() if line.strip()]


def _text_prompts(args: argparse.Namespace) -> list[str]:
    """The PROMPT arguments, with '-' replaced by standard input's lines; with no prompt
    at all (nor ids) and standard input not a terminal, those lines alone."""
    if not args.prompts:
        if args.prompt_token_ids or sys.stdin is None or sys.stdin.isatty():
            return []
        return _stdin_prompts()
    if "-" not in args.prompts:
        return list(args.prompts)
    if args.prompts.count("-") > 1:
        raise UsageError("'-' (standard input) may be given once")
    at = args.prompts.index("-")
    return [*args.prompts[:at], *_stdin_prompts(), *args.prompts[at + 1 :]]


def _plan(args: argparse.Namespace) -> _Plan:
    engines = engine_plan(args)
    args.prompts = _text_prompts(args)
    prompts: list[str | list[int]] = list(args.prompts)
    prompts += [_parse_ids(ids) for ids in args.prompt_token_ids]
    if not prompts:
        raise UsageError(
            "give a PROMPT, --prompt-token-ids, or prompts on standard input (one per line)"
        )
    messages = None
    if args.chat:
        if args.prompt_token_ids:
            raise UsageError("--chat takes text prompts, not --prompt-token-ids")
        system = [{"role": "system", "content": args.system}] if args.system else []
        messages = [[*system, {"role": "user", "content": p}] for p in args.prompts]
    elif args.system is not None:
        raise UsageError("--system goes with --chat")
    if engines.model_dir is None:
        _check_ids_only(args, prompts)
    elif args.vocab_size is not None:
        raise UsageError(
            "--vocab-size goes with --connect and no --model (a model directory has its own)"
        )
    return _Plan(engines, prompts, _sampling_params(args), messages)


def _check_ids_only(args: argparse.Namespace, prompts: list[str | list[int]]) -> None:
    """--connect without --model: what needs a tokenizer is refused, ids are checked
    only against --vocab-size (the engines check the rest)."""
    need = "with --connect and no --model there is no tokenizer (the engines' model is "
    need += "unknown here): give --model DIR, the engines' model directory"
    if args.chat or any(isinstance(p, str) for p in prompts):
        raise UsageError(f"text prompts need a tokenizer; {need}, or --prompt-token-ids")
    for option, used in (("--stop", args.stop), ("--n > 1", args.n > 1),
                         ("--logprobs", args.logprobs is not None)):  # fmt: skip
        if used:
            raise UsageError(f"{option} needs a tokenizer; {need}")
    if args.vocab_size is not None:
        if args.vocab_size < 1:
            raise UsageError("--vocab-size must be at least 1")
        for ids in prompts:
            bad = [t for t in ids if isinstance(t, int) and not 0 <= t < args.vocab_size]
            if bad:
                raise UsageError(
                    f"token id {bad[0]} is out of vocabulary (--vocab-size {args.vocab_size})"
                )


def _load_model(plan: _Plan) -> Any:
    """The model directory's files and tokenizer (``ModelFiles``), or a usage error;
    ``(None, None)`` without a model directory."""
    from ..text import ModelFiles

    if plan.model_dir is None:
        return None, None
    try:
        files = ModelFiles(plan.model_dir)
        tokenizer = files.load_tokenizer()
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"--model: cannot load the tokenizer of {plan.model_dir!r}: {exc}"
        ) from None
    return files, tokenizer


def _precheck(plan: _Plan, files: Any, tokenizer: Any) -> None:
    """Validate every prompt and the sampling values with the text layer, before any
    engine starts (the context length is checked again once the engines report theirs)."""
    from .._exceptions import InvalidRequestError
    from ..text import InputProcessor

    if files is None:
        return  # token ids only: _check_ids_only did what can be done here
    limit = files.max_position_embeddings or 1 << 31
    inputs = InputProcessor.from_model_files(files, tokenizer, max_model_len=limit)
    try:
        if plan.messages is not None:
            for messages in plan.messages:
                inputs.process_chat("check", messages, plan.params)
        else:
            for prompt in plan.prompts:
                inputs.process_inputs("check", prompt, plan.params)
    except InvalidRequestError as exc:
        raise UsageError(str(exc)) from None


# ---------------------------------------------------------------------- progress


class _Progress:
    """Live startup progress on stderr: one rewritten line on a terminal, cut to its
    width (a longer line would wrap and leave stale rows), else plain lines."""

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
            width = shutil.get_terminal_size().columns
            # One column short: a line that fills the last column wraps on some terminals.
            self._stream.write("\r\x1b[K" + line[: max(width - 1, 1)])
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


def _short_name(args: argparse.Namespace, plan: _Plan) -> str:
    plural = "s" if args.engines > 1 else ""
    if args.connect is not None:
        return f"{args.engines} engine{plural} at {args.connect}"
    if args.engine == "vllm":
        return f"{args.engines} vLLM engine{plural}"
    return f"{args.engines} reference engine{plural} ({plan.engines.reference_model})"


def _logprobs_json(completion: CompletionOutput) -> list[list[dict[str, Any]]] | None:
    if completion.logprobs is None:
        return None
    return [
        [
            {"token_id": tid, "logprob": lp.logprob, "rank": lp.rank,
             "decoded_token": lp.decoded_token}
            for tid, lp in position.items()
        ]
        for position in completion.logprobs
    ]  # fmt: skip


@dataclass
class _Result:
    request_id: str = ""
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    done: bool = False


class _Output:
    """Prints results in prompt order, each as soon as it and all before it are done."""

    def __init__(self, args: argparse.Namespace, count: int, out: TextIO, err: TextIO) -> None:
        self.args = args
        self.results = [_Result() for _ in range(count)]
        self.next = 0
        self.out = out
        self.err = err
        self.errors: list[str] = []
        self.live = count == 1 and args.n == 1 and not args.json
        self.ids_only = False  # no tokenizer: print token ids, not text

    def delta(self, index: int, output: RequestOutput) -> None:
        result = self.results[index]
        result.request_id = output.request_id
        for c in output.outputs:
            have = result.completions.get(c.index)
            if have is None:
                result.completions[c.index] = _copy_completion(c)
            else:
                have.text += c.text
                have.token_ids.extend(c.token_ids)
                if c.logprobs:
                    have.logprobs = [*(have.logprobs or ()), *c.logprobs]
                have.cumulative_logprob = c.cumulative_logprob
                have.finish_reason = c.finish_reason
                have.stop_reason = c.stop_reason
            if self.live and self.ids_only and c.token_ids:
                lead = " " if len(result.completions[c.index].token_ids) > len(c.token_ids) else ""
                self.out.write(lead + " ".join(map(str, c.token_ids)))
                self.out.flush()
            elif self.live and c.text:
                self.out.write(c.text)
                self.out.flush()

    def finish(self, index: int) -> None:
        self.results[index].done = True
        while self.next < len(self.results) and self.results[self.next].done:
            self._print(self.next)
            self.next += 1

    def _print(self, index: int) -> None:
        result = self.results[index]
        args = self.args
        for k in sorted(result.completions):
            c = result.completions[k]
            if c.finish_reason == "error":
                self.errors.append(
                    f"request {result.request_id} (prompt {index}, completion {k}) ended in "
                    f"error after {len(c.token_ids)} token(s): the engine refused or failed "
                    "it (its log says why; run with -v)"
                )
            if args.json:
                line: dict[str, Any] = {
                    "prompt_index": index,
                    "index": c.index,
                    "request_id": result.request_id,
                    "text": None if self.ids_only else c.text,
                    "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if args.logprobs is not None:
                    line["logprobs"] = _logprobs_json(c)
                self.out.write(json.dumps(line, ensure_ascii=False) + "\n")
            elif self.live:
                self.out.write("\n")
                if not args.quiet:
                    self.err.write(
                        f"[{result.request_id}: {len(c.token_ids)} tokens, "
                        f"finish_reason={c.finish_reason}, stop_reason={c.stop_reason!r}]\n"
                    )
            else:
                body = " ".join(map(str, c.token_ids)) if self.ids_only else c.text
                self.out.write(
                    f"--- prompt {index} completion {k} ({result.request_id}: "
                    f"{len(c.token_ids)} tokens, {c.finish_reason})\n{body}\n"
                )
        self.out.flush()


def _copy_completion(c: CompletionOutput) -> CompletionOutput:
    import msgspec

    return msgspec.structs.replace(
        c, token_ids=list(c.token_ids), logprobs=None if c.logprobs is None else list(c.logprobs)
    )


async def _run_requests(llm: LLM, plan: _Plan, output: _Output) -> None:
    import anyio

    async def one(index: int) -> None:
        if plan.messages is not None:
            cm = llm.chat(plan.messages[index], plan.params)
        else:
            cm = llm.generate(plan.prompts[index], plan.params)
        async with cm as stream:
            async for out in stream:
                output.delta(index, out)
        output.finish(index)

    async with anyio.create_task_group() as tg:
        for index in range(len(plan.prompts)):
            tg.start_soon(one, index)


async def _run_ids(client: EngineCoreClient, plan: _Plan, output: _Output) -> None:
    """Token ids through the raw client (no model directory, so no text layer): each
    prompt one request, its outputs shown as the text layer's would be, ids only."""
    import anyio

    from ..client import make_request
    from ..text import CompletionOutput, RequestOutput

    params = plan.params
    output.ids_only = True

    async def one(index: int) -> None:
        prompt = plan.prompts[index]
        assert isinstance(prompt, list)  # _check_ids_only's
        request = make_request(
            prompt,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            seed=params.seed,
            top_p=params.top_p,
            top_k=params.top_k,
            stop_token_ids=params.stop_token_ids or (),
            ignore_eos=params.ignore_eos,
            min_tokens=params.min_tokens,
            max_model_len=client.max_model_len,
        )
        async with client.generate(request) as stream:
            async for out in stream:
                reason = None if out.finish_reason is None else str(out.finish_reason)
                completion = CompletionOutput(
                    0, "", list(out.new_token_ids), None, None, reason, out.stop_reason
                )
                output.delta(index, RequestOutput(request.request_id, None, prompt, None,
                                                  [completion], out.finished))  # fmt: skip
        output.finish(index)

    async with anyio.create_task_group() as tg:
        for index in range(len(plan.prompts)):
            tg.start_soon(one, index)


async def _generate(args: argparse.Namespace, plan: _Plan, files: Any, tokenizer: Any) -> int:
    import anyio

    from ..client import open_client
    from ..llm import LLM

    engines = engine_source(args, plan.engines)
    out, err = sys.stdout, sys.stderr
    progress = _Progress(err, _short_name(args, plan), enabled=not args.quiet)
    output = _Output(args, len(plan.prompts), out, err)
    async with anyio.create_task_group() as tg:
        tg.start_soon(progress.tick)
        try:
            async with open_client(
                engines, ready_timeout=args.ready_timeout, on_progress=progress.update
            ) as client:
                progress.done(
                    f"{len(client.ranks)} engine(s) ready (protocol of vLLM {client.vllm_version})"
                )
                if plan.model_dir is None:
                    await _run_ids(client, plan, output)
                else:
                    llm = LLM(client, model=plan.model_dir, files=files, tokenizer=tokenizer)
                    await _run_requests(llm, plan, output)
        finally:
            progress.done(None)
            tg.cancel_scope.cancel()
    for message in output.errors:
        err.write(f"trio-vllm generate: {message}\n")
    return 1 if output.errors else 0


def _unwrap(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


async def _main(args: argparse.Namespace, plan: _Plan, files: Any, tokenizer: Any) -> int:
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
            status = await _generate(args, plan, files, tokenizer)
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
        plan = _plan(args)
        files, tokenizer = _load_model(plan)
        _precheck(plan, files, tokenizer)
        engine_source(args, plan.engines)  # validate early, before anything starts
    except UsageError as exc:
        sys.stderr.write(f"trio-vllm generate: error: {exc}\n")
        return 2
    try:
        return trio.run(_main, args, plan, files, tokenizer)
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
