"""``vllm bench serve`` against ``trio-vllm serve``, vLLM's API server and its Rust frontend.

Every server under test runs without a local engine and one headless engine, started
by this script in its own session and pinned to the other cores from its start,
connects to it; only the engine differs between the two settings:

* ``--setting frontend-bound`` (default, issue 13): the engine is nearly free, so the
  frontend is what is measured: our reference engine (echo model, ``--max-num-seqs
  256``, the tiny-llama vocabulary via ``--model-dir``).
* ``--setting stock-engine``: a stock vLLM engine core on the tiny model (dummy
  weights), started with vLLM's own ``vllm serve DIR --headless
  --data-parallel-address 127.0.0.1 --data-parallel-rpc-port P ...``.

The frontends:

* ``trio``: ``trio-vllm serve --connect tcp://127.0.0.1:P --engines 1 --model DIR``
* ``vllm``: ``vllm serve DIR --data-parallel-size 1 --data-parallel-size-local 0
  --data-parallel-address 127.0.0.1 --data-parallel-rpc-port P`` (vLLM's Python API
  server)
* ``vllm-rs``: the same with ``VLLM_USE_RUST_FRONTEND=1 VLLM_RUST_FRONTEND_PATH=...``
  (vLLM's Rust frontend; ``../shared/interop/fetch_vllm_rs.sh`` fetches it)

Why the stock engine is not left to each frontend to spawn (as an earlier version of
this setting did): ``vllm serve`` starts its engine core as its own child, so in the
API server's session, where ``trio-vllm serve --engine vllm`` starts ``vllm serve
--headless`` in a new session. With the kernel's session autogroups
(``kernel.sched_autogroup_enabled=1`` here) and vLLM's worker spin-waiting for its
next step (``sched_yield`` in its shared-memory queue) on the core it shares with the
benchmark client, an engine in the frontend's session starved the client: it waited
on the run queue for 2.1 s of a 3.5 s run (0.4 of 1.8 s with the engine in its own
session) and read each response at once after 200-1000 ms (TTFT = the whole request,
ITL p50 0.00 ms) behind both of vLLM's frontends. Measured with vLLM's frontend and a
headless engine: sharing the frontend's session reproduces it, an own session does
not, whichever core the engine starts on; the engine's config, environment and
threads' affinity were the same under both launchers.

The client is vLLM's own ``vllm bench serve`` (random dataset, 32 tokens in, 64 out,
``--ignore-eos``), backends ``openai`` and ``openai-chat``, at each concurrency. The
frontend is pinned to core 0 (``taskset``), engine and client to the others. Reported
per run: request throughput, output tokens/s, TTFT and ITL p50/p99, the frontend's
CPU seconds per request (its process tree; the engine is not in it) and SSE chunks
with content per request (``len(itls) + 1`` from the detailed results), plus ratios
trio/vllm and trio/vllm-rs.

    python bench/bench_serve.py --vllm-python PY [--concurrency 1,16,64,256]
        [--servers trio,trio-uvicorn,trio-merge,vllm,vllm-rs]
        [--setting frontend-bound|stock-engine] [--baseline REV] [--json OUT]

``trio-n2`` and ``vllm-n2`` (opt-in in ``--servers``) are the same with
``--api-server-count 2``: two API-server processes on the frontend's core(s)
(``--frontend-cores``, default 0), for N = 1 against N = 2 of each in one run.

``trio-hypercorn`` (opt-in in ``--servers``) is ``trio-vllm serve --http-server
hypercorn``: hypercorn's trio worker instead of the default h11 server.
``trio-uvicorn`` (opt-in) is ``trio-vllm serve --backend asyncio``: the same server on
asyncio (uvloop), served by uvicorn with httptools, the HTTP layer ``vllm serve`` runs
on; so one run measures every HTTP layer side by side (``trio-uvicorn-n2``: with two
API servers).

``trio-merge`` (opt-in in ``--servers``) is ``trio-vllm serve --merge-outputs``: what a
busy connection piled up goes out as one SSE event, as vLLM's API server sends it.
``--baseline REV`` adds ``trio-base``: ``trio-vllm serve`` from that revision's
``src/`` (``git archive``), on the same engine build, for an A/B in one run.

Absolute figures on a shared 2-core machine are noise; the ratios of one run are the
result.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "interop"
MODEL = SHARED / "tiny-llama"
VLLM_CLI = SHARED / "vllm_cli.py"
RS_DEFAULT = Path.home() / ".cache" / "vllm-rs-0.32.0" / "vllm-rs"
SERVED = "tiny"
FRONTEND_CORE = "0"
# --setting stock-engine: a stock vLLM engine core on the tiny model (dummy weights).
STOCK_ENGINE_ARGS = [
    "--load-format", "dummy", "--dtype", "float32", "--max-model-len", "512",
    "--enforce-eager", "--max-num-seqs", "256", "--disable-log-stats",
]  # fmt: skip
STOCK_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
# vLLM's frontends in front of the reference engine (its limits).
REFERENCE_FRONTEND_ARGS = ["--max-model-len", "512", "--max-num-seqs", "256", "--disable-log-stats"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _other_cores() -> str:
    cores = sorted(os.sched_getaffinity(0))
    frontend = {c for part in FRONTEND_CORE.split(",") for c in _core_range(part)}
    rest = [c for c in cores if c not in frontend] or cores
    return ",".join(str(c) for c in rest)


def _core_range(part: str) -> range:
    first, _, last = part.partition("-")
    return range(int(first), int(last or first) + 1)


def _tree_cpu(pid: int, exclude: set[int]) -> float:
    """CPU seconds (user + system) of ``pid`` and its live descendants, minus ``exclude``."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    stack = [pid]
    while stack:
        p = stack.pop()
        if p in exclude:
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def _hold_lock(path: Path) -> Any:
    """An open file holding ``path``'s exclusive fcntl lock (closing it releases it).
    Taken in this process, not with flock(1) around the server: a server stopped with
    SIGTERM must not be the lock's holder."""
    import fcntl

    f = open(path, "a")  # noqa: SIM115
    sys.stderr.write(f"waiting for {path}\n")
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def _wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout: float = 900) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during startup")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server on {port} not healthy after {timeout} s")


def _frontend_command(
    name: str, vllm_python: str, port: int, rpc_port: int, stock_engine: bool
) -> list[str]:
    """The frontend under test, pinned to ``FRONTEND_CORE``, without a local engine: it
    binds the handshake on ``rpc_port`` and waits for one headless engine."""
    pin = ["taskset", "-c", FRONTEND_CORE]
    # ``-n2``: two API-server processes (--api-server-count 2), on the same core(s).
    servers = ["--api-server-count", "2"] if name.endswith("-n2") else []
    if name.startswith("trio"):
        return [
            *pin, sys.executable, "-m", "trio_vllm.cli", "serve", "--model", str(MODEL),
            "--served-model-name", SERVED, "--port", str(port),
            "--connect", f"tcp://127.0.0.1:{rpc_port}", "--engines", "1",
            "--ready-timeout", "900", *(["--merge-outputs"] if name == "trio-merge" else []),
            *(["--http-server", "hypercorn"] if name == "trio-hypercorn" else []),
            *(["--backend", "asyncio"] if name.startswith("trio-uvicorn") else []),
            *servers,
        ]  # fmt: skip
    # vLLM's frontends build their config from the engine arguments: the same as the
    # engine's in the stock-engine setting.
    engine_args = STOCK_ENGINE_ARGS if stock_engine else REFERENCE_FRONTEND_ARGS
    return [
        *pin, vllm_python, str(VLLM_CLI), "serve", str(MODEL), "--served-model-name",
        SERVED, "--host", "127.0.0.1", "--port", str(port),
        "--data-parallel-size", "1", "--data-parallel-size-local", "0",
        "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port),
        *engine_args, *servers,
    ]  # fmt: skip


def _engine_command(vllm_python: str, rpc_port: int, stock_engine: bool) -> list[str]:
    """The headless engine, pinned to the other cores from its start (vLLM's CPU worker
    binds its OpenMP threads to the cores it starts on)."""
    pin = ["taskset", "-c", _other_cores()]
    if stock_engine:  # vLLM's own launcher: ``vllm serve --headless``
        return [
            *pin, vllm_python, str(VLLM_CLI), "serve", str(MODEL), "--headless",
            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port",
            str(rpc_port), *STOCK_ENGINE_ARGS,
        ]  # fmt: skip
    return [
        *pin, sys.executable, "-m", "trio_vllm.reference_engine",
        "--handshake-address", f"tcp://127.0.0.1:{rpc_port}", "--model", "echo",
        "--model-dir", str(MODEL), "--max-num-seqs", "256", "--max-model-len", "512",
        "--max-num-batched-tokens", "8192", "--disable-log-stats",
    ]  # fmt: skip


class _Setting:
    """One frontend with its headless engine: our reference engine (frontend-bound) or a
    stock vLLM engine core (stock-engine), started the same way for every frontend."""

    def __init__(
        self, name: str, vllm_python: str, rs_path: Path, logdir: Path,
        trio_src: Path | None = None, stock_engine: bool = False,
    ) -> None:  # fmt: skip
        self.name = name
        self.port = _free_port()
        self.rpc_port = _free_port()
        self.log = open(logdir / f"{name}.log", "wb")  # noqa: SIM115
        self.engine: subprocess.Popen[bytes] | None = None
        env = {**os.environ}
        if trio_src is not None:  # the A/B baseline: another source tree
            env["PYTHONPATH"] = str(trio_src)
        command = _frontend_command(name, vllm_python, self.port, self.rpc_port, stock_engine)
        self._spawn_frontend(name, command, env, rs_path)
        # vLLM's frontend binds the handshake socket a while after start; both engines
        # retry their connection (ZeroMQ), so they can start at once. The engine gets its
        # own session: sharing the frontend's (its autogroup) starved the client on the
        # engine's core (see the module docstring).
        self.engine = subprocess.Popen(
            _engine_command(vllm_python, self.rpc_port, stock_engine),
            env={**os.environ, **STOCK_ENV} if stock_engine else None,
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self._wait_up()

    def _spawn_frontend(
        self, name: str, command: list[str], env: dict[str, str], rs_path: Path
    ) -> None:
        if name == "vllm-rs":  # vLLM's launcher runs the Rust frontend instead of its own
            env["VLLM_USE_RUST_FRONTEND"] = "1"
            env["VLLM_RUST_FRONTEND_PATH"] = str(rs_path)
        self.frontend = subprocess.Popen(
            command, env=env, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def _wait_up(self) -> None:
        try:
            _wait_healthy(self.port, self.frontend)
        except BaseException:
            self.close()
            raise

    def cpu(self) -> float:
        """The frontend's process tree (the engine is not in it: it is our child)."""
        assert self.engine is not None
        return _tree_cpu(self.frontend.pid, {self.engine.pid})

    def close(self) -> None:
        # The frontend first (an engine stopped first is an engine death to it).
        for proc in (self.frontend, self.engine):
            if proc is None:
                continue
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.log.close()


def _bench(
    vllm_python: str, setting: _Setting, backend: str, concurrency: int, prompts: int,
    outdir: Path,
) -> dict[str, Any]:  # fmt: skip
    name = f"{setting.name}-{backend}-{concurrency}.json"
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    command = [
        "taskset", "-c", _other_cores(), vllm_python, str(VLLM_CLI), "bench", "serve",
        "--backend", backend, "--base-url", f"http://127.0.0.1:{setting.port}",
        "--endpoint", endpoint, "--model", SERVED, "--tokenizer", str(MODEL),
        "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "64",
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
        "--ignore-eos", "--seed", "0", "--save-result", "--save-detailed",
        "--result-dir", str(outdir), "--result-filename", name, "--disable-tqdm",
    ]  # fmt: skip
    before = setting.cpu()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    cpu = setting.cpu() - before
    data = json.loads((outdir / name).read_text())
    itls = data.get("itls") or []
    completed = data["completed"]
    chunks = [len(x) + 1 for x in itls if x is not None]
    waves = _ttft_waves(data, concurrency)
    return {
        "completed": completed,
        "failed": data.get("failed", 0),
        "req_s": data["request_throughput"],
        "out_tok_s": data["output_throughput"],
        "ttft_p50_ms": data["median_ttft_ms"],
        "ttft_p99_ms": data["p99_ttft_ms"],
        "itl_p50_ms": data["median_itl_ms"],
        "itl_p99_ms": data["p99_itl_ms"],
        # includes the bench client's warm-up request (one per run)
        "cpu_s_per_req": cpu / max(completed, 1),
        "chunks_per_req": sum(chunks) / len(chunks) if chunks else None,
        "ttft_p99_over_p50": data["p99_ttft_ms"] / max(data["median_ttft_ms"], 1e-9),
        **waves,
    }


def _ttft_waves(data: dict[str, Any], concurrency: int) -> dict[str, Any]:
    """TTFT of the first wave (the first ``concurrency`` requests sent, which all arrive
    at once) apart from the rest (each sent as one finishes): where the p99 comes from."""
    starts = data.get("start_times") or []
    ttfts = data.get("ttfts") or []
    pairs = sorted((s, t) for s, t in zip(starts, ttfts, strict=False) if t)
    if len(pairs) <= concurrency or concurrency < 2:
        return {}

    def pct(values: list[float], q: float) -> float:
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))] * 1000

    first = [t for _, t in pairs[:concurrency]]
    rest = [t for _, t in pairs[concurrency:]]
    return {
        "ttft_first_wave_p50_ms": pct(first, 0.5),
        "ttft_first_wave_p99_ms": pct(first, 0.99),
        "ttft_rest_p50_ms": pct(rest, 0.5),
        "ttft_rest_p99_ms": pct(rest, 0.99),
    }


def main() -> int:
    global FRONTEND_CORE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, help="python with vLLM 0.32.0")
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--backends", default="openai,openai-chat")
    parser.add_argument("--servers", default="trio,vllm,vllm-rs")
    parser.add_argument(
        "--prompts-per-concurrency",
        type=int,
        default=4,
        help="num-prompts = max(200, this x concurrency)",
    )
    parser.add_argument("--min-prompts", type=int, default=200,
                        help="at least this many prompts per case (default 200)")  # fmt: skip
    parser.add_argument("--rs-path", type=Path, default=RS_DEFAULT)
    parser.add_argument("--frontend-cores", default=FRONTEND_CORE,
                        help="taskset list for the frontend(s) (default 0); the engine "
                             "and the client get the others")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--vllm-lock", type=Path,
                        help="hold this file's fcntl lock while a stock vLLM process "
                             "(vLLM's frontends; every stock engine) runs: one at a time "
                             "on a shared machine")  # fmt: skip
    parser.add_argument("--setting", choices=("frontend-bound", "stock-engine"),
                        default="frontend-bound",
                        help="the headless engine of every frontend: our reference "
                             "engine (frontend-bound) or a stock vLLM engine core on the "
                             "tiny model (stock-engine)")  # fmt: skip
    parser.add_argument("--baseline", metavar="REV",
                        help="also run trio-vllm serve from this git revision's src/ as "
                             "server trio-base (an A/B in one run)")  # fmt: skip
    args = parser.parse_args()
    FRONTEND_CORE = args.frontend_cores
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    backends = args.backends.split(",")
    servers = args.servers.split(",")
    if "vllm-rs" in servers and not args.rs_path.exists():
        sys.stderr.write(f"no Rust frontend at {args.rs_path}; skipping vllm-rs\n")
        servers.remove("vllm-rs")
    results: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_avg_start": os.getloadavg(),
        "setting": (
            "frontend-bound: reference engine (echo, max-num-seqs 256) as the headless "
            "engine of each frontend"
            if args.setting == "frontend-bound"
            else "stock-engine: a stock vLLM engine core (vllm serve --headless, tiny "
            "model, dummy weights, max-num-seqs 256) as the headless engine of each "
            "frontend"
        ) + "; random 32 in / 64 out, ignore-eos",
        "runs": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        outdir = Path(tmp)
        base_src: Path | None = None
        if args.baseline:
            base = outdir / "baseline"
            base.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(REPO), "archive", args.baseline, "src"],
                check=True, capture_output=True,
            ).stdout  # fmt: skip
            subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
            base_src = base / "src"
            servers.insert(servers.index("trio") + 1 if "trio" in servers else 0, "trio-base")
            results["baseline"] = args.baseline
        results["commit"] = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=False,
        ).stdout.strip()  # fmt: skip
        for server in list(servers):
            stock = server.startswith("vllm") or args.setting == "stock-engine"
            lock = _hold_lock(args.vllm_lock) if stock and args.vllm_lock else None
            try:
                setting = _Setting(
                    server, args.vllm_python, args.rs_path, outdir,
                    base_src if server == "trio-base" else None,
                    stock_engine=args.setting == "stock-engine",
                )  # fmt: skip
            except RuntimeError as exc:  # a frontend that does not start: report, go on
                sys.stderr.write(f"{server} did not start: {exc}\n")
                sys.stderr.write((outdir / f"{server}.log").read_text()[-3000:])
                results["runs"][f"{server}/failed"] = str(exc)
                servers.remove(server)
                if lock is not None:
                    lock.close()
                continue
            try:
                for backend in backends:
                    for c in concurrencies:
                        prompts = max(args.min_prompts, args.prompts_per_concurrency * c)
                        r = _bench(args.vllm_python, setting, backend, c, prompts, outdir)
                        results["runs"][f"{server}/{backend}/{c}"] = r
                        print(server, backend, c, json.dumps(r), flush=True)
            finally:
                setting.close()
                if lock is not None:
                    lock.close()  # releases the lock (the servers are reaped)
                sys.stderr.write((outdir / f"{server}.log").read_text()[-3000:])
    results["load_avg_end"] = os.getloadavg()
    print(_table(results, servers, backends, concurrencies))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


def _table(results: dict[str, Any], servers: list[str], backends: list[str],
           concurrencies: list[int]) -> str:  # fmt: skip
    runs = results["runs"]
    lines = [
        "| backend | conc | server | req/s | out tok/s | TTFT p50/p99 ms | ITL p50/p99 ms "
        "| CPU ms/req | chunks/req | req/s vs vllm | CPU vs vllm | req/s vs vllm-rs "
        "| req/s vs trio-base | CPU vs trio-base | req/s vs vllm-n2 | CPU vs vllm-n2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for backend in backends:
        for c in concurrencies:
            base = runs.get(f"vllm/{backend}/{c}")
            rs = runs.get(f"vllm-rs/{backend}/{c}")
            tb = runs.get(f"trio-base/{backend}/{c}")
            n2 = runs.get(f"vllm-n2/{backend}/{c}")
            for server in servers:
                r = runs.get(f"{server}/{backend}/{c}")
                if r is None:
                    continue
                vs = f"{r['req_s'] / base['req_s']:.2f}" if base else "-"
                cpu = f"{r['cpu_s_per_req'] / base['cpu_s_per_req']:.2f}" if base else "-"
                vrs = f"{r['req_s'] / rs['req_s']:.2f}" if rs else "-"
                vtb = f"{r['req_s'] / tb['req_s']:.2f}" if tb else "-"
                ctb = f"{r['cpu_s_per_req'] / tb['cpu_s_per_req']:.2f}" if tb else "-"
                chunks = f"{r['chunks_per_req']:.1f}" if r["chunks_per_req"] else "-"
                vn2 = f"{r['req_s'] / n2['req_s']:.2f}" if n2 else "-"
                cn2 = f"{r['cpu_s_per_req'] / n2['cpu_s_per_req']:.2f}" if n2 else "-"
                lines.append(
                    f"| {backend} | {c} | {server} | {r['req_s']:.1f} | {r['out_tok_s']:.0f} "
                    f"| {r['ttft_p50_ms']:.1f}/{r['ttft_p99_ms']:.1f} "
                    f"| {r['itl_p50_ms']:.2f}/{r['itl_p99_ms']:.2f} "
                    f"| {r['cpu_s_per_req'] * 1000:.2f} | {chunks} | {vs} | {cpu} | {vrs} "
                    f"| {vtb} | {ctb} | {vn2} | {cn2} |"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
