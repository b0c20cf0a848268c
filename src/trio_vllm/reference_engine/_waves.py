"""Data-parallel coordination of MoE ranks (docs/protocol.md §7.4): DP waves and the
request counts a rank publishes to the coordinator.

Every rank decides alone (no collective): it runs while any rank has work, and a wave
ends when this rank is idle at a sync point. Rank 0 (or a rank without a coordinator)
reports the end. An idle rank that gets work asks the coordinator for a new wave: any
rank where the release's ``ProtocolProfile.any_rank_requests_wave`` says so (0.33),
else rank 0 only; any idle rank asks when a request names a wave that already ended.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import zmq

from ._errors import WireError, log

if TYPE_CHECKING:
    from ._startup import Sockets
    from ._state import EngineState

__all__ = ["DPCoordination"]

_DP_SYNC_INTERVAL = 16


class DPCoordination:
    """One rank's side of the DP coordinator: waves, counts and coordinator input."""

    def __init__(self, engine: EngineState, sockets: Sockets) -> None:
        self._engine = engine
        self._sockets = sockets
        self.engines_running = False
        self._start_wave_sent: int | None = None
        self._wave_steps = 0
        self._last_counts: tuple[int, int] | None = None

    def _send(self, client_index: int, **fields: Any) -> None:
        engine = self._engine
        engine.output.send(client_index, engine.wire.outputs(engine_index=engine.rank, **fields))

    def on_add(self, req: Any) -> None:
        """A new request (``--moe``): follow its wave, or ask for one if it is over."""
        scheduler = self._engine.scheduler
        if self._sockets.coord_out is None or req.current_wave == scheduler.current_wave:
            return
        if req.current_wave > scheduler.current_wave:
            scheduler.current_wave = req.current_wave
        elif not self.engines_running:
            # A request for a wave that already ended: ask the coordinator for a new one.
            self.request_wave()

    def request_wave(self) -> None:
        """Send ``start_wave = current_wave`` to the coordinator, once per wave."""
        wave = self._engine.scheduler.current_wave
        if self._sockets.coord_out is None or self._start_wave_sent == wave:
            return
        self._start_wave_sent = wave
        self._send(-1, start_wave=wave)

    def on_work(self) -> None:
        """Before a step (``--moe``): an idle rank with work starts running."""
        engine = self._engine
        if self.engines_running or not engine.has_work():
            return
        self.engines_running = True
        self._wave_steps = 0
        # 0.32: rank 0 reports idle -> running; 0.33: any idle rank that got work.
        if engine.rank == 0 or engine.profile.any_rank_requests_wave:
            self.request_wave()

    def handle_start_wave(self, wave: int, exclude: int | None) -> None:
        engine = self._engine
        if not engine.options.moe:
            log("Unrecognized input request type: START_DP_WAVE")
            return
        if exclude != engine.rank and wave >= engine.scheduler.current_wave:
            engine.scheduler.current_wave = wave
            if not self.engines_running:
                self.engines_running = True
                self._wave_steps = 0

    def after_step(self) -> None:
        """After a step of a running rank: at a sync point, end the wave if idle."""
        self._wave_steps += 1
        if self._wave_steps != 1 and self._wave_steps % _DP_SYNC_INTERVAL != 0:
            return
        engine = self._engine
        if engine.has_work():
            return
        self.engines_running = False
        if engine.rank == 0 or self._sockets.coord_out is None:
            target = -1 if self._sockets.coord_out is not None else 0
            self._send(target, wave_complete=engine.scheduler.current_wave)
        engine.scheduler.current_wave += 1
        self._wave_steps = 0

    def publish_counts(self) -> None:
        """Send running/waiting counts to the coordinator when they changed."""
        if self._sockets.coord_out is None:
            return
        scheduler = self._engine.scheduler
        counts = (len(scheduler.running), len(scheduler.waiting))
        if counts == self._last_counts:
            return
        self._last_counts = counts
        self._send(
            -1,
            scheduler_stats=self._engine.wire.stats(
                {
                    "num_running_reqs": counts[0],
                    "num_waiting_reqs": counts[1],
                    "step_counter": scheduler.step_counter,
                    "current_wave": scheduler.current_wave,
                }
            ),
        )

    def drain_input(self) -> None:
        """Handle what the coordinator published (``start_dp_wave``; READY is ignored)."""
        coord_in = self._sockets.coord_in
        assert coord_in is not None
        while True:
            try:
                frames = coord_in.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if frames == [b"READY"]:
                continue
            try:
                kind, payload = self._engine.wire.decode_input([memoryview(f) for f in frames])
            except WireError as exc:
                log(f"ignoring undecodable coordinator message: {exc}")
                continue
            if kind == "start_dp_wave":
                self.handle_start_wave(*payload)
