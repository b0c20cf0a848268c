"""Startup: the handshake with the front end (docs/protocol.md §2), the model and the
scheduler, and the sockets of a running engine.

`Sockets` holds every socket the engine opens, so whoever owns it can close them all
whatever state startup failed in. `start` runs the whole sequence: HELLO, init
metadata, model load, input/coordinator/output connections, READY.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from ._errors import EngineExit, WireError, log
from ._model import load_model
from ._scheduler import Scheduler, SchedulerConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._model import Model
    from ._options import EngineOptions
    from ._process import ProcessWatch
    from ._wire import Wire

__all__ = ["OUTPUT_LINGER_MS", "Engine", "Sockets", "start"]

OUTPUT_LINGER_MS = 4000  # vLLM's linger for engine output PUSH sockets
_HANDSHAKE_LINGER_MS = 5000
_CLEAN_EXIT_LINGER_MS = 300  # a clean stop must finish within a second
_FIREHOSE_HWM = 1000  # libzmq's default HWM: bounded, but rarely full


@dataclass(eq=False)
class Sockets:
    """Every socket of one engine process, in one place for `close`."""

    ctx: zmq.Context[zmq.Socket[bytes]]
    identity: bytes
    control: zmq.Socket[bytes] | None = None
    handshake: zmq.Socket[bytes] | None = None
    inputs: list[zmq.Socket[bytes]] = field(default_factory=list)
    outputs: list[zmq.Socket[bytes]] = field(default_factory=list)
    coord_in: zmq.Socket[bytes] | None = None
    coord_out: zmq.Socket[bytes] | None = None

    def close(self) -> None:
        """Close every socket (outputs with a short linger) and end the context."""
        for sock in [*self.inputs, self.coord_in, self.control, self.handshake]:
            if sock is not None and not sock.closed:
                sock.close(linger=0)
        for sock in [*self.outputs, self.coord_out]:
            if sock is not None and not sock.closed:
                sock.close(linger=_CLEAN_EXIT_LINGER_MS)
        self.ctx.term()


@dataclass(eq=False)
class Engine:
    """What startup made: the model, its scheduler and the KV cache size."""

    model: Model
    scheduler: Scheduler
    num_gpu_blocks: int


def load_engine(opts: EngineOptions, *, include_finished_set: bool) -> Engine:
    """Load the model and build its scheduler; `EngineExit` (1) when torch is missing."""
    try:
        model = load_model(
            opts.model,
            seed=opts.seed,
            device=opts.device,
            max_model_len=opts.max_model_len,
            vocab_size=opts.vocab_size,
        )
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        # A setup problem, not a crash: one line that says what to install.
        log(
            f"the {opts.model} model needs torch, which is not installed: "
            "pip install torch --index-url https://download.pytorch.org/whl/cpu "
            "(PyTorch's CPU build; PyPI's torch is the CUDA build) or use --model echo"
        )
        log("EngineCore failed to start.")
        raise EngineExit(1) from None
    per_seq = -(-opts.max_model_len // opts.block_size)
    blocks = opts.num_gpu_blocks or opts.max_num_seqs * per_seq
    scheduler = Scheduler(
        model,
        SchedulerConfig(
            max_num_seqs=opts.max_num_seqs,
            max_num_batched_tokens=opts.max_num_batched_tokens,
            max_model_len=opts.max_model_len,
            block_size=opts.block_size,
            num_gpu_blocks=blocks,
            log_stats=not opts.disable_log_stats,
            include_finished_set=include_finished_set,
            enable_prefix_caching=opts.enable_prefix_caching,
        ),
        seed=opts.seed,
    )
    return Engine(model, scheduler, blocks)


def wait_readable(
    sock: zmq.Socket[bytes],
    deadline: float | None,
    process: ProcessWatch,
    control: zmq.Socket[bytes] | None,
    serve_control: Callable[[], None],
) -> bool:
    """Block until ``sock`` is readable; False on deadline. Serves control and signals;
    `EngineExit` (0) once a stop is requested."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    if control is not None:
        poller.register(control, zmq.POLLIN)
    process.register(poller)
    while True:
        if process.stop_requested:
            raise EngineExit(0)
        timeout = None
        if deadline is not None:
            timeout = int(max(0.0, deadline - time.monotonic()) * 1000) + 1
        events = dict(poller.poll(process.poll_timeout(timeout)))
        process.after_poll(poller, events)
        if control is not None and control in events:
            serve_control()
        if sock in events:
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False


def start(
    opts: EngineOptions,
    wire: Wire,
    sockets: Sockets,
    process: ProcessWatch,
    serve_control: Callable[[], None],
    on_loaded: Callable[[Engine], None],
) -> bool:
    """Run startup to READY; False when it failed (logged: the process exits 1).

    ``on_loaded`` receives the model and scheduler as soon as they exist, before any
    socket reaches the front end, so a fatal error from then on can be reported.
    """
    local, headless = opts.local, not opts.local

    def wait(sock: zmq.Socket[bytes], deadline: float | None) -> bool:
        return wait_readable(sock, deadline, process, sockets.control, serve_control)

    if opts.handshake_address is None:
        engine = load_engine(opts, include_finished_set=False)
        on_loaded(engine)
        _connect(
            opts,
            wire,
            sockets,
            engine,
            wait,
            opts.input_addresses,
            opts.output_addresses,
            None,
            None,
        )
        return True
    hs = sockets.handshake = sockets.ctx.socket(zmq.DEALER)
    hs.setsockopt(zmq.IDENTITY, sockets.identity)
    hs.setsockopt(zmq.LINGER, _HANDSHAKE_LINGER_MS)
    hs.connect(opts.handshake_address)
    hs.send(wire.encode_hello(local=local, headless=headless))
    if not wait(hs, time.monotonic() + opts.handshake_timeout):
        log(
            "Did not receive response from front-end process within "
            f"{opts.handshake_timeout:g} seconds"
        )
        log("EngineCore failed to start.")
        return False
    try:
        metadata = wire.decode_init_metadata(hs.recv())
    except WireError as exc:
        log(f"bad init metadata: {exc}")
        log("EngineCore failed to start.")
        return False
    addresses = metadata.addresses
    coordinator = (addresses.coordinator_input, addresses.coordinator_output)
    if opts.startup_delay > 0:
        process.sleep(opts.startup_delay)
    if opts.crash_on_startup is not None:
        log(opts.crash_on_startup)
        log("EngineCore failed to start.")
        return False
    engine = load_engine(opts, include_finished_set=coordinator[1] is not None)
    on_loaded(engine)
    _connect(
        opts,
        wire,
        sockets,
        engine,
        wait,
        list(addresses.inputs),
        list(addresses.outputs),
        *coordinator,
    )
    hs.send(
        wire.encode_ready(
            local=local,
            headless=headless,
            parallel_config_hash=(
                f"reference-{opts.data_parallel_size}" if opts.data_parallel_size > 1 else None
            ),
        )
    )
    hs.close(linger=_HANDSHAKE_LINGER_MS)
    sockets.handshake = None
    if opts.verbose:
        log(
            f"rank {opts.index} ready ({opts.model} on {engine.model.device}, vLLM "
            f"{opts.protocol} protocol): inputs {list(addresses.inputs)}, outputs "
            f"{list(addresses.outputs)}, coordinator {coordinator}"
        )
    return True


def _connect(
    opts: EngineOptions,
    wire: Wire,
    sockets: Sockets,
    engine: Engine,
    wait: Callable[[zmq.Socket[bytes], float | None], bool],
    inputs: list[str],
    outputs: list[str],
    coordinator_input: str | None,
    coordinator_output: str | None,
) -> None:
    ctx = sockets.ctx
    for address in inputs:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, sockets.identity)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sockets.inputs.append(sock)
    if coordinator_input is not None:
        coord_in = sockets.coord_in = ctx.socket(zmq.XSUB)
        coord_in.setsockopt(zmq.LINGER, 0)
        coord_in.connect(coordinator_input)
        coord_in.send(b"\x01")
    fields = ready_response_fields(opts, engine, (coordinator_input, coordinator_output))
    ready = wire.encode_ready_response(fields)
    for sock in sockets.inputs:
        sock.send(ready)
    if sockets.coord_in is not None:
        while True:
            if not wait(sockets.coord_in, time.monotonic() + 10):
                log("Waiting for READY message from DP Coordinator...")
                continue
            if sockets.coord_in.recv_multipart() == [b"READY"]:
                break
    for address in outputs:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, _FIREHOSE_HWM if opts.firehose else 0)
        sock.setsockopt(zmq.LINGER, OUTPUT_LINGER_MS)
        sock.connect(address)
        sockets.outputs.append(sock)
    if coordinator_output is not None:
        coord_out = sockets.coord_out = ctx.socket(zmq.PUSH)
        coord_out.setsockopt(zmq.SNDHWM, 0)
        coord_out.setsockopt(zmq.LINGER, OUTPUT_LINGER_MS)
        coord_out.connect(coordinator_output)


def ready_response_fields(
    opts: EngineOptions, engine: Engine, coordinator: tuple[str | None, str | None]
) -> dict[str, Any]:
    """The fields of the engine's ready response (docs/protocol.md §2)."""
    kv_tokens = engine.num_gpu_blocks * opts.block_size
    return {
        "max_model_len": opts.max_model_len,
        "num_gpu_blocks": engine.num_gpu_blocks,
        "block_size": opts.block_size,
        "dp_stats_address": None,
        "dtype": engine.model.dtype,
        "vllm_version": opts.protocol,
        "world_size": 1,
        "data_parallel_size": opts.data_parallel_size,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "decode_context_parallel_size": 1,
        "data_parallel_rank": opts.index,
        "max_num_seqs": opts.max_num_seqs,
        "max_num_batched_tokens": opts.max_num_batched_tokens,
        "instance_id": opts.instance_id or str(uuid.uuid4().int >> 64),
        "supports_lora": opts.max_loras > 0,
        "max_loras": opts.max_loras,
        "mamba_block_size": None,
        "kv_cache_size_tokens": kv_tokens,
        "kv_cache_max_concurrency": kv_tokens / opts.max_model_len,
        "kv_events_config": None,
        "weight_transfer_backend": None,
        "enable_sleep_mode": opts.enable_sleep_mode,
        "supports_draft_weight_updates": False,
        "effective_attention_block_size": opts.block_size,
        "coord_store_port": 0,
        "coordinator_input_address": coordinator[0],
        "coordinator_output_address": coordinator[1],
    }
