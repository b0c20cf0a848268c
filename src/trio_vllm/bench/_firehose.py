"""``trio-vllm bench firehose``: output throughput, side by side in one run.

The reference engine runs in firehose mode: every ADD joins a stream of messages of
BATCH one-token outputs, sent as fast as the output socket takes them. Cases:

a. the ceiling: a blocking pyzmq PULL + trio-vllm's decoder in a tight loop;
b. trio-vllm's raw batch API (``add_request`` + ``get_output``) on trio;
c. the same on asyncio (through anyio);
d. one ``generate`` stream per request, one consumer task each, with C concurrent
   consumers (default 256 and 4096), on trio;
e. with ``--vllm-python``: vLLM's own ``AsyncMPClient`` in that python, reading a
   reference engine connected to the sockets it bound.

Every case gets a fresh engine and the same workload shape. Rates count from the
first ADD to the last finished output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from ..client import ReferenceEngines, make_request, open_client
from ._common import (
    ScratchDir,
    direct_engine,
    emit,
    engine_args,
    engine_command,
    fmt,
    machine,
    ratio,
    stop_process,
)

_VLLM_SCRIPT = Path(__file__).with_name("_vllm_firehose.py")
# The model config vLLM's client is built for (never loaded: the engine is ours).
_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    "tie_word_embeddings": False,
}  # fmt: skip
_PROMPT = [1, 2, 3]


def _rates(outputs: int, messages: float, seconds: float) -> dict[str, float]:
    return {
        "outputs": outputs,
        "messages": messages,
        "seconds": seconds,
        "outputs_per_s": outputs / seconds,
        "messages_per_s": messages / seconds,
    }


def run_ceiling(batch: int, requests: int, tokens: int) -> dict[str, float]:
    """(a) blocking pyzmq + ClientCodec."""
    with direct_engine(firehose=batch) as engine:
        reqs = [make_request(_PROMPT, max_tokens=tokens) for _ in range(requests)]
        start = time.perf_counter()
        for request in reqs:
            engine.send_add(request)
        outputs = messages = finished = 0
        while finished < requests:
            batch_out = engine.receive()
            messages += 1
            for out in batch_out.outputs:
                outputs += len(out.new_token_ids)
                finished += out.finish_reason is not None
        return _rates(outputs, messages, time.perf_counter() - start)


def _engines(batch: int) -> ReferenceEngines:
    return ReferenceEngines(model="echo", extra_args=engine_args(firehose=batch))


async def run_raw_api(batch: int, requests: int, tokens: int) -> dict[str, float]:
    """(b, c) ``add_request`` + ``get_output`` on the current backend."""
    async with open_client(_engines(batch), ready_timeout=120) as client:
        reqs = [make_request(_PROMPT, max_tokens=tokens) for _ in range(requests)]
        start = time.perf_counter()
        for request in reqs:
            await client.add_request(request)
        outputs = messages = finished = 0
        while finished < requests:
            batch_out = await client.get_output()
            messages += 1
            for out in batch_out.outputs:
                outputs += len(out.new_token_ids)
                finished += out.finish_reason is not None
        return _rates(outputs, messages, time.perf_counter() - start)


async def run_streams(batch: int, consumers: int, tokens: int) -> dict[str, float]:
    """(d) one ``generate`` stream and consumer task per request."""
    async with open_client(_engines(batch), ready_timeout=120) as client:
        reqs = [make_request(_PROMPT, max_tokens=tokens) for _ in range(consumers)]
        outputs = 0

        async def consume(request: Any) -> None:
            nonlocal outputs
            async with client.generate(request) as stream:
                async for out in stream:
                    outputs += len(out.new_token_ids)

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for request in reqs:
                tg.start_soon(consume, request)
        # Streams coalesce when a consumer lags, so count engine messages from outputs.
        return _rates(outputs, outputs / batch, time.perf_counter() - start)


def run_vllm(python: str, batch: int, requests: int, tokens: int) -> dict[str, Any]:
    """(e) vLLM's AsyncMPClient in ``python``, reading a direct-mode reference engine."""
    scratch = ScratchDir()
    model_dir = Path(scratch.path, "tiny-llama")
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(_TINY_LLAMA))
    inputs, outputs = scratch.endpoint("input"), scratch.endpoint("output")
    log = Path(scratch.path, "vllm.log")
    engine: subprocess.Popen[Any] | None = None
    try:
        with open(log, "wb") as log_file:
            client = subprocess.Popen(
                [python, str(_VLLM_SCRIPT), "--input", inputs, "--output", outputs,
                 "--requests", str(requests), "--tokens", str(tokens),
                 "--model", str(model_dir)],
                stdout=subprocess.PIPE, stderr=log_file, text=True,
                env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
            )  # fmt: skip
        # zmq connects retry until the client binds, so the order does not matter.
        engine = subprocess.Popen(
            engine_command(inputs, outputs, firehose=batch),
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
        result: dict[str, Any] = _rates(raw["outputs"], raw["messages"], raw["seconds"])
        result["vllm_version"] = raw["vllm_version"]
        return result
    finally:
        if engine is not None:
            stop_process(engine)
        scratch.close()


_LABELS = {
    "a": "a  raw ceiling: blocking pyzmq + decoder",
    "b": "b  trio-vllm get_output, trio",
    "c": "c  trio-vllm get_output, asyncio (anyio)",
    "e": "e  vLLM AsyncMPClient (asyncio)",
}


def _label(key: str) -> str:
    if key.startswith("d"):
        return f"d  trio-vllm streams, {key[1:]} consumers, trio"
    return _LABELS[key]


def run_one_batch(
    batch: int,
    *,
    messages: int,
    requests: int,
    consumers: list[int],
    vllm_python: str | None,
    progress: bool,
) -> dict[str, Any]:
    """Every case at ``batch`` outputs per message; returns cases and ratios."""
    total = messages * batch
    tokens = max(1, total // requests)
    cases: dict[str, dict[str, Any]] = {}

    def note(key: str) -> None:
        if progress:
            c = cases[key]
            print(
                f"  [{batch}/msg] {_label(key)}: {c['outputs_per_s']:,.0f} outputs/s",
                file=sys.stderr,
                flush=True,
            )

    cases["a"] = run_ceiling(batch, requests, tokens)
    note("a")
    cases["b"] = anyio.run(run_raw_api, batch, requests, tokens, backend="trio")
    note("b")
    cases["c"] = anyio.run(run_raw_api, batch, requests, tokens, backend="asyncio")
    note("c")
    for n in consumers:
        # At least 32 outputs per stream, so the run measures streaming, not ADDs.
        per_stream = max(32, total // n)
        cases[f"d{n}"] = anyio.run(run_streams, batch, n, per_stream, backend="trio")
        cases[f"d{n}"]["consumers"] = n
        note(f"d{n}")
    if vllm_python:
        cases["e"] = run_vllm(vllm_python, batch, requests, tokens)
        note("e")

    def r(num: str, den: str) -> float | None:
        n, d = cases.get(num), cases.get(den)
        return ratio(n["outputs_per_s"], d["outputs_per_s"]) if n and d else None

    ratios: dict[str, float | None] = {"b/a": r("b", "a"), "c/a": r("c", "a")}
    ratios["b/e"] = r("b", "e")
    ratios["e/a"] = r("e", "a")
    for n in consumers:
        ratios[f"d{n}/b"] = r(f"d{n}", "b")
    return {
        "batch": batch,
        "requests": requests,
        "outputs_per_request": tokens,
        "cases": cases,
        "ratios": ratios,
    }


_TARGETS = {"b/a": 0.8, "b/e": 3.0, "d256/b": 0.25}


def run(args: Any) -> int:
    batches = [int(b) for b in str(args.batch).split(",") if b]
    consumers = [int(c) for c in str(args.consumers).split(",") if c]
    results = [
        run_one_batch(
            b,
            messages=args.messages,
            requests=args.requests,
            consumers=consumers,
            vllm_python=args.vllm_python,
            progress=not args.json and not args.quiet,
        )
        for b in batches
    ]
    report = {"bench": "firehose", "machine": machine(), "targets": _TARGETS, "runs": results}
    table: list[str] = []
    for res in results:
        table.append(
            f"firehose: {res['batch']} outputs/message, {res['requests']} requests x "
            f"{res['outputs_per_request']:,} outputs (streams: >= 32 outputs each)"
        )
        table.append(f"  {'case':44s} {'outputs/s':>12s} {'messages/s':>12s} {'vs a':>6s}")
        a = res["cases"]["a"]["outputs_per_s"]
        for key, c in res["cases"].items():
            table.append(
                f"  {_label(key):44s} {c['outputs_per_s']:12,.0f} {c['messages_per_s']:12,.0f}"
                f" {c['outputs_per_s'] / a:6.2f}"
            )
        parts = []
        for key, value in res["ratios"].items():
            if value is None:
                continue
            target = _TARGETS.get(key)
            mark = "" if target is None else (" ok" if value >= target else f" < {target}")
            parts.append(f"{key} {fmt(value, '.2f')}{mark}")
        table.append("  ratios: " + ", ".join(parts))
        table.append("")
    emit(report, as_json=args.json, table=table)
    return 0
