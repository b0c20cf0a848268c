"""The output path: every EngineCoreOutputs the engine sends, in order, and how.

A message goes out at once, or waits in the *delayed* queue (``--output-delay-ms``,
the control socket's ``delay``) until it is due, or in the *blocked* queue while a
firehose output socket is full (its HWM is bounded; the busy loop then polls for
POLLOUT, so the engine never blocks in send and signals are always served). Order is
kept across both queues. A bad ``client_index`` kills the path for good, as it kills
vLLM's output thread (docs/protocol.md §8).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import zmq

from ._errors import log
from ._scheduler import ClientBatch, FinishReason, OutputRecord
from ._startup import OUTPUT_LINGER_MS

if TYPE_CHECKING:
    from ._scheduler import StepResult
    from ._startup import Sockets
    from ._wire import Wire

__all__ = ["GARBAGE_FRAME", "OutputPath"]

GARBAGE_FRAME = b"\xc1not-msgpack: injected garbage frame"


class OutputPath:
    """Sends one engine rank's outputs to its clients and the DP coordinator."""

    def __init__(self, wire: Wire, rank: int, sockets: Sockets, delay_ms: float) -> None:
        self.wire = wire
        self.rank = rank
        self.sockets = sockets
        self.delay_ms = delay_ms
        self.dead = False  # vLLM's output thread died: nothing is sent again
        self.delayed: deque[tuple[float, zmq.Socket[bytes], list[Any]]] = deque()
        self.blocked: deque[tuple[zmq.Socket[bytes], list[Any]]] = deque()

    # ---- frames ----

    def send_frames(self, sock: zmq.Socket[bytes], frames: list[Any]) -> None:
        if self.delay_ms > 0 or self.delayed:
            self.delayed.append((time.monotonic() + self.delay_ms / 1000, sock, frames))
            return
        self._send_now(sock, frames)

    def _send_now(self, sock: zmq.Socket[bytes], frames: list[Any]) -> None:
        # Output sockets have no HWM (as in vLLM) except in firehose mode; there a full
        # socket parks the message (order kept) and the loop waits for POLLOUT.
        if not self.blocked:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass
        self.blocked.append((sock, frames))

    def flush_blocked(self) -> bool:
        """Send parked messages while the sockets take them; True when none are left."""
        while self.blocked:
            sock, frames = self.blocked[0]
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            self.blocked.popleft()
        return True

    def flush_delayed(self) -> None:
        now = time.monotonic()
        while self.delayed and self.delayed[0][0] <= now:
            _, sock, frames = self.delayed.popleft()
            self._send_now(sock, frames)

    def next_due(self) -> float | None:
        """When the first delayed message is due (monotonic clock), if any."""
        return self.delayed[0][0] if self.delayed else None

    def waiting_socket(self) -> zmq.Socket[bytes] | None:
        """The full socket the first parked message waits on, if any."""
        return self.blocked[0][0] if self.blocked else None

    def flush_before_exit(self) -> None:
        """Last sends before a clean exit: delayed outputs, then parked ones (bounded)."""
        while self.delayed:
            wait = self.delayed[0][0] - time.monotonic()
            if wait > 0:
                time.sleep(min(wait, 0.5))
            self.flush_delayed()
        deadline = time.monotonic() + 0.1
        while not self.flush_blocked() and time.monotonic() < deadline:
            time.sleep(0.005)

    def die(self) -> None:
        """vLLM's fatal path: ENGINE_CORE_DEAD on every output socket, then linger."""
        outputs = self.sockets.outputs
        if not self.dead:
            # Outputs queued before the failure go first, as from vLLM's output queue.
            while self.delayed:
                _, sock, frames = self.delayed.popleft()
                self.blocked.append((sock, frames))
            with contextlib.suppress(zmq.ZMQError):
                self.flush_blocked()
            for sock in outputs:
                with contextlib.suppress(zmq.ZMQError):
                    sock.send(self.wire.dead_frame(), flags=zmq.NOBLOCK)
        for sock in outputs:
            sock.close(linger=OUTPUT_LINGER_MS)

    def send_garbage(self) -> None:
        for sock in self.sockets.outputs:
            self.send_frames(sock, [GARBAGE_FRAME])

    # ---- messages ----

    def send(self, client_index: int, outputs: Any) -> None:
        """Send one EngineCoreOutputs to ``outputs[client_index]`` (-1: the coordinator)."""
        if self.dead:
            return
        sockets = self.sockets
        if client_index == -1 and sockets.coord_out is not None:
            sock = sockets.coord_out
        elif 0 <= client_index < len(sockets.outputs):
            sock = sockets.outputs[client_index]
        else:
            # vLLM's output thread raises IndexError here and dies: nothing more is sent.
            self.dead = True
            log(f"output thread died: no output socket for client_index {client_index}")
            return
        self.send_frames(sock, self.wire.encode_outputs(outputs))

    def send_to_client(self, client_index: int, message: Any) -> None:
        """`send` for a client (the firehose's fast path: no lookup when the index is good)."""
        if self.dead or not 0 <= client_index < len(self.sockets.outputs):
            self.send(client_index, message)
            return
        self.send_frames(self.sockets.outputs[client_index], self.wire.encode_outputs(message))

    def _client_outputs(self, batch: ClientBatch, **extra: Any) -> Any:
        return self.wire.outputs(
            engine_index=self.rank,
            outputs=[self.wire.output(r) for r in batch.outputs],
            finished_requests=batch.finished_requests,
            **extra,
        )

    def send_engine_finished(self, per_client: dict[int, ClientBatch]) -> None:
        """Engine-initiated finishes (abort on pause/shutdown): outputs + finished ids."""
        for client_index, batch in per_client.items():
            self.send(client_index, self._client_outputs(batch))

    def send_step(self, result: StepResult, weight_version: str) -> None:
        """One model step's outputs, per client; the step's stats ride on the first."""
        stats = None if result.stats is None else self.wire.stats(result.stats)
        for client_index, batch in result.per_client.items():
            extra: dict[str, Any] = {"weight_version": weight_version}
            if stats is not None:
                # vLLM attaches the step's stats to the first client's message only.
                extra["scheduler_stats"], stats = stats, None
            self.send(client_index, self._client_outputs(batch, **extra))
        if stats is not None:
            self.send(
                0,
                self.wire.outputs(
                    engine_index=self.rank, scheduler_stats=stats, weight_version=weight_version
                ),
            )

    def reply(self, client_index: int, call_id: int, failure: str | None, value: Any) -> None:
        """A utility's result (``failure`` None) or its failure text."""
        self.send(
            client_index,
            self.wire.outputs(
                engine_index=self.rank,
                utility_output=self.wire.utility_output(call_id, failure, value),
            ),
        )

    def send_request_error(
        self,
        req: Any,
        message: str,
        code: str = "validation_error",
        retryable: bool = False,
        reason: FinishReason = FinishReason.ERROR,
    ) -> None:
        """Finish ``req`` at once: ERROR with ``message`` (logged), or ``reason``."""
        record = OutputRecord(
            req.request_id,
            [],
            finish_reason=int(reason),
            trace_headers=req.trace_headers,
            error=(code, message, retryable) if reason is FinishReason.ERROR else None,
        )
        if reason is FinishReason.ERROR:
            log(f"request {req.request_id!r} failed: {message}")
        batch = ClientBatch([record], {req.request_id})
        self.send(req.client_index, self._client_outputs(batch))
