"""Micro-benchmark of the text layer's incremental detokenizer against a bare
``DecodeStream.step`` loop (the ceiling), measured in the same run.

Both decode the same token streams one token at a time, primed with the same prompt:

* ``ceiling``: ``stream.step(tokenizer, id)`` per token, appending the piece to a list;
* ``detokenizer``: trio-vllm's ``IncrementalDetokenizer.update([id], False)`` plus
  ``get_next_output_text(False, delta=True)`` per token (what a DELTA stream does);
* ``detokenizer+stop``: the same with two stop strings (hold-back buffer, stop search);
* ``output_processor``: ``OutputProcessor.process_outputs`` of one ``EngineCoreOutput``
  per token, DELTA, building every ``RequestOutput`` (the whole per-token text path);
* with ``--vllm-python PY``: the same two detokenizer/output-processor workloads through
  stock vLLM's ``FastIncrementalDetokenizer`` and ``OutputProcessor``, run by that python
  in a subprocess next to its own ceiling loop (``vllm_*`` rows: ratios to that
  process's ceiling, so both sides are normalized to the same bare loop).

Prints detokenized tokens per CPU-second (``time.process_time``, best of interleaved
rounds) and ``ratio = case / ceiling`` (higher is better; 1.0 = as fast as the bare loop).
The tokenizer is ``../shared/interop/tiny-llama`` (512-token byte-level BPE) unless
``--model DIR``. Not a test: nothing here asserts.

    python bench/bench_detokenizer_micro.py [--json] [--rounds N] [--model DIR]
                                            [--vllm-python PY]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from trio_vllm.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    RequestOutputKind,
    SamplingParams,
)
from trio_vllm.text import IncrementalDetokenizer, OutputProcessor, load_tokenizer

if TYPE_CHECKING:
    from collections.abc import Callable

    from trio_vllm.text import Tokenizer

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "shared" / "interop" / "tiny-llama"
TEXT = (
    "The quick brown fox jumps over the lazy dog. 你好，世界！ Ünïcödé text, emoji 😀🎉, "
    "numbers 12345 and punctuation: (a), [b], {c}; done.\n"
)


def _ceiling(tok: Tokenizer, prompt: list[int], streams: list[list[int]]) -> int:
    from tokenizers.decoders import DecodeStream

    backend = tok.backend
    n = 0
    for ids in streams:
        stream = DecodeStream(ids=prompt, skip_special_tokens=True)
        step = stream.step
        pieces = []
        for token_id in ids:
            pieces.append(step(backend, token_id) or "")
        n += len(ids)
    return n


def _detokenizer(
    tok: Tokenizer, prompt: list[int], streams: list[list[int]], params: SamplingParams
) -> int:
    n = 0
    for ids in streams:
        d = IncrementalDetokenizer.for_request(tok, prompt, params)
        update, nxt = d.update, d.get_next_output_text
        pieces = []
        for token_id in ids:
            update([token_id], False)
            pieces.append(nxt(False, True))
        n += len(ids)
    return n


def _output_processor(tok: Tokenizer, prompt: list[int], streams: list[list[int]]) -> int:
    proc = OutputProcessor(tok)
    params = SamplingParams(max_tokens=10_000, output_kind=RequestOutputKind.DELTA)
    n = 0
    for i, ids in enumerate(streams):
        rid = f"r{i}"
        proc.add_request(
            EngineCoreRequest(
                rid, prompt_token_ids=prompt, sampling_params=params, external_req_id=rid
            )
        )
        for token_id in ids:
            proc.process_outputs([EngineCoreOutput(rid, new_token_ids=[token_id])])
        proc.abort_requests([rid], internal=True)
        n += len(ids)
    return n


_VLLM_SCRIPT = r"""
import json, sys, time
import numpy as np
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.tokenizers import get_tokenizer
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
from vllm.v1.engine.detokenizer import IncrementalDetokenizer
from vllm.v1.engine.output_processor import OutputProcessor
from tokenizers.decoders import DecodeStream

model, prompt, streams, rounds = json.loads(sys.stdin.read())
tok = get_tokenizer(model)

def request(rid, params):
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, mm_features=None,
                             sampling_params=params, pooling_params=None, arrival_time=0.0,
                             lora_request=None, cache_salt=None, data_parallel_rank=None,
                             external_req_id=rid)

def ceiling():
    backend = tok._tokenizer
    for ids in streams:
        step = DecodeStream(ids=prompt, skip_special_tokens=True).step
        pieces = [step(backend, t) or "" for t in ids]
    return sum(map(len, streams))

def detok():
    params = SamplingParams(max_tokens=10_000)
    for i, ids in enumerate(streams):
        d = IncrementalDetokenizer.from_new_request(tok, request(f"r{i}", params))
        pieces = []
        for t in ids:
            d.update([t], False)
            pieces.append(d.get_next_output_text(False, True))
    return sum(map(len, streams))

def outproc():
    proc = OutputProcessor(tok, log_stats=False)
    params = SamplingParams(max_tokens=10_000, output_kind=RequestOutputKind.DELTA)
    for i, ids in enumerate(streams):
        rid = f"r{i}"
        proc.add_request(request(rid, params), None)
        for t in ids:
            proc.process_outputs([EngineCoreOutput(request_id=rid, new_token_ids=[t])])
        proc.abort_requests([rid], internal=True)
    return sum(map(len, streams))

best = {"ceiling": 0.0, "detokenizer": 0.0, "output_processor": 0.0}
fns = {"ceiling": ceiling, "detokenizer": detok, "output_processor": outproc}
for _ in range(rounds):
    for name, fn in fns.items():
        t0 = time.process_time(); n = fn(); dt = time.process_time() - t0
        best[name] = max(best[name], n / dt)
print("@@" + json.dumps(best))
"""


def _run_vllm(
    python: str, model: str, prompt: list[int], streams: list[list[int]], rounds: int
) -> dict[str, float]:
    import os
    import subprocess

    proc = subprocess.run(
        [python, "-c", _VLLM_SCRIPT],
        input=json.dumps([model, prompt, streams, rounds]),
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    result: dict[str, float] = json.loads(proc.stdout[proc.stdout.rindex("@@") + 2 :])
    return result


def _best_rate(fn: Callable[[], int], rounds: int) -> float:
    best = 0.0
    for _ in range(rounds):
        t0 = time.process_time()
        n = fn()
        dt = time.process_time() - t0
        best = max(best, n / dt if dt > 0 else 0.0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--vllm-python", help="a python with stock vLLM, for vllm_* rows")
    args = parser.parse_args()
    tok = load_tokenizer(args.model)
    prompt = tok.encode("Write something: ")
    body = tok.encode(TEXT * 8, add_special_tokens=False)
    streams = [body[i % 7 :] for i in range(args.streams)]
    plain = SamplingParams(max_tokens=10_000)
    stops = SamplingParams(max_tokens=10_000, stop=["never appears", "zzz"])
    cases: dict[str, Callable[[], int]] = {
        "ceiling": lambda: _ceiling(tok, prompt, streams),
        "detokenizer": lambda: _detokenizer(tok, prompt, streams, plain),
        "detokenizer+stop": lambda: _detokenizer(tok, prompt, streams, stops),
        "output_processor": lambda: _output_processor(tok, prompt, streams),
    }
    best = dict.fromkeys(cases, 0.0)
    for _ in range(args.rounds):  # interleaved, so load drifts hit every case alike
        for name, fn in cases.items():
            best[name] = max(best[name], _best_rate(fn, 1))
    result = {
        name: {"tokens_per_cpu_s": round(rate), "ratio": round(rate / best["ceiling"], 3)}
        for name, rate in best.items()
    }
    if args.vllm_python:
        theirs = _run_vllm(args.vllm_python, args.model, prompt, streams, args.rounds)
        for name in ("detokenizer", "output_processor"):
            result[f"vllm_{name}"] = {
                "tokens_per_cpu_s": round(theirs[name]),
                "ratio": round(theirs[name] / theirs["ceiling"], 3),
            }
        result["vllm_ceiling"] = {"tokens_per_cpu_s": round(theirs["ceiling"]), "ratio": 1.0}
    result["_meta"] = {
        "model": args.model,
        "streams": len(streams),  # type: ignore[dict-item]
        "tokens_per_stream": len(body),
        "rounds": args.rounds,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for name, r in result.items():
        if name != "_meta":
            print(f"{name:18s} {r['tokens_per_cpu_s']:>10,} tok/CPU-s   ratio {r['ratio']:.3f}")


if __name__ == "__main__":
    main()
