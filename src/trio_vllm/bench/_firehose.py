"""``trio-vllm bench firehose``: output throughput, side by side in one run.

The reference engine runs in firehose mode: every ADD joins a stream of messages of
BATCH one-token outputs, sent as fast as the output socket takes them. Cases:

a. the ceiling: a blocking pyzmq PULL + trio-vllm's decoder in a tight loop (frames
   read as the client's transport reads them);
b. trio-vllm's raw batch API (``add_request`` + ``get_output``) on trio; ``b+`` the
   same, draining what is queued with ``get_output_nowait`` after each ``get_output``;
c. the same on asyncio (through anyio);
d. one ``generate`` stream per request, one consumer task each, with C concurrent
   consumers (default 256 and 4096), on trio (``d<N>+``: each consumer takes every
   buffered output per call with ``receive_batch``); ``f`` the same on asyncio (with
   ``--stream-backends trio,asyncio``; it was ``bench/bench_client.py``'s stream case);
e. with ``--vllm-python``: vLLM's own ``AsyncMPClient`` in that python, reading a
   reference engine connected to the sockets it bound.

Every case gets a fresh engine and the same workload shape. Rates count from the
first ADD to the last finished output.
"""

from __future__ import annotations

import contextlib
import gc
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
from ._profile import Profile, format_top

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


def _rates(outputs: int, messages: float, seconds: float, cpu_s: float) -> dict[str, float]:
    return {
        "outputs": outputs,
        "messages": messages,
        "seconds": seconds,
        "outputs_per_s": outputs / seconds,
        "messages_per_s": messages / seconds,
        # The client's own CPU time (every thread of its process): robust to machine
        # noise, where the rates are not (a busy client also slows the engine down).
        "cpu_s": cpu_s,
        "cpu_us_per_message": cpu_s / messages * 1e6,
    }


# --gc-threshold: the collector's first threshold in every case (None: Python's own).
_gc_threshold: int | None = None
_saved_thresholds: tuple[int, int, int] | None = None


def _freeze_heap() -> None:
    """What a server does once started (vLLM's API server: ``freeze_gc_heap``, and
    docs/performance.md tells trio-vllm's users the same): move everything alive into
    the permanent generation, so full collections in the hot loop skip the startup
    heap. Every case does it after its client is up; :func:`_finish` undoes it. With
    ``--gc-threshold N`` every case also sets the first threshold to N (the advice of
    "Keeping the collector out of the hot loop"), and :func:`_finish` restores it."""
    global _saved_thresholds
    gc.collect()
    gc.freeze()
    if _gc_threshold is not None:
        _saved_thresholds = gc.get_threshold()
        gc.set_threshold(_gc_threshold, *_saved_thresholds[1:])


def _finish(rates: dict[str, Any], prof: Profile) -> dict[str, Any]:
    global _saved_thresholds
    gc.unfreeze()
    if _saved_thresholds is not None:
        gc.set_threshold(*_saved_thresholds)
        _saved_thresholds = None
    if prof.enabled:
        rates["profile"] = prof.top(10, per=rates["messages"])
    return rates


def run_ceiling(
    batch: int, requests: int, tokens: int, backlog: float = 0.0, profile: bool = False
) -> dict[str, Any]:
    """(a) blocking pyzmq + ClientCodec, reading frames the way the transport does."""
    prof = Profile(profile)
    with direct_engine(firehose=batch) as engine:
        reqs = [make_request(_PROMPT, max_tokens=tokens) for _ in range(requests)]
        _freeze_heap()
        start, cpu = time.perf_counter(), time.process_time()
        for request in reqs:
            engine.send_add(request)
        if backlog:
            time.sleep(backlog)
            start, cpu = time.perf_counter(), time.process_time()
        outputs = messages = finished = 0
        # Read as the client's transport does (AsyncSocket._recv_message): a zmq.Frame
        # per frame, copied out, its `more` field read. recv_multipart asks
        # getsockopt(RCVMORE) per frame instead, which builds a SocketOption enum
        # each time: a cost the client does not pay.
        recv = engine.outputs.recv
        decode = engine.codec.decode_outputs
        prof.start()
        while finished < requests:
            frame = recv(copy=False)
            message = [frame.bytes]
            while frame.more:
                frame = recv(copy=False)
                message.append(frame.bytes)
            batch_out: Any = decode(message)
            messages += 1
            for out in batch_out.outputs:
                outputs += len(out.new_token_ids)
                finished += out.finish_reason is not None
        prof.stop()
        rates = _rates(outputs, messages, time.perf_counter() - start, time.process_time() - cpu)
        return _finish(rates, prof)


def _engines(batch: int) -> ReferenceEngines:
    return ReferenceEngines(model="echo", extra_args=engine_args(firehose=batch))


async def run_raw_api(
    batch: int,
    requests: int,
    tokens: int,
    drain: bool = False,
    backlog: float = 0.0,
    profile: bool = False,
) -> dict[str, Any]:
    """(b, c) ``add_request`` + ``get_output`` on the current backend.

    With ``drain``, every ``get_output`` is followed by ``get_output_nowait`` until
    the queue is empty: one checkpoint per burst instead of one per message.
    """
    prof = Profile(profile)
    async with open_client(_engines(batch), ready_timeout=120) as client:
        reqs = [make_request(_PROMPT, max_tokens=tokens) for _ in range(requests)]
        _freeze_heap()
        start, cpu = time.perf_counter(), time.process_time()
        for request in reqs:
            await client.add_request(request)
        if backlog:
            # Blocks the event loop on purpose: the engine's output piles up in the socket.
            time.sleep(backlog)  # noqa: ASYNC251
            start, cpu = time.perf_counter(), time.process_time()
        outputs = messages = finished = 0
        prof.start()
        while finished < requests:
            batches = [await client.get_output()]
            if drain:
                with contextlib.suppress(anyio.WouldBlock):
                    while True:
                        batches.append(client.get_output_nowait())
            for batch_out in batches:
                messages += 1
                for out in batch_out.outputs:
                    outputs += len(out.new_token_ids)
                    finished += out.finish_reason is not None
        prof.stop()
        rates = _rates(outputs, messages, time.perf_counter() - start, time.process_time() - cpu)
        return _finish(rates, prof)


async def run_streams(
    batch: int,
    consumers: int,
    tokens: int,
    backlog: float = 0.0,
    profile: bool = False,
    batched: bool = False,
) -> dict[str, Any]:
    """(d) one ``generate`` stream and consumer task per request; with ``batched``
    (d+) the consumers call ``receive_batch`` instead of iterating."""
    prof = Profile(profile)
    async with open_client(_engines(batch), ready_timeout=120) as client:
        reqs = [make_request(_PROMPT, max_tokens=tokens) for _ in range(consumers)]
        outputs = opened = 0
        all_open = anyio.Event()

        async def consume(request: Any) -> None:
            nonlocal outputs, opened
            async with client.generate(request) as stream:
                opened += 1
                if opened == consumers:
                    all_open.set()
                if not batched:
                    async for out in stream:
                        outputs += len(out.new_token_ids)
                    return
                with contextlib.suppress(anyio.EndOfStream):
                    while True:
                        for out in await stream.receive_batch():
                            outputs += len(out.new_token_ids)

        before = 0
        _freeze_heap()
        start, cpu = time.perf_counter(), time.process_time()
        async with anyio.create_task_group() as tg:
            for request in reqs:
                tg.start_soon(consume, request)
            if backlog:
                await all_open.wait()
                time.sleep(backlog)  # noqa: ASYNC251 (blocks the loop on purpose)
                start, cpu = time.perf_counter(), time.process_time()
                before = outputs  # count only what is received from now on
            else:
                await all_open.wait()
            prof.start()
        prof.stop()
        outputs -= before
        # Streams coalesce when a consumer lags, so count engine messages from outputs.
        rates = _rates(
            outputs, outputs / batch, time.perf_counter() - start, time.process_time() - cpu
        )
        return _finish(rates, prof)


def run_vllm(
    python: str,
    batch: int,
    requests: int,
    tokens: int,
    backlog: float = 0.0,
    profile: bool = False,
) -> dict[str, Any]:
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
                 "--model", str(model_dir), "--backlog", str(backlog),
                 *(["--profile"] if profile else []),
                 *(["--gc-threshold", str(_gc_threshold)] if _gc_threshold else [])],
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
        result: dict[str, Any] = _rates(
            raw["outputs"], raw["messages"], raw["seconds"], raw["cpu_s"]
        )
        result["vllm_version"] = raw["vllm_version"]
        if "profile" in raw:
            result["profile"] = raw["profile"]
        return result
    finally:
        if engine is not None:
            stop_process(engine)
        scratch.close()


_LABELS = {
    "a": "a  ceiling: blocking pyzmq + decoder",
    "b": "b  trio-vllm get_output, trio",
    "b+": "b+ get_output + get_output_nowait, trio",
    "c": "c  trio-vllm get_output, asyncio (anyio)",
    "e": "e  vLLM AsyncMPClient (asyncio)",
}


_ALL_CASES: frozenset[str] = frozenset({"a", "b", "b+", "c", "d", "e"})


def _label(key: str) -> str:
    if key.startswith("d") and key.endswith("+"):
        return f"d+ streams, {key[1:-1]} consumers, receive_batch, trio"
    if key.startswith("d"):
        return f"d  trio-vllm streams, {key[1:]} consumers, trio"
    if key.startswith("f"):
        return f"f  trio-vllm streams, {key[1:]} consumers, asyncio"
    return _LABELS[key]


def _run_cases(
    batch: int,
    *,
    messages: int,
    requests: int,
    consumers: list[int],
    vllm_python: str | None,
    backlog: float,
    progress: bool,
    stream_backends: tuple[str, ...] = ("trio",),
    profile: bool = False,
    selected: frozenset[str] = _ALL_CASES,
) -> dict[str, Any]:
    total = messages * batch
    tokens = max(1, total // requests)
    cases: dict[str, dict[str, Any]] = {}
    mode = f"backlog {backlog:.1f} s" if backlog else "live"

    def note(key: str) -> None:
        if progress:
            c = cases[key]
            print(
                f"  [{batch}/msg, {mode}] {_label(key)}: {c['outputs_per_s']:,.0f} outputs/s",
                file=sys.stderr,
                flush=True,
            )

    p = profile
    if "a" in selected:
        cases["a"] = run_ceiling(batch, requests, tokens, backlog, p)
        note("a")
    for key, drain, backend in (
        ("b", False, "trio"),
        ("b+", True, "trio"),
        ("c", False, "asyncio"),
    ):
        if key in selected:
            args = (batch, requests, tokens, drain, backlog, p)
            cases[key] = anyio.run(run_raw_api, *args, backend=backend)
            note(key)
    for backend in stream_backends if "d" in selected else ():
        for n in consumers:
            # At least 32 outputs per stream, so the run measures streaming, not ADDs.
            per_stream = max(32, total // n)
            key = f"{'d' if backend == 'trio' else 'f'}{n}"
            cases[key] = anyio.run(run_streams, batch, n, per_stream, backlog, p, backend=backend)
            cases[key]["consumers"] = n
            note(key)
            if backend == "trio":
                cases[f"d{n}+"] = anyio.run(
                    run_streams, batch, n, per_stream, backlog, p, True, backend="trio"
                )
                cases[f"d{n}+"]["consumers"] = n
                note(f"d{n}+")
    errors: dict[str, str] = {}
    if vllm_python and "e" in selected:
        try:
            cases["e"] = run_vllm(vllm_python, batch, requests, tokens, backlog, p)
            note("e")
        except (RuntimeError, OSError) as exc:
            # The other cases stand on their own; say why e is missing.
            errors["e"] = str(exc)
            print(f"  [{batch}/msg, {mode}] vLLM case failed: {exc}", file=sys.stderr)

    def r(num: str, den: str) -> float | None:
        n, d = cases.get(num), cases.get(den)
        return ratio(n["outputs_per_s"], d["outputs_per_s"]) if n and d else None

    def cap(num: str, den: str) -> float | None:
        # Capacity: outputs per CPU-second of the client; ratio = den CPU / num CPU.
        n, d = cases.get(num), cases.get(den)
        if not n or not d:
            return None
        return ratio(n["outputs"] / n["cpu_s"], d["outputs"] / d["cpu_s"])

    pairs = [("b", "a"), ("b+", "a"), ("c", "a"), ("b", "e"), ("e", "a")]
    pairs += [(f"d{n}", "b") for n in consumers]
    if "trio" in stream_backends:
        pairs += [(f"d{n}+", "b") for n in consumers]
    if "asyncio" in stream_backends:
        pairs += [(f"f{n}", "c") for n in consumers]
    return {
        "backlog_s": backlog,
        "outputs_per_request": tokens,
        "cases": cases,
        "ratios": {f"{x}/{y}": r(x, y) for x, y in pairs},
        "cpu_ratios": {f"{x}/{y}": cap(x, y) for x, y in pairs},
        "errors": errors,
    }


def run_one_batch(
    batch: int,
    *,
    messages: int,
    requests: int,
    consumers: list[int],
    vllm_python: str | None,
    modes: list[str],
    progress: bool,
    stream_backends: tuple[str, ...] = ("trio",),
    profile: bool = False,
    selected: frozenset[str] = _ALL_CASES,
) -> dict[str, Any]:
    """Every case at ``batch`` outputs per message, live and/or from a backlog.

    ``live``: the client reads while the engine sends (rates are bounded by the
    slower of the two). ``backlog``: the client first sleeps (blocking) until the
    engine has sent everything, then drains the queued messages: the client's own
    capacity. The wait is 1.5 x the live ceiling's duration + 0.5 s (or M / 1000 s).
    """
    result: dict[str, Any] = {"batch": batch, "requests": requests}
    kwargs = dict(
        messages=messages,
        requests=requests,
        consumers=consumers,
        vllm_python=vllm_python,
        progress=progress,
        stream_backends=stream_backends,
        profile=profile,
        selected=selected,
    )
    if "live" in modes:
        result["live"] = _run_cases(batch, backlog=0.0, **kwargs)  # type: ignore[arg-type]
    if "backlog" in modes:
        if "live" in result and "a" in result["live"]["cases"]:
            wait = 1.5 * result["live"]["cases"]["a"]["seconds"] + 0.5
        else:
            wait = messages / 1000 + 1.0
        result["backlog"] = _run_cases(batch, backlog=wait, **kwargs)  # type: ignore[arg-type]
    return result


# Issue 14's targets (backlog mode is the client's own capacity).
_TARGETS = {"b/a": 0.8, "c/a": 0.8, "b/e": 3.0, "d256/b": 0.6, "d4096/b": 0.4}


def run(args: Any) -> int:
    global _gc_threshold
    _gc_threshold = getattr(args, "gc_threshold", None)
    batches = [int(b) for b in str(args.batch).split(",") if b]
    consumers = [int(c) for c in str(args.consumers).split(",") if c]
    load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    results = [
        run_one_batch(
            b,
            messages=args.messages or max(20000, 60000 // b),
            requests=args.requests,
            consumers=consumers,
            vllm_python=args.vllm_python,
            modes=[m for m in str(args.mode).split(",") if m],
            progress=not args.json and not args.quiet,
            stream_backends=tuple(b for b in str(args.stream_backends).split(",") if b),
            profile=bool(getattr(args, "profile", False)),
            selected=frozenset(str(getattr(args, "cases", "") or ",".join(_ALL_CASES)).split(",")),
        )
        for b in batches
    ]
    report = {
        "bench": "firehose",
        "machine": machine(),
        "load_at_start": load_at_start,
        "profiled": bool(getattr(args, "profile", False)),
        "gc_threshold": _gc_threshold,
        "targets": _TARGETS,
        "runs": results,
    }
    table: list[str] = []
    for batch_result in results:
        for mode in ("live", "backlog"):
            if mode in batch_result:
                _table(table, batch_result, mode)
    table.append(
        "CPU capacity = outputs per CPU-second of the client process; on a shared machine "
        "it is the steadier figure (a client's CPU use also slows the engine)."
    )
    emit(report, as_json=args.json, table=table)
    return 0


def _table(table: list[str], batch_result: dict[str, Any], mode: str) -> None:
    res = batch_result[mode]
    how = (
        "live (read while the engine sends)"
        if mode == "live"
        else f"backlog (drain after a {res['backlog_s']:.1f} s pile-up)"
    )
    table.append(
        f"firehose {how}: {batch_result['batch']} outputs/message, "
        f"{batch_result['requests']} requests x {res['outputs_per_request']:,} outputs"
    )
    table.append(
        f"  {'case':42s} {'outputs/s':>11s} {'messages/s':>10s} {'vs a':>5s}"
        f" {'client CPU us/msg':>17s}"
    )
    a = res["cases"].get("a", {}).get("outputs_per_s")
    for key, c in res["cases"].items():
        vs_a = f"{c['outputs_per_s'] / a:5.2f}" if a else f"{'-':>5s}"
        table.append(
            f"  {_label(key):42s} {c['outputs_per_s']:11,.0f} {c['messages_per_s']:10,.0f}"
            f" {vs_a} {c['cpu_us_per_message']:17.1f}"
        )
    for title, values in (("throughput", res["ratios"]), ("CPU capacity", res["cpu_ratios"])):
        parts = []
        for key, value in values.items():
            if value is None:
                continue
            target = _TARGETS.get(key)
            mark = "" if target is None else (" ok" if value >= target else f" < {target}")
            parts.append(f"{key} {fmt(value, '.2f')}{mark}")
        table.append(f"  {title} ratios: " + ", ".join(parts))
    for key, c in res["cases"].items():
        if c.get("profile"):
            table.append(f"  profile of {_label(key)} (cProfile self time, event-loop thread):")
            table.extend(format_top(c["profile"]))
    for key, why in res.get("errors", {}).items():
        table.append(f"  case {key} failed: {why.splitlines()[0] if why else '?'}")
    table.append("")
