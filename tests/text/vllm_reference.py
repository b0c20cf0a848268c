"""Run the text-layer parity cases through stock vLLM's own frontend code (not a test module).

Executed by tests/text/test_vllm_parity.py with ``TRIO_VLLM_TEST_VLLM_PYTHON`` (a python
with vLLM 0.32.0): reads a JSON list of cases on stdin, prints a JSON list of results.
Every case is fed through ``vllm.v1.engine.output_processor.OutputProcessor`` (and
``ParentRequest`` for ``n > 1``) with vLLM's tokenizer for the model directory; the
result has the same shape as ``tests/text/_parity.py`` produces from trio-vllm.

It runs in vLLM's interpreter, which has no trio-vllm: it imports only the standard
library at the top (vLLM inside the functions), so ``_parity.py`` imports the parts both
sides share from here (`replay_steps`, `request_output_dict`), not the other way round.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable


def _lp_position(pos: Any) -> Any:
    if pos is None:
        return None
    return [[tid, lp.logprob, lp.rank, lp.decoded_token] for tid, lp in pos.items()]


def request_output_dict(out: Any) -> dict[str, Any]:
    """A ``RequestOutput`` (vLLM's or trio-vllm's: the same fields) as plain JSON."""
    return {
        "request_id": out.request_id,
        "prompt": out.prompt,
        "prompt_token_ids": list(out.prompt_token_ids),
        "prompt_logprobs": None
        if out.prompt_logprobs is None
        else [_lp_position(p) for p in out.prompt_logprobs],
        "finished": out.finished,
        "num_cached_tokens": out.num_cached_tokens,
        "outputs": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": list(c.token_ids),
                "cumulative_logprob": c.cumulative_logprob,
                "logprobs": None if c.logprobs is None else [_lp_position(p) for p in c.logprobs],
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in out.outputs
        ],
    }


def logprob_columns(
    rows: dict[str, Any], make: Callable[..., Any], int_type: Any, float_type: Any
) -> tuple[Any, Any, Any]:
    """A case's logprob rows as (token ids, logprobs, ranks) arrays: ``make`` is
    ``np.array`` or ``torch.tensor``, with that library's dtypes."""
    return (make(rows["token_ids"], dtype=int_type), make(rows["logprobs"], dtype=float_type),
            make(rows["ranks"], dtype=int_type))  # fmt: skip


def replay_steps(
    case: dict[str, Any],
    ids: list[str],
    processor: Any,
    *,
    logprobs: Callable[[dict[str, Any]], Any],
    prompt_logprobs: Callable[[dict[str, Any]], Any],
    output: Callable[[str, dict[str, Any], Any, Any], Any],
) -> dict[str, Any]:
    """Feed ``case["steps"]`` to an ``OutputProcessor``, one ``process_outputs`` call a
    step. Each side brings its own constructors: ``logprobs(rows)`` and
    ``prompt_logprobs(rows)`` for an item's (sample, prompt) logprob rows, and
    ``output(request_id, item, logprobs, prompt_logprobs)`` for the ``EngineCoreOutput``;
    ``ids`` are the child request ids, by child index."""
    steps_out = []
    for step in case["steps"]:
        outs = []
        for item in step:
            rows, prompt_rows = item.get("logprobs"), item.get("prompt_logprobs")
            lp = None if rows is None else logprobs(rows)
            plp = None if prompt_rows is None else prompt_logprobs(prompt_rows)
            outs.append(output(ids[item.get("child", 0)], item, lp, plp))
        result = processor.process_outputs(outs)
        steps_out.append(
            {
                "outputs": [request_output_dict(o) for o in result.request_outputs],
                "abort": sorted(ids.index(r) for r in result.reqs_to_abort),
            }
        )
    return {"steps": steps_out}


def run_case(case: dict[str, Any], tokenizers: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch
    import vllm.v1.engine.detokenizer as detok_mod
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.engine.parallel_sampling import ParentRequest
    from vllm.v1.outputs import LogprobsLists, LogprobsTensors

    model = case["model"]
    if model not in tokenizers:
        tokenizers[model] = get_tokenizer(model)
    tokenizer = tokenizers[model]
    original = detok_mod.uses_fast_detokenizer
    if case.get("slow"):
        detok_mod.uses_fast_detokenizer = lambda tok: False
    try:
        kwargs = dict(case["params"])
        kwargs["output_kind"] = RequestOutputKind(kwargs.pop("output_kind", 0))
        params = SamplingParams(**kwargs)
        processor = OutputProcessor(tokenizer, log_stats=False)
        request = EngineCoreRequest(
            request_id=case["request_id"],
            prompt_token_ids=list(case["prompt_token_ids"]),
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            external_req_id=case["external_req_id"],
        )
        prompt = case.get("prompt")
        if params.n == 1:
            processor.add_request(request, prompt, None, 0)
            ids = [request.request_id]
        else:
            parent = ParentRequest(request)
            ids = []
            for idx in range(params.n):
                child_id, child_params = parent.get_child_info(idx)
                child = EngineCoreRequest(
                    request_id=child_id,
                    prompt_token_ids=list(case["prompt_token_ids"]),
                    mm_features=None,
                    sampling_params=child_params,
                    pooling_params=None,
                    arrival_time=time.time(),
                    lora_request=None,
                    cache_salt=None,
                    data_parallel_rank=None,
                    external_req_id=case["external_req_id"],
                )
                processor.add_request(child, prompt, parent, idx)
                ids.append(child_id)

        def output(request_id: str, item: dict[str, Any], lp: Any, plp: Any) -> Any:
            finish = item.get("finish_reason")
            return EngineCoreOutput(
                request_id=request_id,
                new_token_ids=list(item["new_token_ids"]),
                new_logprobs=lp,
                new_prompt_logprobs_tensors=plp,
                finish_reason=None if finish is None else FinishReason(finish),
                stop_reason=item.get("stop_reason"),
            )

        return replay_steps(
            case, ids, processor,
            logprobs=lambda rows: LogprobsLists(
                *logprob_columns(rows, np.array, np.int32, np.float32), None
            ),
            prompt_logprobs=lambda rows: LogprobsTensors(
                *logprob_columns(rows, torch.tensor, torch.int32, torch.float32)
            ),
            output=output,
        )  # fmt: skip
    finally:
        detok_mod.uses_fast_detokenizer = original


def run_params(case: dict[str, Any], tokenizers: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.tokenizers import get_tokenizer

    model = case["model"]
    if model not in tokenizers:
        tokenizers[model] = get_tokenizer(model)
    tokenizer = tokenizers[model]
    params = SamplingParams(**case["params"])
    params.update_from_generation_config(case["generation_config"], tokenizer.eos_token_id)
    params.update_from_tokenizer(tokenizer)
    return {
        "_eos_token_id": params._eos_token_id,
        "stop_token_ids": params.stop_token_ids,
        "_all_stop_token_ids": sorted(params._all_stop_token_ids),
        "_bad_words_token_ids": params._bad_words_token_ids,
    }


def run_tokenizer(case: dict[str, Any], tokenizers: dict[str, Any]) -> dict[str, Any]:
    from vllm.tokenizers import get_tokenizer
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    model = case["model"]
    if model not in tokenizers:
        tokenizers[model] = get_tokenizer(model)
    tok = tokenizers[model]
    out: dict[str, Any] = {
        "encode": [tok.encode(t) for t in case["texts"]],
        "encode_plain": [tok.encode(t, add_special_tokens=False) for t in case["texts"]],
        "decode": [tok.decode(ids) for ids in case["id_lists"]],
        "decode_skip": [tok.decode(ids, skip_special_tokens=True) for ids in case["id_lists"]],
        "single": [convert_ids_list_to_tokens(tok, ids) for ids in case["id_lists"]],
        "eos_token_id": tok.eos_token_id,
        "max_token_id": tok.max_token_id,
        "chat": [
            tok.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=False, continue_final_message=True
            )
            if agp == "continue"
            else tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=agp)
            for conv, agp in case["chats"]
        ],
    }
    return out


_CONFIGS: dict[tuple[str, int], Any] = {}


def _vllm_config(model: str, max_model_len: int) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    key = (model, max_model_len)
    if key not in _CONFIGS:
        args = EngineArgs(
            model=model,
            load_format="dummy",
            max_model_len=max_model_len,
            dtype="float32",
            enforce_eager=True,
        )
        _CONFIGS[key] = args.create_engine_config()
    return _CONFIGS[key]


def run_inputs(case: dict[str, Any], tokenizers: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    processor = InputProcessor(_vllm_config(case["model"], case["max_model_len"]))
    results = []
    for item in case["items"]:
        try:
            request = processor.process_inputs(
                "ext-id",
                item["prompt"],
                SamplingParams(**item["params"]),
                supported_tasks=("generate",),
            )
            processor.assign_request_id(request)
        except Exception as exc:
            results.append({"error": str(exc)})
            continue
        p = request.sampling_params
        results.append(
            {
                "request_id": request.request_id,
                "external_req_id": request.external_req_id,
                "prompt_token_ids": list(request.prompt_token_ids),
                "max_tokens": p.max_tokens,
                "_eos_token_id": p._eos_token_id,
                "stop_token_ids": p.stop_token_ids,
                "_all_stop_token_ids": sorted(p._all_stop_token_ids),
                "output_text_buffer_length": p.output_text_buffer_length,
            }
        )
    return {"items": results}


def run_chat_parse(case: dict[str, Any], tokenizers: dict[str, Any]) -> dict[str, Any]:
    from vllm.renderers.chat_utils import parse_chat_messages

    config = _vllm_config(case["model"], case.get("max_model_len", 32))
    conversation, _, _ = parse_chat_messages(
        case["messages"], config.model_config, content_format="string"
    )
    return {"conversation": json.loads(json.dumps(conversation))}


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # before vLLM is imported
    cases = json.load(sys.stdin)
    tokenizers: dict[str, Any] = {}
    results = []
    for case in cases:
        kind = case.get("kind", "outputs")
        fn = {
            "outputs": run_case,
            "params": run_params,
            "tokenizer": run_tokenizer,
            "inputs": run_inputs,
            "chat_parse": run_chat_parse,
        }[kind]
        results.append(fn(case, tokenizers))
    sys.stdout.write("\n@@RESULT@@" + json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
