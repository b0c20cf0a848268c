"""Run by *another* python (one with vLLM): vLLM's own ``AsyncMPClient`` drains a firehose.

``trio-vllm bench firehose --vllm-python PY`` runs ``PY this_file.py --input A --output B
--requests N --tokens T --model DIR``. The script builds a minimal ``VllmConfig`` (the
tiny model config, dummy weights never loaded here, no tokenizer), constructs the real
``AsyncMPClient`` with ``client_addresses`` so that it binds the input ROUTER at ``A``
and the output PULL at ``B`` and waits for the engine's ready message, exactly as a vLLM
API server does for externally managed engines. The bench connects a reference engine
in direct mode to those addresses. The script then sends N ADDs with
``add_request_async`` and calls ``get_output_async`` until every request finished, and
prints one JSON line: outputs, messages, seconds, its CPU seconds.

Never imported by trio-vllm: it imports vLLM, pyzmq and the standard library only.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import json
import os
import sys
import time
from typing import Any


def _profile_module() -> Any:
    # By path: this python has vLLM, not necessarily trio-vllm (_profile.py is stdlib only).
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_profile.py")
    spec = importlib.util.spec_from_file_location("_trio_vllm_bench_profile", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _config(model: str) -> Any:
    engine_args = importlib.import_module("vllm.engine.arg_utils")
    return engine_args.EngineArgs(
        model=model,
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
    ).create_engine_config()


async def _run(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    # By name at run time: trio-vllm never imports vLLM (this runs in vLLM's python).
    sampling_params = importlib.import_module("vllm").SamplingParams
    engine_core_request = importlib.import_module("vllm.v1.engine").EngineCoreRequest
    async_mp_client = importlib.import_module("vllm.v1.engine.core_client").AsyncMPClient
    executor = importlib.import_module("vllm.v1.executor.abstract").Executor

    prof = _profile_module().Profile(args.profile)
    begin = time.perf_counter()
    # Binds both sockets and blocks until the engine's ready message arrived.
    client = async_mp_client(
        config,
        executor,
        log_stats=False,
        client_addresses={"input_address": args.input, "output_address": args.output},
    )
    ready_s = time.perf_counter() - begin
    # As vLLM's API server does once started (the bench does the same for trio-vllm).
    importlib.import_module("vllm.utils.gc_utils").freeze_gc_heap()
    if args.gc_threshold:  # the same collector setting as the bench's other cases
        gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])
    try:
        requests = [
            engine_core_request(
                request_id=f"vllm-bench-{i}",
                prompt_token_ids=[1, 2, 3],
                mm_features=None,
                sampling_params=sampling_params.from_optional(
                    max_tokens=args.tokens, detokenize=False, temperature=0.0
                ),
                pooling_params=None,
                arrival_time=time.time(),
                lora_request=None,
                cache_salt=None,
                data_parallel_rank=None,
            )
            for i in range(args.requests)
        ]
        start, cpu = time.perf_counter(), time.process_time()
        for request in requests:
            await client.add_request_async(request)
        if args.backlog:
            # Blocks the event loop on purpose: the engine's output piles up in the socket.
            time.sleep(args.backlog)  # noqa: ASYNC251
            start, cpu = time.perf_counter(), time.process_time()
        outputs = messages = finished = 0
        prof.start()
        while finished < args.requests:
            batch = await client.get_output_async()
            messages += 1
            for out in batch.outputs:
                outputs += len(out.new_token_ids)
                finished += out.finish_reason is not None
        prof.stop()
        seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    finally:
        client.shutdown()
    extra = {"profile": prof.top(10, per=messages)} if prof.enabled else {}
    return {
        **extra,
        "outputs": outputs,
        "messages": messages,
        "seconds": seconds,
        "cpu_s": cpu_s,
        "ready_s": ready_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--backlog",
        type=float,
        default=0.0,
        help="sleep S seconds after the ADDs, then time the drain",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile top-10 in RESULT")
    parser.add_argument("--gc-threshold", type=int, default=0, help="gc first threshold")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    config = _config(args.model)
    result = asyncio.run(_run(args, config))
    result["vllm_version"] = importlib.import_module("vllm").__version__
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
