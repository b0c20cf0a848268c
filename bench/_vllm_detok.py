"""Run by *another* python (one with vLLM): vLLM's own frontend pipeline on a firehose.

``bench/bench_detok.py --vllm-python PY`` runs ``PY this_file.py --input A --output B
--model DIR --tokens T --prompts FILE``. The script builds the ``VllmConfig`` for the
model directory (weights never loaded: the engine is a reference engine in firehose mode,
connected in direct mode to the sockets this client binds), vLLM's real
``AsyncMPClient`` with ``client_addresses`` (as ``bench firehose`` case e does), vLLM's
``OutputProcessor`` with vLLM's tokenizer for DIR and one ``RequestOutputCollector`` per
request, and runs ``AsyncLLM``'s output handler loop (chunks of
``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE``, a yield between chunks) with one consumer task per
request reading its collector the way ``AsyncLLM.generate`` does. Prints one JSON line:
output tokens, characters, seconds and the process's CPU seconds from the first ADD to
the last finished output.

Never imported by trio-vllm: it imports vLLM and the standard library only.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import time
from typing import Any


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    vllm = importlib.import_module("vllm")
    arg_utils = importlib.import_module("vllm.engine.arg_utils")
    envs = importlib.import_module("vllm.envs")
    engine_mod = importlib.import_module("vllm.v1.engine")
    core_client = importlib.import_module("vllm.v1.engine.core_client")
    output_processor_mod = importlib.import_module("vllm.v1.engine.output_processor")
    executor = importlib.import_module("vllm.v1.executor.abstract").Executor
    get_tokenizer = importlib.import_module("vllm.tokenizers").get_tokenizer
    kind = importlib.import_module("vllm.sampling_params").RequestOutputKind

    config = arg_utils.EngineArgs(
        model=args.model, load_format="dummy", dtype="float32", max_model_len=256,
        enforce_eager=True,
    ).create_engine_config()  # fmt: skip
    tokenizer = get_tokenizer(args.model)
    prompts: list[list[int]] = json.loads(open(args.prompts).read())  # noqa: ASYNC230, SIM115
    client = core_client.AsyncMPClient(
        config,
        executor,
        log_stats=False,
        client_addresses={"input_address": args.input, "output_address": args.output},
    )
    processor = output_processor_mod.OutputProcessor(tokenizer, log_stats=False)
    chunk_size = envs.VLLM_V1_OUTPUT_PROC_CHUNK_SIZE
    tokens = chars = 0
    try:
        requests, queues = [], []
        for i, prompt in enumerate(prompts):
            params = vllm.SamplingParams(
                max_tokens=args.tokens, temperature=0.0, output_kind=kind.DELTA
            )
            request = engine_mod.EngineCoreRequest(
                request_id=f"detok-{i}", prompt_token_ids=prompt, mm_features=None,
                sampling_params=params, pooling_params=None, arrival_time=time.time(),
                lora_request=None, cache_salt=None, data_parallel_rank=None,
                external_req_id=f"detok-{i}",
            )  # fmt: skip
            requests.append(request)
            queues.append(output_processor_mod.RequestOutputCollector(kind.DELTA, f"detok-{i}"))

        async def output_handler() -> None:
            # AsyncLLM._run_output_handler's loop, minus stats and multimodal caches.
            while True:
                outputs = await client.get_output_async()
                num = len(outputs.outputs)
                for start in range(0, num, chunk_size):
                    end = start + chunk_size
                    processed = processor.process_outputs(
                        outputs.outputs[start:end], outputs.timestamp, None
                    )
                    if end < num:
                        await asyncio.sleep(0)
                    if processed.reqs_to_abort:
                        await client.abort_requests_async(processed.reqs_to_abort)

        async def consume(queue: Any) -> None:
            # AsyncLLM.generate's loop.
            nonlocal tokens, chars
            finished = False
            while not finished:
                out = queue.get_nowait() or await queue.get()
                finished = out.finished
                for c in out.outputs:
                    tokens += len(c.token_ids)
                    chars += len(c.text)

        start, cpu = time.perf_counter(), time.process_time()
        for request, queue in zip(requests, queues, strict=True):
            processor.add_request(request, None, None, 0, queue)
            await client.add_request_async(request)
        handler = asyncio.create_task(output_handler())
        try:
            await asyncio.gather(*(consume(q) for q in queues))
        finally:
            handler.cancel()
        seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    finally:
        client.shutdown()
    return {"tokens": tokens, "chars": chars, "seconds": seconds, "cpu_s": cpu_s,
            "vllm_version": vllm.__version__}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--prompts", required=True, help="JSON file: a list of id lists")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    result = asyncio.run(_run(args))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
