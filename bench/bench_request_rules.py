"""Micro-benchmark of request validation on the hot path, this tree against a baseline
git revision, measured in the same run (interleaved rounds, each side in its own
subprocess with its own ``src`` first on the path).

Workloads, per request:

* ``raw``: ``make_request(prompt, max_tokens=16, temperature=0.7, top_p=0.9, ...)``, the
  raw client's checks before sending and the encoding of the ADD (its ``Wire``, with
  the engines' limits), i.e. what ``add_request`` does before the socket;
* ``text``: ``InputProcessor.process_inputs`` of a token prompt with ``SamplingParams``
  (the text layer's validation, frontend duties and request building; no tokenizer).

Prints microseconds per request (``time.process_time``, best of the rounds) for both
sides and ``ratio = this tree / baseline`` (lower is better; 1.0 = no change). Not a
test: nothing here asserts.

    python bench/bench_request_rules.py [--baseline REV] [--rounds N] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
N = 20_000
PROMPT = list(range(1, 65))


def _workloads() -> dict[str, float]:
    from trio_vllm.client._prepare import make_request
    from trio_vllm.client._wire import Wire
    from trio_vllm.protocol import SamplingParams
    from trio_vllm.text import InputProcessor

    # The raw client's own path: its Wire, with the engines' limits (as after startup).
    wire = Wire.create(profile=None, vllm_version="0.32.0", allow_insecure_serialization=False)
    wire.set_limits({0: {"max_model_len": 4096, "supports_lora": False}})
    wire.vocab_size = 32000

    def raw() -> None:
        for _ in range(N):
            request = make_request(
                PROMPT, max_tokens=16, temperature=0.7, top_p=0.9, top_k=40, seed=1,
                eos_token_id=2, request_id="r",
            )  # fmt: skip
            wire.validate_request(request)
            wire.encode_add(request)

    processor = InputProcessor(None, max_model_len=4096, vocab_size=32000)
    params = SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, top_k=40, seed=1)

    def text() -> None:
        for _ in range(N):
            processor.process_inputs("r", {"prompt_token_ids": PROMPT}, params)

    out = {}
    for name, fn in (("raw", raw), ("text", text)):
        start = time.process_time()
        fn()
        out[name] = (time.process_time() - start) / N * 1e6
    return out


def _side(src: str) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child"],
        env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = json.loads(proc.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="main", help="git revision (default: main)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_workloads()))
        return
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", args.baseline, "src"],
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        sides = {"baseline": str(Path(tmp) / "src"), "tree": str(REPO / "src")}
        best: dict[str, dict[str, float]] = {side: {} for side in sides}
        for _ in range(args.rounds):
            for side, src in sides.items():
                for name, us in _side(src).items():
                    best[side][name] = min(us, best[side].get(name, float("inf")))
    result = {
        name: {
            "baseline_us": round(best["baseline"][name], 3),
            "tree_us": round(best["tree"][name], 3),
            "ratio": round(best["tree"][name] / best["baseline"][name], 3),
        }
        for name in best["tree"]
    }
    if args.json:
        print(json.dumps({"baseline": args.baseline, "workloads": result}))
        return
    for name, row in result.items():
        print(
            f"{name:5} baseline {row['baseline_us']:8.2f} us  tree {row['tree_us']:8.2f} us"
            f"  ratio {row['ratio']:.3f}"
        )


if __name__ == "__main__":
    main()
