"""The engine process: startup handshake, the busy loop, death and shutdown.

One thread, plain pyzmq: a ``zmq.Poller`` over the input DEALER(s), the coordinator XSUB,
the optional control REP socket and a signal wake-up fd. The loop reads every queued
input message (without blocking), then runs one scheduler step when there is work, sends
that step's outputs, and blocks in ``poll`` only when there is nothing to do (or until
the next delayed output is due). Everything on the wire goes through ``_wire.py`` (the
protocol layer).

Failure behaviour is vLLM's (docs/protocol.md §3.7, §5.6, §8): an undecodable input message
"kills the input thread" (input is never read again, nothing is sent), a bad
``client_index`` "kills the output thread" (nothing is ever sent again), a fatal error
sends ``ENGINE_CORE_DEAD`` to every client and exits with status 1, SIGTERM/SIGINT finish
everything as ABORT and exit 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
import traceback
import uuid
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from ._model import Sequence, load_model
from ._sampler import SamplingState
from ._scheduler import (
    ClientBatch,
    EngineRequest,
    FinishReason,
    OutputRecord,
    PoolingSpec,
    Scheduler,
    SchedulerConfig,
    StepResult,
)
from ._utilities import Deferred, Utilities, UtilityError
from ._wire import Wire, WireError

if TYPE_CHECKING:
    from ._model import Model
    from ._options import EngineOptions

__all__ = ["EngineServer", "FatalEngineError", "run_engine"]

GARBAGE_FRAME = b"\xc1not-msgpack: injected garbage frame"
_OUTPUT_LINGER_MS = 4000  # vLLM's linger for engine output PUSH sockets
_HANDSHAKE_LINGER_MS = 5000
_CLEAN_EXIT_LINGER_MS = 300  # a clean stop must finish within a second
_DP_SYNC_INTERVAL = 16
_FIREHOSE_HWM = 1000  # libzmq's default HWM: bounded, but rarely full
_FIREHOSE_BURST = 16


class FatalEngineError(Exception):
    """An error vLLM raises in its busy loop: ENGINE_CORE_DEAD, then exit 1."""


class _Stop(Exception):
    """Leave the busy loop with this exit status."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _log(msg: str) -> None:
    print(f"[reference-engine pid {os.getpid()}] {msg}", file=sys.stderr, flush=True)


class EngineServer:
    """One engine core process. ``run()`` returns the process exit status."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.profile_name = options.protocol
        self.rank = options.index
        self.identity = self.rank.to_bytes(2, "little")
        self.wire = Wire(options.protocol)
        self.ctx = zmq.Context(io_threads=1)
        self.model: Model = None  # type: ignore[assignment]  # set in _load_model
        self.scheduler: Scheduler = None  # type: ignore[assignment]
        self.loaded = False
        self.utilities = Utilities(self)
        self.handshake: zmq.Socket[bytes] | None = None
        self.inputs: list[zmq.Socket[bytes]] = []
        self.outputs: list[zmq.Socket[bytes]] = []
        self.coord_in: zmq.Socket[bytes] | None = None
        self.coord_out: zmq.Socket[bytes] | None = None
        self.control: zmq.Socket[bytes] | None = None
        self.coordinator_addresses: tuple[str | None, str | None] = (None, None)
        self.shutdown_requested = False
        self.shutdown_handled = False
        self.signal_count = 0
        self.stalled = False
        self.input_dead = False
        self.output_dead = False
        self.steps = 0
        self.garbage_sent = False
        self.output_delay_ms = options.output_delay_ms
        self.delayed: deque[tuple[float, zmq.Socket[bytes], list[Any]]] = deque()
        self.pending_utilities: list[tuple[int, int, str, Deferred]] = []
        self.last_utility_argc = 0
        self.firehose: dict[str, EngineRequest] = {}
        self.firehose_cursor = 0
        self.blocked: deque[tuple[zmq.Socket[bytes], list[Any]]] = deque()
        self.engines_running = False
        self.starved = False
        self.next_step_at = 0.0  # --step-interval-ms: no step starts before this
        self.start_wave_sent: int | None = None
        self.wave_steps = 0
        self.last_counts: tuple[int, int] | None = None
        self._parent_fd: int | None = None  # pidfd of --parent-pid, while it lives
        self._parent_check_s: float | None = None  # poll cap without pidfd (old kernels)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    # ---- process plumbing ----------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signal_count += 1
        self.shutdown_requested = True
        if self.signal_count > 1:
            os._exit(0)  # second signal: stop now, as vLLM's launcher would kill
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _watch_parent(self) -> None:
        """Start watching --parent-pid: a pidfd the pollers wait on (no polling), or on
        kernels without pidfd_open a check whenever an idle poll times out (0.5 s)."""
        pid = self.options.parent_pid
        if pid is None:
            return
        try:
            self._parent_fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._parent_gone()
        except (AttributeError, OSError):
            self._parent_check_s = 0.5
            self._check_parent()

    def _check_parent(self) -> None:
        pid = self.options.parent_pid
        if pid is None or self.shutdown_requested:
            return
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            self._parent_gone()
        except PermissionError:
            pass  # exists, owned by someone else
        else:
            if os.getppid() != pid and pid == self._initial_ppid:
                self._parent_gone()  # it died and its pid was reused; we were reparented

    def _parent_gone(self) -> None:
        _log(f"parent process {self.options.parent_pid} is gone: shutting down")
        self.shutdown_requested = True
        self._parent_check_s = None
        if self._parent_fd is not None:
            os.close(self._parent_fd)
            self._parent_fd = None

    def _register_parent(self, poller: zmq.Poller) -> None:
        if self._parent_fd is not None:
            poller.register(self._parent_fd, zmq.POLLIN)

    def _parent_event(self, poller: zmq.Poller, events: dict[Any, int]) -> None:
        """After a poll: the pidfd became readable (parent exited), or the fallback check."""
        fd = self._parent_fd
        if fd is not None and fd in events:
            poller.unregister(fd)  # readable for good: never wait on it again
            self._parent_gone()
        elif self._parent_check_s is not None and not events:
            self._check_parent()

    def _poll_timeout(self, timeout: int | None) -> int | None:
        """Cap an idle poll's timeout when the parent can only be checked periodically."""
        if self._parent_check_s is None:
            return timeout
        cap = int(self._parent_check_s * 1000)
        return cap if timeout is None else min(timeout, cap)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        # The kernel may deliver a process-directed signal to any thread that does not
        # block it (numpy/torch helper threads; libzmq's own block signals); Python then
        # only flags it for the main thread, which stays blocked in zmq_poll and never
        # runs the handler. With the wake-up fd, the C-level handler writes to the socket
        # the poller watches, on whichever thread it runs, so the poll returns.
        old_wakeup_fd = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        self._initial_ppid = os.getppid()
        self._watch_parent()
        try:
            try:
                if self.options.control_address:
                    self.control = self.ctx.socket(zmq.REP)
                    self.control.setsockopt(zmq.LINGER, 0)
                    self.control.bind(self.options.control_address)
                code = self._startup()
                if code is not None:
                    return code
                self._loop()
                return 0
            except _Stop as stop:
                return stop.code
            except FatalEngineError as exc:
                _log(f"fatal error in the engine core: {exc}")
                return self._die()
            except Exception:
                _log("fatal error in the engine core:\n" + traceback.format_exc())
                if self.outputs:
                    return self._die()
                _log("EngineCore failed to start.")
                return 1
        finally:
            signal.set_wakeup_fd(old_wakeup_fd)
            self._close()

    def _close(self) -> None:
        for sock in [*self.inputs, self.coord_in, self.control, self.handshake]:
            if sock is not None and not sock.closed:
                sock.close(linger=0)
        for sock in [*self.outputs, self.coord_out]:
            if sock is not None and not sock.closed:
                sock.close(linger=_CLEAN_EXIT_LINGER_MS)
        self.ctx.term()
        self._wake_r.close()
        self._wake_w.close()
        if self._parent_fd is not None:
            os.close(self._parent_fd)
            self._parent_fd = None
        control = self.options.control_address
        if control is not None and control.startswith("ipc://"):
            # The engine bound it; libzmq does not remove ipc files on close.
            with contextlib.suppress(OSError):
                os.unlink(control[len("ipc://"):])

    def _die(self) -> int:
        """vLLM's fatal path: ENGINE_CORE_DEAD on every output socket, linger, exit 1."""
        if not self.output_dead:
            # Outputs queued before the failure go first, as from vLLM's output queue.
            while self.delayed:
                _, sock, frames = self.delayed.popleft()
                self.blocked.append((sock, frames))
            with contextlib.suppress(zmq.ZMQError):
                self._flush_blocked()
            for sock in self.outputs:
                with contextlib.suppress(zmq.ZMQError):
                    sock.send(self.wire.dead_frame(), flags=zmq.NOBLOCK)
        for sock in self.outputs:
            sock.close(linger=_OUTPUT_LINGER_MS)
        return 1

    # ---- startup ---------------------------------------------------------------------------

    def _load_model(self) -> None:
        opts = self.options
        try:
            self.model = load_model(
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
            _log(
                f"the {opts.model} model needs torch, which is not installed: "
                "pip install 'trio-vllm[torch]' (or use --model echo)"
            )
            _log("EngineCore failed to start.")
            raise _Stop(1) from None
        per_seq = -(-opts.max_model_len // opts.block_size)
        blocks = opts.num_gpu_blocks or opts.max_num_seqs * per_seq
        self.num_gpu_blocks = blocks
        self.scheduler = Scheduler(
            self.model,
            SchedulerConfig(
                max_num_seqs=opts.max_num_seqs,
                max_num_batched_tokens=opts.max_num_batched_tokens,
                max_model_len=opts.max_model_len,
                block_size=opts.block_size,
                num_gpu_blocks=blocks,
                log_stats=not opts.disable_log_stats,
                include_finished_set=self.coordinator_addresses[1] is not None,
                enable_prefix_caching=opts.enable_prefix_caching,
            ),
            seed=opts.seed,
        )
        self.loaded = True

    def _wait_readable(self, sock: zmq.Socket[bytes], deadline: float | None) -> bool:
        """Block until ``sock`` is readable; False on deadline. Serves control and signals."""
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        if self.control is not None:
            poller.register(self.control, zmq.POLLIN)
        self._register_parent(poller)
        while True:
            if self.shutdown_requested:
                raise _Stop(0)
            timeout = None
            if deadline is not None:
                timeout = int(max(0.0, deadline - time.monotonic()) * 1000) + 1
            events = dict(poller.poll(self._poll_timeout(timeout)))
            self._parent_event(poller, events)
            if self._wake_r.fileno() in events or self._wake_r in events:
                self._drain_wake()
            if self.control is not None and self.control in events:
                self._serve_control()
            if sock in events:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.shutdown_requested:
                raise _Stop(0)
            if self._parent_fd is not None or self._parent_check_s is not None:
                self._check_parent()
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))

    def _startup(self) -> int | None:
        opts = self.options
        local, headless = opts.local, not opts.local
        if opts.handshake_address is None:
            self._load_model()
            self._connect(opts.input_addresses, opts.output_addresses, None, None)
            return None
        hs = self.handshake = self.ctx.socket(zmq.DEALER)
        hs.setsockopt(zmq.IDENTITY, self.identity)
        hs.setsockopt(zmq.LINGER, _HANDSHAKE_LINGER_MS)
        hs.connect(opts.handshake_address)
        hs.send(self.wire.encode_hello(local=local, headless=headless))
        deadline = time.monotonic() + opts.handshake_timeout
        if not self._wait_readable(hs, deadline):
            _log(
                "Did not receive response from front-end process within "
                f"{opts.handshake_timeout:g} seconds"
            )
            _log("EngineCore failed to start.")
            return 1
        try:
            metadata = self.wire.decode_init_metadata(hs.recv())
        except WireError as exc:
            _log(f"bad init metadata: {exc}")
            _log("EngineCore failed to start.")
            return 1
        addresses = metadata.addresses
        self.coordinator_addresses = (addresses.coordinator_input, addresses.coordinator_output)
        if opts.startup_delay > 0:
            self._sleep(opts.startup_delay)
        if opts.crash_on_startup is not None:
            _log(opts.crash_on_startup)
            _log("EngineCore failed to start.")
            return 1
        self._load_model()
        self._connect(
            list(addresses.inputs),
            list(addresses.outputs),
            addresses.coordinator_input,
            addresses.coordinator_output,
        )
        hs.send(
            self.wire.encode_ready(
                local=local,
                headless=headless,
                parallel_config_hash=(
                    f"reference-{opts.data_parallel_size}"
                    if opts.data_parallel_size > 1
                    else None
                ),
            )
        )
        hs.close(linger=_HANDSHAKE_LINGER_MS)
        self.handshake = None
        if opts.verbose:
            _log(
                f"rank {self.rank} ready ({opts.model} on {self.model.device}, vLLM "
                f"{opts.protocol} protocol): inputs {list(addresses.inputs)}, outputs "
                f"{list(addresses.outputs)}, coordinator {self.coordinator_addresses}"
            )
        return None

    def _connect(
        self,
        inputs: list[str],
        outputs: list[str],
        coordinator_input: str | None,
        coordinator_output: str | None,
    ) -> None:
        for address in inputs:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, self.identity)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self.inputs.append(sock)
        if coordinator_input is not None:
            self.coord_in = self.ctx.socket(zmq.XSUB)
            self.coord_in.setsockopt(zmq.LINGER, 0)
            self.coord_in.connect(coordinator_input)
            self.coord_in.send(b"\x01")
        ready = self.wire.encode_ready_response(self._ready_response_fields())
        for sock in self.inputs:
            sock.send(ready)
        if self.coord_in is not None:
            while True:
                if not self._wait_readable(self.coord_in, time.monotonic() + 10):
                    _log("Waiting for READY message from DP Coordinator...")
                    continue
                if self.coord_in.recv_multipart() == [b"READY"]:
                    break
        for address in outputs:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, _FIREHOSE_HWM if self.options.firehose else 0)
            sock.setsockopt(zmq.LINGER, _OUTPUT_LINGER_MS)
            sock.connect(address)
            self.outputs.append(sock)
        if coordinator_output is not None:
            self.coord_out = self.ctx.socket(zmq.PUSH)
            self.coord_out.setsockopt(zmq.SNDHWM, 0)
            self.coord_out.setsockopt(zmq.LINGER, _OUTPUT_LINGER_MS)
            self.coord_out.connect(coordinator_output)

    def _ready_response_fields(self) -> dict[str, Any]:
        opts = self.options
        kv_tokens = self.num_gpu_blocks * opts.block_size
        return {
            "max_model_len": opts.max_model_len,
            "num_gpu_blocks": self.num_gpu_blocks,
            "block_size": opts.block_size,
            "dp_stats_address": None,
            "dtype": self.model.dtype,
            "vllm_version": opts.protocol,
            "world_size": 1,
            "data_parallel_size": opts.data_parallel_size,
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "decode_context_parallel_size": 1,
            "data_parallel_rank": self.rank,
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
            "coordinator_input_address": self.coordinator_addresses[0],
            "coordinator_output_address": self.coordinator_addresses[1],
        }

    # ---- output ------------------------------------------------------------------------------

    def _send_frames(self, sock: zmq.Socket[bytes], frames: list[Any]) -> None:
        if self.output_delay_ms > 0 or self.delayed:
            self.delayed.append((time.monotonic() + self.output_delay_ms / 1000, sock, frames))
            return
        self._send_now(sock, frames)

    def _send_now(self, sock: zmq.Socket[bytes], frames: list[Any]) -> None:
        # Output sockets have no HWM (as in vLLM) except in firehose mode; there a full
        # socket parks the message (order kept) and the loop waits for POLLOUT, so the
        # engine never blocks in send and signals are always served.
        if not self.blocked:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass
        self.blocked.append((sock, frames))

    def _flush_blocked(self) -> bool:
        """Send parked messages while the sockets take them; True when none are left."""
        while self.blocked:
            sock, frames = self.blocked[0]
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            self.blocked.popleft()
        return True

    def _flush_delayed(self) -> None:
        now = time.monotonic()
        while self.delayed and self.delayed[0][0] <= now:
            _, sock, frames = self.delayed.popleft()
            self._send_now(sock, frames)

    def send(self, client_index: int, outputs: Any) -> None:
        """Send one EngineCoreOutputs to ``outputs[client_index]`` (-1: the coordinator)."""
        if self.output_dead:
            return
        if client_index == -1 and self.coord_out is not None:
            sock = self.coord_out
        elif 0 <= client_index < len(self.outputs):
            sock = self.outputs[client_index]
        else:
            # vLLM's output thread raises IndexError here and dies: nothing more is sent.
            self.output_dead = True
            _log(f"output thread died: no output socket for client_index {client_index}")
            return
        self._send_frames(sock, self.wire.encode_outputs(outputs))

    def _client_outputs(self, client_index: int, batch: ClientBatch, **extra: Any) -> Any:
        return self.wire.outputs(
            engine_index=self.rank,
            outputs=[self._output_struct(r) for r in batch.outputs],
            finished_requests=batch.finished_requests,
            **extra,
        )

    def _output_struct(self, record: OutputRecord) -> Any:
        return self.wire.output(record)

    def send_engine_finished(self, per_client: dict[int, ClientBatch]) -> None:
        """Engine-initiated finishes (abort on pause/shutdown): outputs + finished ids."""
        for client_index, batch in per_client.items():
            self.send(client_index, self._client_outputs(client_index, batch))

    def _send_step(self, result: StepResult) -> None:
        weight_version = self.utilities.weight_version
        stats = None if result.stats is None else self.wire.stats(result.stats)
        for client_index, batch in result.per_client.items():
            extra: dict[str, Any] = {"weight_version": weight_version}
            if stats is not None:
                # vLLM attaches the step's stats to the first client's message only.
                extra["scheduler_stats"], stats = stats, None
            self.send(client_index, self._client_outputs(client_index, batch, **extra))
        if stats is not None:
            self.send(
                0,
                self.wire.outputs(
                    engine_index=self.rank, scheduler_stats=stats, weight_version=weight_version
                ),
            )

    def _reply(self, client_index: int, call_id: int, failure: str | None, value: Any) -> None:
        self.send(
            client_index,
            self.wire.outputs(
                engine_index=self.rank,
                utility_output=self.wire.utility_output(call_id, failure, value),
            ),
        )

    def _send_garbage(self) -> None:
        for sock in self.outputs:
            self._send_frames(sock, [GARBAGE_FRAME])

    # ---- input ---------------------------------------------------------------------------------

    def _kill_input(self, why: str) -> None:
        # vLLM decodes in its input thread outside any handler: the thread dies, the
        # process stays up and never reads again, and nothing is sent (§3.7).
        self.input_dead = True
        _log(f"input thread died: {why}")

    def _drain_inputs(self, events: dict[Any, int]) -> None:
        """Handle what is queued on the readable input sockets (at most 1024 each)."""
        for sock in self.inputs:
            if not events.get(sock, 0) & zmq.POLLIN:
                continue
            for _ in range(1024):
                if self.input_dead or self.stalled:
                    return
                # EVENTS is cheaper than a failing non-blocking recv (no exception).
                if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    break
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                self._handle_input([f.buffer for f in frames])

    def _handle_input(self, frames: list[memoryview]) -> None:
        self.starved = False  # any input may change what can be scheduled
        head = bytes(frames[0][:2]) if frames else b""
        if head == b"\x04":
            # EXECUTOR_FAILED is vLLM's internal sentinel: its busy loop raises on it.
            raise FatalEngineError("EXECUTOR_FAILED request received: executor failed")
        if head == b"\x05":
            return  # WAKEUP only wakes vLLM's idle loop
        try:
            kind, payload = self.wire.decode_input(frames)
        except WireError as exc:
            self._kill_input(str(exc))
            return
        if kind == "add":
            self._handle_add(payload)
        elif kind == "abort":
            self._handle_abort(payload)
        elif kind == "utility":
            self._handle_utility(*payload)
        elif kind == "start_dp_wave":
            self._handle_start_wave(*payload)
        else:
            self._kill_input(f"unexpected request type {kind!r}")

    def _handle_abort(self, request_ids: list[str]) -> None:
        self.scheduler.abort(request_ids)
        for rid in request_ids:
            self.firehose.pop(rid, None)

    def _error_output(self, req: Any, message: str, code: str = "validation_error",
                      retryable: bool = False, reason: FinishReason = FinishReason.ERROR) -> None:
        record = OutputRecord(
            req.request_id,
            [],
            finish_reason=int(reason),
            trace_headers=req.trace_headers,
            error=(code, message, retryable) if reason is FinishReason.ERROR else None,
        )
        if reason is FinishReason.ERROR:
            _log(f"request {req.request_id!r} failed: {message}")
        batch = ClientBatch([record], {req.request_id})
        self.send(req.client_index, self._client_outputs(req.client_index, batch))

    def _handle_add(self, req: Any) -> None:
        opts = self.options
        if self.shutdown_requested:
            self._error_output(req, "shutting down", reason=FinishReason.ABORT)
            return
        rid = req.request_id
        if rid in self.scheduler.requests or rid in self.firehose:
            raise FatalEngineError(f"duplicate request id {rid!r}")
        if req.pooling_params is not None:
            task = req.pooling_params.task
            if task is None or task not in opts.supported_tasks or task == "generate":
                raise FatalEngineError(f"Unsupported task: {task!r}")
        if opts.oov_fatal:
            self._check_vocabulary(req)
        if opts.moe:
            self._wave_on_add(req)
        if self.utilities.generation_paused and self.profile_name == "0.33.0":
            self._error_output(req, "engine is paused", code="engine_paused", retryable=True)
            return
        try:
            engine_req = self._preprocess(req)
        except ValueError as exc:
            self._error_output(req, str(exc))
            return
        if req.abort_immediately:
            return
        if opts.firehose > 0 and engine_req.pooling is None:
            engine_req.firehose = True
            if not opts.disable_log_stats:
                now = time.monotonic()
                engine_req.events = [(1, now), (2, now)]
            self.firehose[rid] = engine_req
            return
        self.scheduler.add(engine_req)

    def _check_vocabulary(self, req: Any) -> None:
        """``--oov-fatal``: die of an out-of-vocabulary id as a stock engine core does
        (its embedding lookup or sampler mask indexes out of range)."""
        vocab = self.model.vocab_size
        sp = req.sampling_params
        fields: list[tuple[str, Any]] = [("prompt_token_ids", req.prompt_token_ids or [])]
        if sp is not None:
            fields += [
                ("allowed_token_ids", sp.allowed_token_ids or []),
                ("logit_bias", list(sp.logit_bias or {})),
                ("stop_token_ids", sp.stop_token_ids or []),
            ]
        for name, ids in fields:
            for token in ids:
                if isinstance(token, int) and not 0 <= token < vocab:
                    raise FatalEngineError(
                        f"request {req.request_id!r}: token id {token} in {name} is out of "
                        f"the vocabulary [0, {vocab}) (--oov-fatal)"
                    )

    def _preprocess(self, req: Any) -> EngineRequest:
        """vLLM's contained pre-processing errors become ValueError (finish ERROR)."""
        opts = self.options
        sp, pp = req.sampling_params, req.pooling_params
        if (sp is None) == (pp is None):
            raise ValueError("exactly one of sampling_params and pooling_params must be set")
        if req.mm_features:
            raise ValueError("multimodal inputs are not supported by this model")
        if req.resumable:
            raise ValueError("streaming-input (resumable) requests are not supported")
        if sp is not None:
            unsupported = {
                "structured_outputs": sp.structured_outputs is not None,
                "logprob_token_ids": sp.logprob_token_ids is not None,
                "prompt_logprob_token_ids": sp.prompt_logprob_token_ids is not None,
                "thinking_token_budget": sp.thinking_token_budget is not None,
                "repetition_detection": sp.repetition_detection is not None
                and sp.repetition_detection.max_pattern_size > 0,
            }
            for name, used in unsupported.items():
                if used:
                    raise ValueError(f"{name} is not supported by this engine")
        if req.client_index < 0:
            raise ValueError(f"invalid client_index {req.client_index}")
        embeds = mask = None
        ids = req.prompt_token_ids
        if req.prompt_embeds is not None:
            embeds = self.wire.to_numpy(req.prompt_embeds).astype(np.float32)
            if embeds.ndim != 2 or embeds.shape[0] == 0:
                raise ValueError(f"prompt_embeds must be [num_tokens, hidden], got {embeds.shape}")
            if opts.model == "tiny" and embeds.shape[1] != self.model.hidden_size:
                raise ValueError(
                    f"prompt_embeds hidden size {embeds.shape[1]} != {self.model.hidden_size}"
                )
            n = embeds.shape[0]
            if req.prompt_is_token_ids is not None:
                if len(req.prompt_is_token_ids) != n or ids is None or len(ids) != n:
                    raise ValueError("prompt_is_token_ids/prompt_token_ids length mismatch")
                mask = ~np.asarray(req.prompt_is_token_ids, dtype=bool)
                ids = [int(t) if not m else 0 for t, m in zip(ids, mask, strict=True)]
            else:
                mask = np.ones(n, dtype=bool)
                ids = [0] * n
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"token id out of vocabulary [0, {vocab})")
        limit = opts.max_model_len if pp is not None else opts.max_model_len - 1
        if len(ids) > limit:
            raise ValueError(
                f"prompt of {len(ids)} tokens is too long for max_model_len {opts.max_model_len}"
            )
        lora_name = None
        if req.lora_request is not None:
            if opts.max_loras <= 0:
                raise ValueError("LoRA request on an engine without LoRA support")
            try:
                self.utilities.add_lora_from_request(req.lora_request)
            except UtilityError as exc:
                raise ValueError(str(exc)) from exc
            lora_name = req.lora_request.lora_name
        seq = Sequence(list(ids), len(ids), embeds, mask, self.model.vocab_size)
        common: dict[str, Any] = {
            "request_id": req.request_id,
            "client_index": req.client_index,
            "seq": seq,
            "lora_name": lora_name,
            "cache_salt": req.cache_salt,
            "trace_headers": req.trace_headers,
            "arrival_time": req.arrival_time,
        }
        if pp is not None:
            return EngineRequest(
                **common,
                pooling=PoolingSpec(pp.task, pp.use_activation, pp.dimensions),
                skip_reading_prefix_cache=bool(pp.skip_reading_prefix_cache),
            )
        if sp.max_tokens is None:
            raise ValueError("max_tokens must not be None")
        if sp.n != 1:
            raise ValueError("n > 1 is fanned out by the frontend; send n=1")
        all_stop = set(sp._all_stop_token_ids) | set(sp.stop_token_ids or ())
        state = SamplingState(
            temperature=sp.temperature,
            top_k=sp.top_k if sp.top_k and sp.top_k > 0 else 0,
            top_p=sp.top_p,
            min_p=sp.min_p,
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty,
            logit_bias={int(k): float(v) for k, v in sp.logit_bias.items()}
            if sp.logit_bias
            else None,
            allowed_token_ids=sp.allowed_token_ids,
            bad_words_token_ids=sp._bad_words_token_ids,
            min_tokens=sp.min_tokens,
            min_tokens_stop_ids=sorted(all_stop),
            logprobs=sp.logprobs,
            rng=np.random.default_rng(sp.seed) if sp.seed is not None else None,
        )
        return EngineRequest(
            **common,
            sampling=state,
            max_tokens=sp.max_tokens,
            min_tokens=sp.min_tokens,
            eos_token_id=sp._eos_token_id,
            ignore_eos=sp.ignore_eos,
            stop_token_ids=frozenset(sp.stop_token_ids or ()),
            prompt_logprobs=sp.prompt_logprobs,
            skip_reading_prefix_cache=bool(sp.skip_reading_prefix_cache),
        )

    def _handle_utility(
        self, client_index: int, call_id: int, method: str, args: list[Any]
    ) -> None:
        if method == "handle_fault_tolerance":
            # Intercepted in vLLM's input thread; without fault tolerance it raises there.
            self._kill_input("handle_fault_tolerance on an engine without fault tolerance")
            return
        if self.shutdown_requested:
            self._reply(client_index, call_id, "Server shutting down", None)
            return
        self.last_utility_argc = len(args)
        try:
            result = self.utilities.call(method, args)
        except UtilityError as exc:
            self._reply(client_index, call_id, f"Call to {method} method failed: {exc}", None)
            return
        if isinstance(result, Deferred):
            self.pending_utilities.append((client_index, call_id, method, result))
            return
        self._reply(client_index, call_id, None, result)

    def _complete_deferred(self) -> None:
        if not self.pending_utilities:
            return
        still = []
        for client_index, call_id, method, deferred in self.pending_utilities:
            if not deferred.ready():
                still.append((client_index, call_id, method, deferred))
                continue
            try:
                value = deferred.finish()
            except Exception as exc:
                self._reply(client_index, call_id, f"Call to {method} method failed: {exc}", None)
            else:
                self._reply(client_index, call_id, None, value)
        self.pending_utilities = still

    # ---- DP waves (MoE ranks, docs/protocol.md §7.4) ---------------------------------------------

    def _wave_target(self) -> int:
        return -1 if self.coord_out is not None else 0

    def _wave_on_add(self, req: Any) -> None:
        if self.coord_out is None or req.current_wave == self.scheduler.current_wave:
            return
        if req.current_wave > self.scheduler.current_wave:
            self.scheduler.current_wave = req.current_wave
        elif not self.engines_running:
            # A request for a wave that already ended: ask the coordinator for a new one.
            self._request_wave()

    def _request_wave(self) -> None:
        """Send ``start_wave = current_wave`` to the coordinator, once per wave."""
        wave = self.scheduler.current_wave
        if self.coord_out is None or self.start_wave_sent == wave:
            return
        self.start_wave_sent = wave
        self.send(-1, self.wire.outputs(engine_index=self.rank, start_wave=wave))

    def _handle_start_wave(self, wave: int, exclude: int | None) -> None:
        if not self.options.moe:
            _log("Unrecognized input request type: START_DP_WAVE")
            return
        if exclude != self.rank and wave >= self.scheduler.current_wave:
            self.scheduler.current_wave = wave
            if not self.engines_running:
                self.engines_running = True
                self.wave_steps = 0

    def _wave_after_step(self) -> None:
        """Every rank decides alone (no collective): a wave ends when this rank is idle."""
        self.wave_steps += 1
        if self.wave_steps != 1 and self.wave_steps % _DP_SYNC_INTERVAL != 0:
            return
        if self.scheduler.has_unfinished() or self.firehose:
            return
        self.engines_running = False
        if self.rank == 0 or self.coord_out is None:
            self.send(self._wave_target(), self.wire.outputs(
                engine_index=self.rank, wave_complete=self.scheduler.current_wave))
        self.scheduler.current_wave += 1
        self.wave_steps = 0

    def _publish_counts(self) -> None:
        if self.coord_out is None:
            return
        counts = (len(self.scheduler.running), len(self.scheduler.waiting))
        if counts == self.last_counts:
            return
        self.last_counts = counts
        self.send(-1, self.wire.outputs(
            engine_index=self.rank,
            scheduler_stats=self.wire.stats({
                "num_running_reqs": counts[0],
                "num_waiting_reqs": counts[1],
                "step_counter": self.scheduler.step_counter,
                "current_wave": self.scheduler.current_wave,
            }),
        ))

    # ---- control socket ----

    def _serve_control(self) -> None:
        assert self.control is not None
        try:
            raw = self.control.recv(flags=zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            command = json.loads(raw)
            name = command["cmd"]
        except (ValueError, KeyError, TypeError) as exc:
            self.control.send_json({"ok": False, "error": f"bad command: {exc}"})
            return
        reply: dict[str, Any] = {"ok": True}
        after = None
        if name == "ping":
            reply.update(
                pid=os.getpid(),
                steps=self.steps,
                running=len(self.scheduler.running) if self.loaded else 0,
                waiting=len(self.scheduler.waiting) if self.loaded else 0,
                firehose=len(self.firehose),
                stalled=self.stalled,
                input_dead=self.input_dead,
                output_dead=self.output_dead,
            )
        elif name == "kill":
            code = int(command.get("code", 1))
            after = lambda: self._exit_now(code)  # noqa: E731
        elif name == "dead":
            after = self._raise_dead
        elif name == "stall":
            self.stalled = True
        elif name == "unstall":
            self.stalled = False
        elif name == "garbage":
            self._send_garbage()
        elif name == "delay":
            self.output_delay_ms = float(command.get("ms", 0))
        elif name == "fail_utility":
            self.options.fail_utilities.add(str(command["name"]))
        elif name == "unfail_utility":
            self.options.fail_utilities.discard(str(command["name"]))
        elif name == "shutdown":
            self.shutdown_requested = True
        else:
            reply = {"ok": False, "error": f"unknown command {name!r}"}
        self.control.send_json(reply)
        if after is not None:
            after()

    def _exit_now(self, code: int) -> None:
        time.sleep(0.05)  # let the control reply leave
        os._exit(code)

    def _raise_dead(self) -> None:
        raise FatalEngineError("ENGINE_CORE_DEAD requested on the control socket")

    # ---- busy loop ----

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(64):
                pass
        except (BlockingIOError, OSError):
            pass

    def _begin_shutdown(self) -> None:
        self.shutdown_handled = True
        if self.stalled:
            raise _Stop(0)
        if self.options.shutdown_timeout <= 0:
            self.send_engine_finished(self.scheduler.finish_all(FinishReason.ABORT))
            if self.firehose:
                by_client: dict[int, ClientBatch] = {}
                for req in self.firehose.values():
                    batch = by_client.setdefault(
                        req.client_index, ClientBatch(finished_requests=set())
                    )
                    batch.outputs.append(OutputRecord(req.request_id, [], finish_reason=2))
                    assert batch.finished_requests is not None
                    batch.finished_requests.add(req.request_id)
                self.firehose.clear()
                self.send_engine_finished(by_client)
        for client_index, call_id, _method, _deferred in self.pending_utilities:
            self._reply(client_index, call_id, "Server shutting down", None)
        self.pending_utilities = []

    def _after_step_faults(self) -> None:
        opts = self.options
        n = self.steps
        if opts.garbage_after_steps is not None and n >= opts.garbage_after_steps and not (
            self.garbage_sent
        ):
            self.garbage_sent = True
            self._send_garbage()
        if opts.die_after_steps is not None and n >= opts.die_after_steps:
            _log(f"fault injection: dying after step {n}")
            os._exit(1)
        if opts.dead_after_steps is not None and n >= opts.dead_after_steps:
            raise FatalEngineError(f"fault injection: ENGINE_CORE_DEAD after step {n}")
        if opts.stall_after_steps is not None and n >= opts.stall_after_steps:
            if not self.stalled:
                _log(f"fault injection: stalling after step {n}")
            self.stalled = True
            opts.stall_after_steps = None

    def _input_dead_now(self) -> bool:
        return self.input_dead  # a method: see _stalled_now

    def _stalled_now(self) -> bool:
        # A method, so type narrowing of ``self.stalled`` earlier in the loop does not
        # hide that a fault may have set it since.
        return self.stalled

    def run_dummy_batch(self) -> None:
        if self.utilities.is_sleeping() and "weights" in self.utilities._sleeping_tags:
            return
        self.model.next_token_logits([Sequence([0], 1)])

    def _firehose_step(self) -> bool:
        """Send one firehose message per client; False while an output socket is full
        (the rest goes out when it is writable again)."""
        if not self._flush_blocked():
            return False
        live = list(self.firehose.values())
        per_client: dict[int, list[Any]] = {}
        finished: dict[int, set[str]] = {}
        wire = self.wire
        for _ in range(self.options.firehose):
            if not live:
                break
            req = live[self.firehose_cursor % len(live)]
            self.firehose_cursor += 1
            prompt = req.seq.echo_prompt()
            token = prompt[len(req.output_token_ids) % len(prompt)]
            req.output_token_ids.append(token)
            done = len(req.output_token_ids) >= req.max_tokens
            finish = int(FinishReason.LENGTH) if done else None
            if req.events:
                record = OutputRecord(req.request_id, [token], finish_reason=finish)
                record.events, req.events = req.events, []
                out = wire.output(record)
            else:
                out = wire.token_output(req.request_id, token, finish)
            per_client.setdefault(req.client_index, []).append(out)
            if done:
                del self.firehose[req.request_id]
                live.remove(req)
                if self.scheduler.config.include_finished_set:
                    finished.setdefault(req.client_index, set()).add(req.request_id)
        self.steps += 1
        self.scheduler.step_counter += 1
        stats = None
        if not self.options.disable_log_stats:
            values = self.scheduler.make_stats()
            values["num_running_reqs"] += len(self.firehose)
            stats = wire.stats(values)
        for client_index, outs in per_client.items():
            message = wire.outputs(
                engine_index=self.rank,
                outputs=outs,
                scheduler_stats=stats,
                finished_requests=finished.get(client_index),
                weight_version=self.utilities.weight_version,
            )
            stats = None
            if self.output_dead or not 0 <= client_index < len(self.outputs):
                self.send(client_index, message)
                continue
            self._send_frames(self.outputs[client_index], wire.encode_outputs(message))
        return not self.blocked

    def _loop(self) -> None:
        poller = zmq.Poller()
        for sock in self.inputs:
            poller.register(sock, zmq.POLLIN)
        if self.coord_in is not None:
            poller.register(self.coord_in, zmq.POLLIN)
        if self.control is not None:
            poller.register(self.control, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        stalled_poller = zmq.Poller()
        if self.control is not None:
            stalled_poller.register(self.control, zmq.POLLIN)
        stalled_poller.register(self._wake_r, zmq.POLLIN)
        self._register_parent(poller)
        self._register_parent(stalled_poller)
        firehose_wait: zmq.Socket[bytes] | None = None
        while True:
            if self.shutdown_requested and not self.shutdown_handled:
                self._begin_shutdown()
            if self.shutdown_handled and not self.scheduler.has_unfinished() and not (
                self.firehose
            ):
                self._flush_delayed_blocking()
                return
            schedulable = self.scheduler.has_schedulable() and not self.starved
            paced = schedulable and self.next_step_at > time.monotonic()
            busy = not self.stalled and (
                (schedulable and not paced)
                or (bool(self.firehose) and not self.blocked)
                or (self.options.moe and self.engines_running)
            )
            wake_at = [self.delayed[0][0]] if self.delayed else []
            if paced:
                wake_at.append(self.next_step_at)
            if busy:
                timeout: int | None = 0
            elif wake_at and not self.stalled:
                timeout = int(max(0.0, min(wake_at) - time.monotonic()) * 1000) + 1
            else:
                timeout = None
            want = self.blocked[0][0] if self.blocked and not self.stalled else None
            if want is not firehose_wait:
                if firehose_wait is not None:
                    poller.unregister(firehose_wait)
                if want is not None:
                    poller.register(want, zmq.POLLOUT)
                firehose_wait = want
            # Stalled, the input sockets stay unread; polling them would spin on their
            # pending messages, so only the control socket and signals are watched.
            active = stalled_poller if self.stalled else poller
            events = dict(active.poll(self._poll_timeout(timeout)))
            if self._parent_fd is not None and self._parent_fd in events:
                # Both pollers watch the pidfd; the other one must forget it too.
                (poller if active is stalled_poller else stalled_poller).unregister(
                    self._parent_fd
                )
            self._parent_event(active, events)
            if self._wake_r.fileno() in events or self._wake_r in events:
                self._drain_wake()
            if self.control is not None and self.control in events:
                self._serve_control()
            if self.stalled:
                if self.shutdown_requested:
                    raise _Stop(0)
                continue
            if not self.input_dead:
                self._drain_inputs(events)
                if self._input_dead_now():
                    # Never read again, so never wait on these sockets again either
                    # (their unread messages would wake every poll).
                    for sock in self.inputs:
                        poller.unregister(sock)
            if self.coord_in is not None and self.coord_in in events:
                self._drain_coordinator()
            self._flush_blocked()
            self._flush_delayed()
            self._complete_deferred()
            if self.options.moe and not self.engines_running and (
                self.scheduler.has_unfinished() or self.firehose
            ):
                self.engines_running = True
                self.wave_steps = 0
                # 0.32: rank 0 reports idle -> running; 0.33: any idle rank that got work.
                if self.rank == 0 or self.profile_name == "0.33.0":
                    self._request_wave()
            stepped = False
            if (
                self.scheduler.has_schedulable()
                and not self.starved
                and time.monotonic() >= self.next_step_at
            ):
                if self.options.step_interval_ms > 0:
                    self.next_step_at = time.monotonic() + self.options.step_interval_ms / 1000
                result = self.scheduler.step()
                if result.num_scheduled_tokens == 0 and not result.per_client:
                    # Nothing fits (e.g. no free KV blocks for the waiting requests):
                    # wait for input instead of spinning on empty steps.
                    self.starved = True
                else:
                    self.steps += 1
                    self._send_step(result)
                    stepped = True
            elif self.firehose and not self.blocked:
                # Several messages per poll: a poll is a syscall, dearer than a message.
                for _ in range(_FIREHOSE_BURST):
                    self._firehose_step()
                    self._after_step_faults()
                    if self.blocked or not self.firehose or self._stalled_now():
                        break
            elif self.options.moe and self.engines_running:
                self.run_dummy_batch()
            if self.options.moe and self.engines_running:
                self._wave_after_step()
            self._publish_counts()
            self._complete_deferred()
            if stepped:
                self._after_step_faults()

    def _flush_delayed_blocking(self) -> None:
        """Last sends before a clean exit: delayed outputs, then parked ones (bounded)."""
        while self.delayed:
            wait = self.delayed[0][0] - time.monotonic()
            if wait > 0:
                time.sleep(min(wait, 0.5))
            self._flush_delayed()
        deadline = time.monotonic() + 0.1
        while not self._flush_blocked() and time.monotonic() < deadline:
            time.sleep(0.005)

    def _drain_coordinator(self) -> None:
        assert self.coord_in is not None
        while True:
            try:
                frames = self.coord_in.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if frames == [b"READY"]:
                continue
            try:
                kind, payload = self.wire.decode_input([memoryview(f) for f in frames])
            except WireError as exc:
                _log(f"ignoring undecodable coordinator message: {exc}")
                continue
            if kind == "start_dp_wave":
                self._handle_start_wave(*payload)


def run_engine(options: EngineOptions) -> int:
    """Run an engine process to completion; returns its exit status."""
    return EngineServer(options).run()
