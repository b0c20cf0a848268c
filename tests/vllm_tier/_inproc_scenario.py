"""Run by a python *with vLLM* (and trio-vllm's ``src`` on PYTHONPATH): InprocEngine checks.

Prints one JSON object with what it observed; ``test_inproc.py`` asserts on it.
Usage: PYTHON _inproc_scenario.py MODEL_PATH
"""

from __future__ import annotations

import json
import os
import sys

from trio_vllm.client._prepare import make_request
from trio_vllm.inproc import InprocEngine


def main() -> None:
    model = sys.argv[1]
    report: dict[str, object] = {"available": InprocEngine.available(), "pid": os.getpid()}
    engine_args = {
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "max_model_len": 256,
        "enforce_eager": True,
        "max_num_seqs": 8,
        # With VLLM_ENABLE_V1_MULTIPROCESSING=0 this keeps the worker in this process
        # (vLLM's CPU platform otherwise switches to a worker process).
        "distributed_executor_backend": "uni",
    }
    with InprocEngine(model, engine_args=engine_args) as engine:
        report["vllm_version"] = engine.vllm_version
        report["max_model_len"] = engine.max_model_len
        # generate: greedy tokens for the documented prompt.
        outputs = list(engine.generate(make_request([1, 5, 7, 9], max_tokens=8)))
        report["tokens"] = [t for o in outputs for t in o.new_token_ids]
        report["finish_reason"] = str(outputs[-1].finish_reason)
        # raw API: add, step, abort mid-stream.
        request = make_request([1, 5, 7, 9], max_tokens=200)
        engine.add_request(request)
        seen: list[int] = []
        while len(seen) < 3:
            for out in engine.get_output().outputs:
                seen.extend(out.new_token_ids)
        engine.abort_requests([request.request_id])
        report["aborted_live"] = engine.live_requests
        steps_after_abort = 0
        while engine.has_unfinished_requests() and steps_after_abort < 10:
            engine.get_output()
            steps_after_abort += 1
        report["unfinished_after_abort"] = engine.has_unfinished_requests()
        # breaking out of generate aborts too.
        for _ in engine.generate(make_request([3, 4], max_tokens=200)):
            break
        report["live_after_break"] = engine.live_requests
        # utilities.
        report["supported_tasks"] = list(engine.get_supported_tasks())
        report["reset_prefix_cache"] = engine.reset_prefix_cache()
        report["is_sleeping"] = engine.is_sleeping()
        try:
            engine.sleep(1, "wait")
        except ValueError as exc:
            report["wait_mode"] = str(exc)
        # The engine still works after all that.
        again = list(engine.generate(make_request([1, 5, 7, 9], max_tokens=4)))
        report["tokens_again"] = [t for o in again for t in o.new_token_ids]
    print("SCENARIO " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
