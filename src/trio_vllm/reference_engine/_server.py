"""The engine process: its parts, the busy loop, death and shutdown.

One thread, plain pyzmq: a ``zmq.Poller`` over the input DEALER(s), the coordinator XSUB,
the optional control REP socket and a signal wake-up fd. The loop reads every queued
input message (without blocking), then runs one scheduler step when there is work, sends
that step's outputs, and blocks in ``poll`` only when there is nothing to do (or until
the next delayed output is due, or the next paced step with ``--step-interval-ms``).
Everything on the wire goes through ``_wire.py`` (the protocol layer).

`EngineServer` owns the state and the loop; its parts each hold one concern and see
the engine through `EngineState` (``_state.py``), never through this module:

* ``_process.py``: signals, the wake-up socket, the ``--parent-pid`` watch;
* ``_startup.py``: the handshake, the model and scheduler, every socket;
* ``_outputs.py``: the output path with its delayed and blocked queues;
* ``_requests.py``: decoded request -> scheduler request (vLLM's refusals);
* ``_utilities.py``: the utility methods and their deferred replies;
* ``_control.py``: the control socket and the step-count faults;
* ``_waves.py``: DP waves and counts for the coordinator; ``_firehose.py``: ``--firehose``.

Failure behaviour is vLLM's (docs/protocol.md §3.7, §5.6, §8): an undecodable input message
"kills the input thread" (input is never read again, nothing is sent), a bad
``client_index`` "kills the output thread" (nothing is ever sent again), a fatal error
sends ``ENGINE_CORE_DEAD`` to every client and exits with status 1, SIGTERM/SIGINT finish
everything as ABORT and exit 0.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from typing import TYPE_CHECKING, Any

import zmq

from ._control import ControlChannel, StepFaults
from ._errors import EngineExit, FatalEngineError, WireError, log
from ._firehose import Firehose
from ._model import Sequence
from ._outputs import OutputPath
from ._process import ProcessWatch
from ._requests import check_vocabulary, preprocess
from ._scheduler import FinishReason
from ._startup import Sockets, start
from ._utilities import Utilities, UtilityCalls
from ._waves import DPCoordination
from ._wire import Wire

if TYPE_CHECKING:
    from ._model import Model
    from ._options import EngineOptions
    from ._scheduler import Scheduler
    from ._startup import Engine

__all__ = ["EngineServer", "FatalEngineError", "run_engine"]

_FIREHOSE_BURST = 16


class EngineServer:
    """One engine core process. ``run()`` returns the process exit status."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.rank = options.index
        self.wire = Wire(options.protocol)
        self.profile = self.wire.profile
        self.model: Model = None  # type: ignore[assignment]  # set once startup loads it
        self.scheduler: Scheduler = None  # type: ignore[assignment]
        self.loaded = False
        self.steps = 0
        self.stalled = False
        self.input_dead = False
        self.starved = False
        self.shutdown_handled = False
        self.next_step_at = 0.0  # --step-interval-ms: no step starts before this
        self.process = ProcessWatch(options.parent_pid)
        self.sockets = Sockets(zmq.Context(io_threads=1), self.rank.to_bytes(2, "little"))
        self.output = OutputPath(self.wire, self.rank, self.sockets, options.output_delay_ms)
        self.control: ControlChannel | None = None
        self.faults = StepFaults(self)
        self.utilities = Utilities(self)
        self.calls = UtilityCalls(self.utilities, self._reply)
        self.firehose = Firehose(options.firehose, log_stats=not options.disable_log_stats)
        self.waves = DPCoordination(self, self.sockets)

    # ---- EngineState ----

    @property
    def shutdown_requested(self) -> bool:
        return self.process.stop_requested

    @shutdown_requested.setter
    def shutdown_requested(self, value: bool) -> None:
        self.process.stop_requested = value

    def firehose_requests(self) -> int:
        return len(self.firehose.requests)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.firehose.requests)

    def run_dummy_batch(self) -> None:
        if self.utilities.weights_asleep():
            return
        self.model.next_token_logits([Sequence([0], 1)])

    # ---- process ----

    def run(self) -> int:
        self.process.install()
        try:
            try:
                if self.options.control_address:
                    sock = self.sockets.control = self.sockets.ctx.socket(zmq.REP)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.bind(self.options.control_address)
                    self.control = ControlChannel(sock, self)
                if not start(
                    self.options,
                    self.wire,
                    self.sockets,
                    self.process,
                    self._serve_control,
                    self._on_loaded,
                ):
                    return 1
                self._loop()
                return 0
            except EngineExit as stop:
                return stop.code
            except FatalEngineError as exc:
                log(f"fatal error in the engine core: {exc}")
                return self._die()
            except Exception:
                log("fatal error in the engine core:\n" + traceback.format_exc())
                if self.sockets.outputs:
                    return self._die()
                log("EngineCore failed to start.")
                return 1
        finally:
            self.process.uninstall()
            self._close()

    def _on_loaded(self, engine: Engine) -> None:
        self.model, self.scheduler = engine.model, engine.scheduler
        self.loaded = True

    def _serve_control(self) -> None:
        if self.control is not None:
            self.control.serve()

    def _close(self) -> None:
        self.sockets.close()
        self.process.close()
        control = self.options.control_address
        if control is not None and control.startswith("ipc://"):
            # The engine bound it; libzmq does not remove ipc files on close.
            with contextlib.suppress(OSError):
                os.unlink(control[len("ipc://") :])

    def _die(self) -> int:
        """vLLM's fatal path: ENGINE_CORE_DEAD on every output socket, linger, exit 1."""
        self.output.die()
        return 1

    def _reply(self, client_index: int, call_id: int, failure: str | None, value: Any) -> None:
        self.output.reply(client_index, call_id, failure, value)

    # ---- input ----

    def _kill_input(self, why: str) -> None:
        # vLLM decodes in its input thread outside any handler: the thread dies, the
        # process stays up and never reads again, and nothing is sent (§3.7).
        self.input_dead = True
        log(f"input thread died: {why}")

    def _drain_inputs(self, events: dict[Any, int]) -> None:
        """Handle what is queued on the readable input sockets (at most 1024 each)."""
        for sock in self.sockets.inputs:
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
            self.waves.handle_start_wave(*payload)
        else:
            self._kill_input(f"unexpected request type {kind!r}")

    def _handle_abort(self, request_ids: list[str]) -> None:
        self.scheduler.abort(request_ids)
        self.firehose.abort(request_ids)

    def _handle_add(self, req: Any) -> None:
        opts = self.options
        if self.shutdown_requested:
            self.output.send_request_error(req, "shutting down", reason=FinishReason.ABORT)
            return
        rid = req.request_id
        if rid in self.scheduler.requests or rid in self.firehose.requests:
            raise FatalEngineError(f"duplicate request id {rid!r}")
        if req.pooling_params is not None:
            task = req.pooling_params.task
            if task is None or task not in opts.supported_tasks or task == "generate":
                raise FatalEngineError(f"Unsupported task: {task!r}")
        if opts.oov_fatal:
            check_vocabulary(req, self.model.vocab_size)
        if opts.moe:
            self.waves.on_add(req)
        # Only a release with pause_generation (0.33) pauses generation this way.
        if self.utilities.generation_paused:
            self.output.send_request_error(
                req, "engine is paused", code="engine_paused", retryable=True
            )
            return
        try:
            engine_req = preprocess(
                req, opts, self.model, self.wire, self.utilities.add_lora_from_request
            )
        except ValueError as exc:
            self.output.send_request_error(req, str(exc))
            return
        if req.abort_immediately:
            return
        if opts.firehose > 0 and engine_req.pooling is None:
            self.firehose.add(engine_req)
            return
        self.scheduler.add(engine_req)

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
        self.calls.handle(client_index, call_id, method, args)

    # ---- busy loop ----

    def _begin_shutdown(self) -> None:
        self.shutdown_handled = True
        if self.stalled:
            raise EngineExit(0)
        if self.options.shutdown_timeout <= 0:
            self.output.send_engine_finished(self.scheduler.finish_all(FinishReason.ABORT))
            if self.firehose.requests:
                self.output.send_engine_finished(self.firehose.finish_all())
        self.calls.fail_all("Server shutting down")

    def _input_dead_now(self) -> bool:
        return self.input_dead  # a method: see _stalled_now

    def _stalled_now(self) -> bool:
        # A method, so type narrowing of ``self.stalled`` earlier in the loop does not
        # hide that a fault may have set it since.
        return self.stalled

    def _firehose_step(self) -> None:
        """Send one firehose message per client; nothing while an output socket is full
        (the rest goes out when it is writable again)."""
        if not self.output.flush_blocked():
            return
        self.steps += 1
        self.firehose.step(
            self.wire, self.rank, self.scheduler, self.output, self.utilities.weight_version
        )

    def _step(self) -> bool:
        """One model step if one may start now; True when it produced something."""
        if self.options.step_interval_ms > 0:
            self.next_step_at = time.monotonic() + self.options.step_interval_ms / 1000
        result = self.scheduler.step()
        if result.num_scheduled_tokens == 0 and not result.per_client:
            # Nothing fits (e.g. no free KV blocks for the waiting requests):
            # wait for input instead of spinning on empty steps.
            self.starved = True
            return False
        if self.options.step_block_ms > 0:
            # The whole loop waits, as on a long GPU step: no input read, no output.
            time.sleep(self.options.step_block_ms / 1000)
        self.steps += 1
        self.output.send_step(result, self.utilities.weight_version)
        return True

    def _poll_timeout(self, busy: bool, paced: bool) -> int | None:
        """0 when busy; else until the next delayed output or paced step; else forever."""
        if busy:
            return 0
        wake_at = []
        due = self.output.next_due()
        if due is not None:
            wake_at.append(due)
        if paced:
            wake_at.append(self.next_step_at)
        if wake_at and not self.stalled:
            return int(max(0.0, min(wake_at) - time.monotonic()) * 1000) + 1
        return None

    def _loop(self) -> None:
        sockets, output, opts = self.sockets, self.output, self.options
        control = sockets.control
        poller = zmq.Poller()
        for sock in sockets.inputs:
            poller.register(sock, zmq.POLLIN)
        if sockets.coord_in is not None:
            poller.register(sockets.coord_in, zmq.POLLIN)
        stalled_poller = zmq.Poller()
        if control is not None:
            poller.register(control, zmq.POLLIN)
            stalled_poller.register(control, zmq.POLLIN)
        self.process.register(poller)
        self.process.register(stalled_poller)
        firehose_wait: zmq.Socket[bytes] | None = None
        while True:
            if self.shutdown_requested and not self.shutdown_handled:
                self._begin_shutdown()
            if self.shutdown_handled and not self.has_work():
                output.flush_before_exit()
                return
            schedulable = self.scheduler.has_schedulable() and not self.starved
            paced = schedulable and self.next_step_at > time.monotonic()
            busy = not self.stalled and (
                (schedulable and not paced)
                or (bool(self.firehose.requests) and not output.blocked)
                or (opts.moe and self.waves.engines_running)
            )
            timeout = self._poll_timeout(busy, paced)
            want = output.waiting_socket() if not self.stalled else None
            if want is not firehose_wait:
                if firehose_wait is not None:
                    poller.unregister(firehose_wait)
                if want is not None:
                    poller.register(want, zmq.POLLOUT)
                firehose_wait = want
            # Stalled, the input sockets stay unread; polling them would spin on their
            # pending messages, so only the control socket and signals are watched.
            active = stalled_poller if self.stalled else poller
            events = dict(active.poll(self.process.poll_timeout(timeout)))
            parent_fd = self.process.parent_fd
            if parent_fd is not None and parent_fd in events:
                # Both pollers watch the pidfd; the other one must forget it too.
                (poller if active is stalled_poller else stalled_poller).unregister(parent_fd)
            self.process.after_poll(active, events)
            if control is not None and control in events:
                self._serve_control()
            if self.stalled:
                if self.shutdown_requested:
                    raise EngineExit(0)
                continue
            if not self.input_dead:
                self._drain_inputs(events)
                if self._input_dead_now():
                    # Never read again, so never wait on these sockets again either
                    # (their unread messages would wake every poll).
                    for sock in sockets.inputs:
                        poller.unregister(sock)
            if sockets.coord_in is not None and sockets.coord_in in events:
                self.waves.drain_input()
            output.flush_blocked()
            output.flush_delayed()
            self.calls.complete()
            if opts.moe:
                self.waves.on_work()
            stepped = False
            if (
                self.scheduler.has_schedulable()
                and not self.starved
                and time.monotonic() >= self.next_step_at
            ):
                stepped = self._step()
            elif self.firehose.requests and not output.blocked:
                # Several messages per poll: a poll is a syscall, dearer than a message.
                for _ in range(_FIREHOSE_BURST):
                    self._firehose_step()
                    self.faults.after_step()
                    if output.blocked or not self.firehose.requests or self._stalled_now():
                        break
            elif opts.moe and self.waves.engines_running:
                self.run_dummy_batch()
            if opts.moe and self.waves.engines_running:
                self.waves.after_step()
            self.waves.publish_counts()
            self.calls.complete()
            if stepped:
                self.faults.after_step()


def run_engine(options: EngineOptions) -> int:
    """Run an engine process to completion; returns its exit status."""
    return EngineServer(options).run()
