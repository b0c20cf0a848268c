"""vLLM's own structured-output frontend on the constraints of test_structured_parity.py.

Not a test module: run in vLLM's python as ``PY structured_reference.py MODEL_DIR <
cases.json``; for each ``StructuredOutputsParams`` keyword map, runs
``SamplingParams._validate_structured_outputs`` (backend ``auto``, the model's
tokenizer) and prints ``@@RESULT@@`` and a JSON list: ``["ok", {fields as sent}]`` or
``["err", message]``. No engine is started.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types


def main() -> None:
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.config import StructuredOutputsConfig
    from vllm.sampling_params import StructuredOutputsParams

    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    model_config = types.SimpleNamespace(is_diffusion=False)
    config = StructuredOutputsConfig(backend="auto")
    results = []
    for case in json.load(sys.stdin):
        params = SamplingParams(structured_outputs=StructuredOutputsParams(**case))
        try:
            params._validate_structured_outputs(model_config, config, tokenizer)
        except Exception as exc:  # vLLM's VLLMValidationError (a ValueError)
            results.append(["err", str(exc)])
            continue
        so = params.structured_outputs
        results.append(["ok", {f.name: getattr(so, f.name) for f in dataclasses.fields(so)}])
    sys.stdout.write("@@RESULT@@" + json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
