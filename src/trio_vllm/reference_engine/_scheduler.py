"""Continuous batching as vLLM's v1 scheduler does it, in miniature.

A step schedules running requests first (one decode token each, or the next chunk of a
prefill), then admits waiting requests in FCFS order while there is room
(``max_num_seqs``), token budget (``max_num_batched_tokens``) and KV blocks. A request
whose blocks cannot be grown preempts the most recently admitted running request (it
goes back to the front of the waiting queue and recomputes; a PREEMPTED event is
recorded). Only requests that finish their prefill or decode in a step produce an
output in it, grouped by ``client_index``; requests still prefilling produce nothing
(vLLM's "no partial prefill outputs").

The scheduler is plain data and functions: no sockets, no clock other than
``time.monotonic`` for event timestamps. The engine loop (``_server.py``) owns it.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..protocol.structs import EngineCoreEventType as EventType
from ..protocol.structs import FinishReason
from ._sampler import Sampled, SamplingState, prompt_logprobs, sample_rows

if TYPE_CHECKING:
    import numpy.typing as npt

    from ._model import Model, Sequence

__all__ = [
    "EngineRequest",
    "FinishReason",
    "OutputRecord",
    "PauseState",
    "Scheduler",
    "SchedulerConfig",
    "StepResult",
]


class PauseState(enum.Enum):
    UNPAUSED = "unpaused"
    PAUSED_NEW = "paused_new"  # running requests continue, waiting ones are not admitted
    PAUSED_ALL = "paused_all"  # nothing is scheduled


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    log_stats: bool = True
    include_finished_set: bool = False
    enable_prefix_caching: bool = True


@dataclass(frozen=True, slots=True)
class PoolingSpec:
    task: str
    use_activation: bool | None = None
    dimensions: int | None = None


@dataclass(eq=False)
class EngineRequest:
    """A live request inside the engine."""

    request_id: str
    client_index: int
    seq: Sequence
    sampling: SamplingState | None = None
    pooling: PoolingSpec | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    eos_token_id: int | None = None
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    prompt_logprobs: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    trace_headers: dict[str, str] | None = None
    skip_reading_prefix_cache: bool = False
    arrival_time: float = 0.0
    firehose: bool = False
    # Mutable state.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    events: list[tuple[int, float]] = field(default_factory=list)
    prefill_stats: dict[str, int] | None = None
    first_output_sent: bool = False
    is_running: bool = False
    num_blocks: int = 0
    stop_reason: int | None = None
    finished: FinishReason | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.seq.token_ids)


@dataclass(eq=False, slots=True)
class OutputRecord:
    """One EngineCoreOutput, before it is turned into the protocol struct."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: int | None = None
    stop_reason: int | str | None = None
    logprobs: tuple[Any, Any, Any] | None = None  # (ids [n,k+1] i4, vals f4, ranks i8)
    prompt_logprobs: tuple[Any, Any, Any] | None = None
    pooling_output: npt.NDArray[np.float32] | None = None
    events: list[tuple[int, float]] | None = None
    prefill_stats: dict[str, int] | None = None
    trace_headers: dict[str, str] | None = None
    error: tuple[str, str, bool] | None = None  # 0.33 RequestError (code, message, retryable)


@dataclass(eq=False)
class ClientBatch:
    outputs: list[OutputRecord] = field(default_factory=list)
    finished_requests: set[str] | None = None


@dataclass(eq=False)
class StepResult:
    """Per-client outputs of one step (insertion order = vLLM's) and the step's stats."""

    per_client: dict[int, ClientBatch]
    stats: dict[str, Any] | None
    num_scheduled_tokens: int = 0


def _events(req: EngineRequest) -> list[tuple[int, float]] | None:
    if not req.events:
        return None
    events, req.events = req.events, []
    return events


class Scheduler:
    """Waiting/running queues, KV-block accounting, prefix cache and the step function."""

    def __init__(
        self,
        model: Model,
        config: SchedulerConfig,
        *,
        seed: int,
        classifier_labels: int = 2,
    ) -> None:
        self.model = model
        self.config = config
        self.requests: dict[str, EngineRequest] = {}
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.used_blocks = 0
        self.pause_state = PauseState.UNPAUSED
        self.step_counter = 0
        self.current_wave = 0
        self.rng = np.random.default_rng(seed)
        self._classifier = (
            np.random.default_rng(seed + 1)
            .standard_normal((model.hidden_size, classifier_labels))
            .astype(np.float32)
        )
        self._prefix_cache: OrderedDict[bytes, None] = OrderedDict()
        self._prefix_reset = False
        self._prefix_requests = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._finished_sets: dict[int, set[str]] = {}

    # ---- queries -------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_schedulable(self) -> bool:
        """Whether a step would schedule anything now."""
        if self.pause_state is PauseState.PAUSED_ALL:
            return False
        if self.running:
            return True
        return self.pause_state is PauseState.UNPAUSED and bool(self.waiting)

    def kv_cache_usage(self) -> float:
        blocks = self.config.num_gpu_blocks
        return self.used_blocks / blocks if blocks else 0.0

    def lora_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        waiting: dict[str, int] = {}
        running: dict[str, int] = {}
        for req in self.waiting:
            if req.lora_name is not None:
                waiting[req.lora_name] = waiting.get(req.lora_name, 0) + 1
        for req in self.running:
            if req.lora_name is not None:
                running[req.lora_name] = running.get(req.lora_name, 0) + 1
        return waiting, running

    # ---- request lifecycle -------------------------------------------------------

    def add(self, req: EngineRequest) -> None:
        """Queue a validated request; the caller has checked the id is not live."""
        assert req.request_id not in self.requests, "duplicate request id"
        self.requests[req.request_id] = req
        if self.config.log_stats:
            req.events.append((EventType.QUEUED, time.monotonic()))
        self.waiting.append(req)

    def _free(self, req: EngineRequest) -> None:
        self.requests.pop(req.request_id, None)
        if req.is_running:
            self.running.remove(req)
            req.is_running = False
            self.used_blocks -= req.num_blocks
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        req.num_blocks = 0
        if self.config.include_finished_set:
            self._finished_sets.setdefault(req.client_index, set()).add(req.request_id)

    def abort(self, request_ids: list[str]) -> list[str]:
        """Client-initiated abort: free the requests, produce no outputs (vLLM §3.4)."""
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                req.finished = FinishReason.ABORT
                self._free(req)
                aborted.append(rid)
        return aborted

    def finish_all(self, reason: FinishReason) -> dict[int, ClientBatch]:
        """Engine-initiated finish of every request (pause abort, shutdown)."""
        per_client: dict[int, ClientBatch] = {}
        for req in list(self.requests.values()):
            req.finished = reason
            self._free(req)
            batch = per_client.setdefault(req.client_index, ClientBatch(finished_requests=set()))
            batch.outputs.append(
                OutputRecord(
                    req.request_id,
                    [],
                    finish_reason=int(reason),
                    events=_events(req),
                    trace_headers=req.trace_headers,
                )
            )
            assert batch.finished_requests is not None
            batch.finished_requests.add(req.request_id)
        return per_client

    def take_finished_sets(self) -> dict[int, set[str]]:
        sets, self._finished_sets = self._finished_sets, {}
        return sets

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        if self.running and not reset_running_requests:
            return False
        self._prefix_cache.clear()
        self._prefix_reset = True
        return True

    # ---- prefix cache ------------------------------------------------------------

    def _block_hashes(self, req: EngineRequest) -> list[bytes]:
        bs = self.config.block_size
        tokens = req.seq.token_ids[: req.num_prompt_tokens]
        parent = hashlib.sha256(f"{req.cache_salt}|{req.lora_name}".encode()).digest()
        hashes = []
        for start in range(0, len(tokens) - bs + 1, bs):
            block = np.asarray(tokens[start : start + bs], dtype=np.int64).tobytes()
            parent = hashlib.sha256(parent + block).digest()
            hashes.append(parent)
        return hashes

    def _lookup_prefix(self, req: EngineRequest) -> int:
        if not self.config.enable_prefix_caching or req.seq.prompt_embeds is not None:
            return 0
        if self.config.log_stats:
            self._prefix_requests += 1
            self._prefix_queries += req.num_prompt_tokens
        if req.skip_reading_prefix_cache:
            return 0
        hits = 0
        for h in self._block_hashes(req):
            if h not in self._prefix_cache:
                break
            self._prefix_cache.move_to_end(h)
            hits += 1
        cached = hits * self.config.block_size
        # At least one token must be computed to produce logits (vLLM: num_tokens - 1).
        limit = (req.num_prompt_tokens - 1) // self.config.block_size * self.config.block_size
        cached = min(cached, limit)
        if self.config.log_stats:
            self._prefix_hits += cached
        return cached

    def _register_prefix(self, req: EngineRequest) -> None:
        if not self.config.enable_prefix_caching or req.seq.prompt_embeds is not None:
            return
        for h in self._block_hashes(req):
            self._prefix_cache[h] = None
            self._prefix_cache.move_to_end(h)
        while len(self._prefix_cache) > self.config.num_gpu_blocks:
            self._prefix_cache.popitem(last=False)

    # ---- scheduling --------------------------------------------------------------

    def _free_blocks(self) -> int:
        return self.config.num_gpu_blocks - self.used_blocks

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _preempt(self, victim: EngineRequest) -> None:
        self.running.remove(victim)
        victim.is_running = False
        self.used_blocks -= victim.num_blocks
        victim.num_blocks = 0
        victim.num_computed_tokens = 0
        if self.config.log_stats:
            victim.events.append((EventType.PREEMPTED, time.monotonic()))
        self.waiting.appendleft(victim)

    def _schedule(self) -> list[tuple[EngineRequest, int]]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[EngineRequest, int]] = []
        if self.pause_state is PauseState.PAUSED_ALL:
            return scheduled
        now = time.monotonic()
        for req in list(self.running):
            if budget <= 0:
                break
            if not req.is_running:  # preempted below by an earlier request
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            need = self._blocks_for(req.num_computed_tokens + n) - req.num_blocks
            preempted_itself = False
            while need > self._free_blocks():
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    preempted_itself = True
                    break
            if preempted_itself:
                continue
            req.num_blocks += max(need, 0)
            self.used_blocks += max(need, 0)
            scheduled.append((req, n))
            budget -= n
        while (
            self.pause_state is PauseState.UNPAUSED
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            if req.num_computed_tokens == 0 and not req.output_token_ids:
                cached = self._lookup_prefix(req)
                req.num_cached_tokens = cached
                req.num_computed_tokens = cached
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            need = self._blocks_for(req.num_computed_tokens + n)
            if need > self._free_blocks():
                break
            self.waiting.popleft()
            req.num_blocks = need
            self.used_blocks += need
            self.running.append(req)
            req.is_running = True
            if self.config.log_stats:
                req.events.append((EventType.SCHEDULED, now))
            scheduled.append((req, n))
            budget -= n
        return scheduled

    def _check_stop(self, req: EngineRequest) -> bool:
        """vLLM's ``check_stop``: min_tokens, EOS, stop ids, then length."""
        if len(req.output_token_ids) < req.min_tokens:
            return False
        last = req.output_token_ids[-1]
        if not req.ignore_eos and req.eos_token_id is not None and last == req.eos_token_id:
            req.finished = FinishReason.STOP
            return True
        if last in req.stop_token_ids:
            req.finished = FinishReason.STOP
            req.stop_reason = last
            return True
        if (
            req.num_tokens >= self.config.max_model_len
            or len(req.output_token_ids) >= req.max_tokens
        ):
            req.finished = FinishReason.LENGTH
            return True
        return False

    def _pool(self, req: EngineRequest) -> npt.NDArray[np.float32]:
        assert req.pooling is not None
        hidden = self.model.hidden_states(req.seq)
        task = req.pooling.task
        activate = req.pooling.use_activation is not False
        if task in ("embed", "token_embed"):
            out = hidden[-1] if task == "embed" else hidden
            if req.pooling.dimensions is not None:
                out = out[..., : req.pooling.dimensions]
            if activate:
                norm = np.linalg.norm(out, axis=-1, keepdims=True)
                out = out / np.maximum(norm, 1e-12)
            return np.ascontiguousarray(out, dtype=np.float32)
        logits = (hidden[-1] if task == "classify" else hidden) @ self._classifier
        if activate:
            e = np.exp(logits - logits.max(axis=-1, keepdims=True))
            logits = e / e.sum(axis=-1, keepdims=True)
        return np.ascontiguousarray(logits, dtype=np.float32)

    def _first_output_extras(self, req: EngineRequest, record: OutputRecord) -> None:
        if req.first_output_sent:
            return
        req.first_output_sent = True
        if self.config.log_stats:
            record.prefill_stats = {
                "num_prompt_tokens": req.num_prompt_tokens,
                "num_computed_tokens": req.num_prompt_tokens,
                "num_cached_tokens": req.num_cached_tokens,
                "num_local_cached_tokens": req.num_cached_tokens,
                "num_external_cached_tokens": 0,
                "num_cache_creation_tokens": req.num_prompt_tokens - req.num_cached_tokens,
            }
        if req.prompt_logprobs is not None:
            prompt = req.seq.echo_prompt()
            logits = self.model.prompt_logits(req.seq)
            record.prompt_logprobs = prompt_logprobs(logits, prompt, req.prompt_logprobs)

    def step(self) -> StepResult:
        """Schedule, run the model once, sample, and build this step's outputs."""
        scheduled = self._schedule()
        self.step_counter += 1
        per_client: dict[int, ClientBatch] = {}
        gen_rows: list[EngineRequest] = []
        total_tokens = 0
        for req, n in scheduled:
            req.num_computed_tokens += n
            total_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue  # still prefilling: no output this step
            if req.num_computed_tokens == req.num_prompt_tokens == req.num_tokens:
                self._register_prefix(req)
            if req.pooling is not None:
                record = OutputRecord(
                    req.request_id,
                    [],
                    finish_reason=int(FinishReason.STOP),
                    pooling_output=self._pool(req),
                    trace_headers=req.trace_headers,
                )
                self._first_output_extras(req, record)
                record.events = _events(req)
                req.finished = FinishReason.STOP
                self._free(req)
                per_client.setdefault(req.client_index, ClientBatch()).outputs.append(record)
            else:
                gen_rows.append(req)
        if gen_rows:
            self._run_generation(gen_rows, per_client)
        if self.config.include_finished_set:
            for client, ids in self.take_finished_sets().items():
                per_client.setdefault(client, ClientBatch()).finished_requests = ids
        stats = self.make_stats() if self.config.log_stats else None
        return StepResult(per_client, stats, total_tokens)

    def _run_generation(
        self, rows: list[EngineRequest], per_client: dict[int, ClientBatch]
    ) -> None:
        states = [r.sampling or SamplingState(temperature=0.0) for r in rows]
        sampled: list[Sampled]
        fast = None
        if all(s.is_plain for s in states):
            fast = self.model.greedy_next_tokens([r.seq for r in rows])
        if fast is not None:
            self._emit_plain(rows, fast, per_client)
            return
        logits = self.model.next_token_logits([r.seq for r in rows])
        sampled = sample_rows(
            logits,
            states,
            [r.seq.token_ids[: r.num_prompt_tokens] for r in rows],
            [r.output_token_ids for r in rows],
            self.rng,
        )
        for req, s in zip(rows, sampled, strict=True):
            req.output_token_ids.append(s.token_id)
            req.seq.token_ids.append(s.token_id)
            stopped = self._check_stop(req)
            record = OutputRecord(
                req.request_id,
                [s.token_id],
                finish_reason=int(req.finished) if stopped and req.finished is not None else None,
                stop_reason=req.stop_reason if stopped else None,
                trace_headers=req.trace_headers,
            )
            if s.logprob_token_ids is not None and s.logprobs is not None:
                record.logprobs = (
                    s.logprob_token_ids[None, :],
                    s.logprobs[None, :],
                    np.asarray([s.rank], dtype=np.int64),
                )
            self._first_output_extras(req, record)
            record.events = _events(req)
            if stopped:
                self._free(req)
            per_client.setdefault(req.client_index, ClientBatch()).outputs.append(record)

    def _emit_plain(
        self, rows: list[EngineRequest], tokens: list[int], per_client: dict[int, ClientBatch]
    ) -> None:
        """The hot path: one greedy token per row, no logprobs (same result as above)."""
        for req, token in zip(rows, tokens, strict=True):
            req.output_token_ids.append(token)
            req.seq.token_ids.append(token)
            stopped = self._check_stop(req)
            record = OutputRecord(
                req.request_id, [token], None, None, None, None, None, None, None, req.trace_headers
            )
            if stopped:
                record.finish_reason = int(req.finished) if req.finished is not None else None
                record.stop_reason = req.stop_reason
            if not req.first_output_sent:
                self._first_output_extras(req, record)
            if req.events:
                record.events, req.events = req.events, []
            if stopped:
                self._free(req)
            batch = per_client.get(req.client_index)
            if batch is None:
                batch = per_client[req.client_index] = ClientBatch()
            batch.outputs.append(record)

    def make_stats(self) -> dict[str, Any]:
        """The values of one SchedulerStats; per-step deltas for the prefix-cache counters."""
        waiting_loras, running_loras = self.lora_counts()
        stats = {
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "step_counter": self.step_counter,
            "current_wave": self.current_wave,
            "kv_cache_usage": self.kv_cache_usage(),
            "prefix_cache_stats": {
                "reset": self._prefix_reset,
                "requests": self._prefix_requests,
                "queries": self._prefix_queries,
                "hits": self._prefix_hits,
            },
            "waiting_lora_adapters": waiting_loras,
            "running_lora_adapters": running_loras,
        }
        self._prefix_reset = False
        self._prefix_requests = self._prefix_queries = self._prefix_hits = 0
        return stats
