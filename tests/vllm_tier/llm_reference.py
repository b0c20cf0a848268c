"""vLLM's own ``LLM.generate`` / ``LLM.chat`` on the cases of test_text_frontend_parity.py.

Not a test module: run in vLLM's python (``TRIO_VLLM_TEST_VLLM_PYTHON``) as
``PY llm_reference.py MODEL_DIR < cases.json``; prints ``@@RESULT@@`` and a JSON list of
RequestOutputs (the shape ``test_text_frontend_parity.request_output_json`` gives ours).
Each case runs alone (one request in the batch), in order, as on the trio-vllm side, so
the batch composition is the same on both.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _position(pos: Any) -> Any:
    if pos is None:
        return None
    return [[tid, lp.logprob, lp.rank, lp.decoded_token] for tid, lp in pos.items()]


def request_output_json(out: Any) -> dict[str, Any]:
    return {
        "prompt": out.prompt,
        "prompt_token_ids": list(out.prompt_token_ids),
        "prompt_logprobs": None
        if out.prompt_logprobs is None
        else [_position(p) for p in out.prompt_logprobs],
        "finished": out.finished,
        "outputs": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": list(c.token_ids),
                "cumulative_logprob": c.cumulative_logprob,
                "logprobs": None if c.logprobs is None else [_position(p) for p in c.logprobs],
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in out.outputs
        ],
    }


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    model = sys.argv[1]
    cases = json.load(sys.stdin)
    llm = LLM(
        model=model,
        load_format="dummy",
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        max_num_seqs=8,
    )
    results = []
    for case in cases:
        fields = dict(case["params"])
        if fields.get("structured_outputs") is not None:
            fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
        params = SamplingParams(**fields)
        if case["kind"] == "chat":
            (out,) = llm.chat(case["messages"], params, use_tqdm=False)
        else:
            (out,) = llm.generate([case["prompt"]], params, use_tqdm=False)
        results.append(request_output_json(out))
    sys.stdout.write("@@RESULT@@" + json.dumps(results) + "\n")
    sys.stdout.flush()
    # Stop the engine core process now, not from a finalizer at exit (where a hurried
    # teardown can leave its /dev/shm segments behind).
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
