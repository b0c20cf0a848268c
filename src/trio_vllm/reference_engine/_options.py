"""Command line of ``python -m trio_vllm.reference_engine`` (imports neither torch nor zmq)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ._model import EOS_TOKEN_ID, VOCAB_SIZE
from ._model_dir import read_model_config

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["EngineOptions", "build_parser", "parse_options"]

PROTOCOLS = ("0.25.1", "0.32.0", "0.33.0")
ALL_TASKS = ("generate", "embed", "token_embed", "classify", "token_classify")

_EPILOG = """\
Fault flags combine; "steps" count model steps (firehose messages count as steps).

control socket (--control-address ADDR): the engine binds a REP socket there and
answers JSON commands at run time, e.g. {"cmd": "stall"} -> {"ok": true}. Commands:
ping (state), kill {"code": N} (os._exit now), dead (ENGINE_CORE_DEAD now, exit 1),
stall, unstall, garbage (one undecodable frame on every output socket), delay
{"ms": D}, fail_utility {"name": N}, unfail_utility {"name": N}, shutdown (as SIGTERM).
See docs/reference-engine.md.
"""


@dataclass
class EngineOptions:
    """Parsed options; see ``--help`` for the meaning of each."""

    handshake_address: str | None = None
    input_addresses: list[str] = field(default_factory=list)
    output_addresses: list[str] = field(default_factory=list)
    index: int = 0
    protocol: str = "0.32.0"
    model: str = "tiny"
    device: str = "auto"
    seed: int = 0
    max_num_seqs: int = 128
    max_model_len: int = 2048
    model_dir: str | None = None
    vocab_size: int = 260
    eos_token_id: int = 257
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_gpu_blocks: int | None = None
    disable_log_stats: bool = False
    enable_prefix_caching: bool = True
    max_loras: int = 0
    max_cpu_loras: int | None = None
    supported_tasks: tuple[str, ...] = ALL_TASKS
    enable_sleep_mode: bool = True
    shutdown_timeout: float = 0.0
    handshake_timeout: float = 300.0
    parent_pid: int | None = None
    data_parallel_size: int = 1
    moe: bool = False
    local: bool = False
    instance_id: str | None = None
    firehose: int = 0
    control_address: str | None = None
    die_after_steps: int | None = None
    dead_after_steps: int | None = None
    stall_after_steps: int | None = None
    startup_delay: float = 0.0
    crash_on_startup: str | None = None
    garbage_after_steps: int | None = None
    fail_utilities: set[str] = field(default_factory=set)
    output_delay_ms: float = 0.0
    step_interval_ms: float = 0.0
    step_block_ms: float = 0.0
    oov_fatal: bool = False
    verbose: bool = False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trio_vllm.reference_engine",
        description=(
            "A vLLM engine-core process (headless) that speaks vLLM's ZeroMQ + msgpack "
            "protocol, runs a tiny torch model or the deterministic echo model, and "
            "injects faults on demand."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c = p.add_argument_group("connection")
    c.add_argument(
        "--handshake-address",
        metavar="ADDR",
        help="frontend's handshake ROUTER (e.g. tcp://127.0.0.1:29550)",
    )
    c.add_argument(
        "--index",
        type=int,
        default=0,
        metavar="N",
        help="data-parallel rank: the 2-byte identity (default 0)",
    )
    c.add_argument(
        "--input-address",
        action="append",
        default=[],
        metavar="A",
        help="direct mode (no handshake): connect to this input ROUTER; repeat per frontend",
    )
    c.add_argument(
        "--output-address",
        action="append",
        default=[],
        metavar="B",
        help="direct mode: connect to this output PULL; repeat per frontend",
    )
    c.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="0.32.0",
        help="vLLM release to emulate (ready response, struct layouts, utilities); default 0.32.0",
    )
    c.add_argument(
        "--local",
        action="store_true",
        help="announce local=true, headless=false (as an engine launched by its "
        "frontend); default is a headless engine",
    )
    c.add_argument(
        "--handshake-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="exit with status 1 if the init metadata does not arrive within S "
        "seconds of HELLO (vLLM: 5 minutes)",
    )
    c.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        metavar="PID",
        help="stop (as on SIGTERM) within a second once process PID is gone, "
        "e.g. a frontend that was SIGKILLed; default: no such watch",
    )
    c.add_argument(
        "--control-address", metavar="ADDR", help="bind a REP control socket here (see below)"
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        choices=("tiny", "echo"),
        default="tiny",
        help="tiny: 2-layer transformer from --seed; echo: next token = "
        "s[len(s) mod len(prompt)] (default tiny)",
    )
    m.add_argument(
        "--model-dir",
        metavar="DIR",
        default=None,
        help="take vocab_size (and max_model_len, unless given, from "
        "max_position_embeddings) and eos_token_id from DIR/config.json, "
        "so the engine stands in for that model's tokenizer",
    )
    m.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the tiny model runs; auto = cuda when available",
    )
    m.add_argument(
        "--seed", type=int, default=0, help="weights seed and the generator of unseeded requests"
    )
    m.add_argument(
        "--supported-tasks",
        default=",".join(ALL_TASKS),
        metavar="T,T",
        help="what get_supported_tasks reports and accepts (default: all)",
    )
    s = p.add_argument_group("scheduler")
    s.add_argument("--max-num-seqs", type=int, default=128)
    s.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length (default: the --model-dir's max_position_embeddings, else 2048)",
    )
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget per step (prefills are chunked to fit)",
    )
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="KV blocks (default: max_num_seqs * max_model_len / block_size)",
    )
    s.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="send no scheduler_stats and no request events",
    )
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    s.add_argument(
        "--max-loras",
        type=int,
        default=0,
        help="> 0 enables LoRA bookkeeping (supports_lora in the ready response)",
    )
    s.add_argument("--max-cpu-loras", type=int, default=None)
    s.add_argument(
        "--enable-sleep-mode",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="allow sleep levels 1 and 2 (default on)",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=0.0,
        metavar="S",
        help="0: on SIGTERM abort everything (vLLM default); > 0: drain",
    )
    d = p.add_argument_group("data parallel")
    d.add_argument("--data-parallel-size", type=int, default=1)
    d.add_argument(
        "--moe",
        action="store_true",
        help="behave as a MoE DP rank: DP waves (wave_complete/start_wave)",
    )
    d.add_argument("--instance-id", default=None)
    b = p.add_argument_group("benchmarking")
    b.add_argument(
        "--firehose",
        type=int,
        default=0,
        metavar="BATCH",
        help="every ADD joins a firehose: messages of BATCH one-token outputs "
        "are sent as fast as the socket takes them (round robin over the "
        "live requests) until max_tokens or ABORT",
    )
    f = p.add_argument_group("fault injection")
    f.add_argument(
        "--die-after-steps",
        type=int,
        metavar="N",
        help="os._exit(1) right after step N's outputs (no ENGINE_CORE_DEAD, "
        "like SIGKILL or a segfault)",
    )
    f.add_argument(
        "--dead-after-steps",
        type=int,
        metavar="N",
        help="after step N: ENGINE_CORE_DEAD to every client, linger, exit 1 "
        "(vLLM's fatal-error path)",
    )
    f.add_argument(
        "--stall-after-steps",
        type=int,
        metavar="N",
        help="after step N: stop reading input and writing output; the process "
        "stays up (SIGTERM and the control socket still work)",
    )
    f.add_argument(
        "--startup-delay",
        type=float,
        default=0.0,
        metavar="S",
        help="sleep S seconds after the init metadata arrived (slow loading)",
    )
    f.add_argument(
        "--crash-on-startup",
        metavar="MSG",
        help="after the init metadata arrived: print MSG and 'EngineCore failed "
        "to start.' on stderr, exit 1, send nothing more",
    )
    f.add_argument(
        "--garbage-after-steps",
        type=int,
        metavar="N",
        help="after step N: one undecodable frame on every output socket, then carry on",
    )
    f.add_argument(
        "--fail-utility",
        action="append",
        default=[],
        metavar="NAME",
        help="utility NAME always fails ('Call to NAME method failed: injected "
        "failure of NAME'); repeatable",
    )
    f.add_argument(
        "--output-delay-ms",
        type=float,
        default=0.0,
        metavar="D",
        help="hold every output message D ms before sending it (order kept)",
    )
    f.add_argument(
        "--step-interval-ms",
        type=float,
        default=0.0,
        metavar="D",
        help="start a model step at most every D ms (a slow model: N tokens of "
        "a request take at least N*D ms; default 0, as fast as it can)",
    )
    f.add_argument(
        "--step-block-ms",
        type=float,
        default=0.0,
        metavar="D",
        help="every model step blocks the engine's loop D ms in Python, reading and "
        "answering nothing meanwhile (a long GPU step; libzmq still answers heartbeats); "
        "default 0",
    )
    f.add_argument(
        "--oov-fatal",
        action="store_true",
        help="an out-of-vocabulary id in a request (prompt, allowed_token_ids, "
        "logit_bias, stop ids) is fatal: ENGINE_CORE_DEAD, exit 1, as it "
        "kills a stock vLLM engine core (default: the request fails)",
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", help="log startup and connection details to stderr"
    )
    return p


def parse_options(argv: Sequence[str] | None = None) -> EngineOptions:
    """Parse and check the command line (argparse exits with status 2 on errors)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    direct = bool(ns.input_address or ns.output_address)
    if direct == bool(ns.handshake_address):
        parser.error("give either --handshake-address or --input-address/--output-address")
    if direct and len(ns.input_address) != len(ns.output_address):
        parser.error("--input-address and --output-address must be given equally often")
    tasks = tuple(t for t in ns.supported_tasks.split(",") if t)
    for task in tasks:
        if task not in ALL_TASKS:
            parser.error(f"unknown task {task!r} in --supported-tasks")
    if ns.parent_pid is not None and ns.parent_pid <= 0:
        parser.error("--parent-pid must be a process id > 0")
    if not 0 <= ns.index < 1 << 16:
        parser.error("--index must fit 2 bytes")
    vocab_size, eos_token_id, max_model_len = VOCAB_SIZE, EOS_TOKEN_ID, 2048
    if ns.model_dir is not None:
        try:
            vocab_size, positions, eos = read_model_config(ns.model_dir)
        except ValueError as exc:
            parser.error(f"--model-dir: {exc}")
        max_model_len = positions or max_model_len
        # The dir's own EOS; else ours when it fits the vocabulary (echo keeps working).
        eos_token_id = eos if eos is not None else min(EOS_TOKEN_ID, vocab_size - 1)
    if ns.max_model_len is not None:
        max_model_len = ns.max_model_len
    if max_model_len < 2:
        parser.error("--max-model-len must be >= 2")
    return EngineOptions(
        handshake_address=ns.handshake_address,
        input_addresses=ns.input_address,
        output_addresses=ns.output_address,
        index=ns.index,
        protocol=ns.protocol,
        model=ns.model,
        device=ns.device,
        seed=ns.seed,
        max_num_seqs=ns.max_num_seqs,
        max_model_len=max_model_len,
        model_dir=ns.model_dir,
        vocab_size=vocab_size,
        eos_token_id=eos_token_id,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        block_size=ns.block_size,
        num_gpu_blocks=ns.num_gpu_blocks,
        disable_log_stats=ns.disable_log_stats,
        enable_prefix_caching=ns.enable_prefix_caching,
        max_loras=ns.max_loras,
        max_cpu_loras=ns.max_cpu_loras,
        supported_tasks=tasks,
        enable_sleep_mode=ns.enable_sleep_mode,
        shutdown_timeout=ns.shutdown_timeout,
        handshake_timeout=ns.handshake_timeout,
        parent_pid=ns.parent_pid,
        data_parallel_size=ns.data_parallel_size,
        moe=ns.moe,
        local=ns.local,
        instance_id=ns.instance_id,
        firehose=ns.firehose,
        control_address=ns.control_address,
        die_after_steps=ns.die_after_steps,
        dead_after_steps=ns.dead_after_steps,
        stall_after_steps=ns.stall_after_steps,
        startup_delay=ns.startup_delay,
        crash_on_startup=ns.crash_on_startup,
        garbage_after_steps=ns.garbage_after_steps,
        fail_utilities=set(ns.fail_utility),
        output_delay_ms=ns.output_delay_ms,
        step_interval_ms=ns.step_interval_ms,
        step_block_ms=ns.step_block_ms,
        oov_fatal=ns.oov_fatal,
        verbose=ns.verbose,
    )
