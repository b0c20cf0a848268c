"""``--firehose N``: generation requests skip the model and get one echo token per
message, N messages per step, as fast as the output sockets take them (benchmarks)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ._scheduler import ClientBatch, FinishReason, OutputRecord

if TYPE_CHECKING:
    from ._outputs import OutputPath
    from ._scheduler import EngineRequest, Scheduler
    from ._wire import Wire

__all__ = ["Firehose"]


class Firehose:
    """The firehose's requests (arrival order) and its round-robin cursor."""

    def __init__(self, messages_per_step: int, *, log_stats: bool) -> None:
        self.messages_per_step = messages_per_step
        self.requests: dict[str, EngineRequest] = {}
        self._log_stats = log_stats
        self._cursor = 0

    def add(self, req: EngineRequest) -> None:
        req.firehose = True
        if self._log_stats:
            now = time.monotonic()
            req.events = [(1, now), (2, now)]
        self.requests[req.request_id] = req

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    def finish_all(self) -> dict[int, ClientBatch]:
        """Finish every request as ABORT; the batches to send, per client."""
        by_client: dict[int, ClientBatch] = {}
        for req in self.requests.values():
            batch = by_client.setdefault(req.client_index, ClientBatch(finished_requests=set()))
            batch.outputs.append(OutputRecord(req.request_id, [], finish_reason=2))
            assert batch.finished_requests is not None
            batch.finished_requests.add(req.request_id)
        self.requests.clear()
        return by_client

    def step(
        self, wire: Wire, rank: int, scheduler: Scheduler, output: OutputPath, weight_version: str
    ) -> None:
        """Send one firehose message per client (a full output socket parks the rest)."""
        live = list(self.requests.values())
        per_client: dict[int, list[Any]] = {}
        finished: dict[int, set[str]] = {}
        for _ in range(self.messages_per_step):
            if not live:
                break
            req = live[self._cursor % len(live)]
            self._cursor += 1
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
                del self.requests[req.request_id]
                live.remove(req)
                if scheduler.config.include_finished_set:
                    finished.setdefault(req.client_index, set()).add(req.request_id)
        scheduler.step_counter += 1
        stats = None
        if self._log_stats:
            values = scheduler.make_stats()
            values["num_running_reqs"] += len(self.requests)
            stats = wire.stats(values)
        for client_index, outs in per_client.items():
            message = wire.outputs(
                engine_index=rank,
                outputs=outs,
                scheduler_stats=stats,
                finished_requests=finished.get(client_index),
                weight_version=weight_version,
            )
            stats = None
            output.send_to_client(client_index, message)
