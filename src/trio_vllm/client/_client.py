"""The structured-concurrency engine-core client: :func:`open_client` and its client.

One task group, owned by the :func:`open_client` context manager, holds every task
the client runs: the handshake server (during startup; afterwards a guard on the input
socket, where engines must not send again), one receive task per output socket, and
one watcher per spawned engine process. Nothing else runs in the
background and nothing outlives the ``async with`` block.

Tasks never raise into the group for engine trouble: an engine exit, an
``ENGINE_CORE_DEAD`` frame, an undecodable frame or a broken socket moves the client to
the *dead* state, which wakes every waiter at once with
:class:`~trio_vllm.EngineDeadError` (the cause chained) and makes every later call
raise it too. The body of the ``async with`` is never cancelled by the client.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, final

import anyio
import anyio.abc
import anyio.lowlevel
import zmq
from zmq.utils.monitor import parse_monitor_message

from .._exceptions import (
    EngineDeadError,
    EngineStartupError,
    ProtocolError,
    TrioVllmError,
    UnroutableError,
    UtilityCallError,
)
from ..protocol.handshake import (
    ClientHandshake,
    HandshakeComplete,
    HandshakeEvent,
    SendInitMetadata,
    identity_for_rank,
    rank_for_identity,
)
from ..transport import AsyncSocket, PrivateIpcDir, tcp_endpoint
from ._streams import RequestStream
from ._wire import Wire

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence

    from ..protocol.profiles import ProtocolProfile
    from ._engines import EngineSource
    from ._process import EngineProcess

__all__ = ["EngineCoreClient", "StartupProgress", "open_client"]

DEFAULT_READY_TIMEOUT: Final = 600.0
DEFAULT_SHUTDOWN_GRACE: Final = 5.0
# Reserved engine-initiated call ids (PROTOCOL.md §6.4): never matched to calls.
_RESERVED_CALL_IDS: Final = frozenset({-1, -2})
# After an engine process exit: drain its last outputs until quiet this long, at most
# _EXIT_DRAIN_S, before declaring the death (both well inside the 100 ms promise).
_EXIT_QUIET_S: Final = 0.004
_EXIT_DRAIN_S: Final = 0.03
# Fields whose presence makes an outputs batch worth handing to get_output().
_RAW_INTEREST: Final = ("scheduler_stats", "wave_complete", "start_wave")


@dataclass(frozen=True, slots=True)
class StartupProgress:
    """Where startup stands; passed to ``open_client(on_progress=...)`` on every change."""

    expected: tuple[int, ...]
    connected: tuple[int, ...]
    ready: tuple[int, ...]
    responded: tuple[int, ...]
    elapsed: float
    event: HandshakeEvent | None


@dataclass(slots=True)
class _PendingCall:
    method: str
    rank: int
    event: anyio.Event
    done: bool = False
    failure: str | None = None
    result: Any = None
    dead: bool = False


def _default_ready_timeout() -> float:
    value = os.environ.get("VLLM_ENGINE_READY_TIMEOUT_S")
    if value:
        with contextlib.suppress(ValueError):
            return float(value)
    return DEFAULT_READY_TIMEOUT


@final
class EngineCoreClient:
    """A connection to one or more engine cores; created only by :func:`open_client`.

    Two layers of API:

    * per-request streams: ``async with client.generate(request) as stream`` then
      ``async for output in stream``; leaving the block before the final output
      (break, exception, cancellation) aborts the request on the engine;
    * raw parity with vLLM's ``EngineCoreClient``: :meth:`add_request`,
      :meth:`get_output`, :meth:`abort_requests`, :meth:`call_utility`,
      :meth:`call_utility_all` and the named utilities.

    Every method raises :class:`~trio_vllm.EngineDeadError` once an engine died or
    the client was closed. Cancelling one caller never affects another.
    """

    def __init__(
        self,
        *,
        input_socket: AsyncSocket,
        ranks: Sequence[int],
        ready_responses: Mapping[int, Mapping[str, Any]],
        wire: Wire,
        stream_buffer: int,
    ) -> None:
        self._input = input_socket
        self._ranks = list(ranks)
        self._rank_set = frozenset(ranks)
        self._ready_responses = {r: dict(v) for r, v in ready_responses.items()}
        self._wire = wire
        self._stream_buffer = stream_buffer
        # vLLM uses uuid1().int >> 64; any int but -1/-2 works. Random start, then count.
        self._call_ids = itertools.count(random.getrandbits(62) + 1)
        self._pending_calls: dict[int, _PendingCall] = {}
        self._streams: dict[str, RequestStream] = {}
        self._raw_requests: dict[str, int] = {}
        self._raw_outputs: deque[Any] = deque()
        self._raw_event = anyio.Event()
        self._raw_mode = False
        self._in_flight: dict[int, int] = dict.fromkeys(self._ranks, 0)
        self._dead_message: str | None = None
        self._dead_rank: int | None = None
        self._dead_cause: BaseException | None = None
        self._dead_event = anyio.Event()
        self._closing = False
        self._processes: list[EngineProcess] = []
        self._addresses: dict[str, str] = {}
        self._receive_scope: anyio.CancelScope | None = None
        self._exited: list[EngineProcess] = []

    # ------------------------------------------------------------------ properties

    @property
    def ranks(self) -> list[int]:
        """Data-parallel ranks of the engines behind this client."""
        return list(self._ranks)

    @property
    def ready_responses(self) -> dict[int, dict[str, Any]]:
        """Each engine's EngineCoreReadyResponse (a plain map; keys vary by version)."""
        return {r: dict(v) for r, v in self._ready_responses.items()}

    @property
    def vllm_version(self) -> str | None:
        """The ``vllm_version`` the engines reported (``None`` if they did not say)."""
        return self._wire.vllm_version

    @property
    def protocol_profile(self) -> Any:
        """The protocol profile in use (from the ready response or pinned)."""
        return self._wire.profile

    @property
    def max_model_len(self) -> int | None:
        """The smallest ``max_model_len`` any engine reported, if any did."""
        lens = [v["max_model_len"] for v in self._ready_responses.values() if "max_model_len" in v]
        return min(lens) if lens else None

    @property
    def engine_pids(self) -> dict[int, int]:
        """Rank -> pid of each engine process this client spawned (none for external)."""
        return {rank: p.pid for p in self._processes for rank in p.ranks}

    @property
    def addresses(self) -> dict[str, str]:
        """The endpoints this client bound: ``input``, ``output``, ``handshake``."""
        return dict(self._addresses)

    @property
    def dead(self) -> bool:
        """True once an engine died or the client closed; every call then raises."""
        return self._dead_message is not None

    @property
    def pending_utility_calls(self) -> int:
        """Utility calls awaiting a reply (for diagnostics and tests)."""
        return len(self._pending_calls)

    @property
    def live_requests(self) -> list[str]:
        """Request ids the client considers running (streams and raw requests)."""
        return [*self._streams, *self._raw_requests]

    def dead_error(self) -> EngineDeadError | None:
        """A fresh copy of the error calls raise once dead (``None`` while alive)."""
        return self._dead_error() if self.dead else None

    async def wait_dead(self) -> EngineDeadError:
        """Wait until the client is dead; return the error calls raise from then on."""
        await self._dead_event.wait()
        return self._dead_error()

    # ------------------------------------------------------------------ death

    def _dead_error(self) -> EngineDeadError:
        # A fresh instance per raise: one shared exception would collect tracebacks.
        error = EngineDeadError(self._dead_message or "engine core is dead", rank=self._dead_rank)
        error.__cause__ = self._dead_cause
        return error

    def _check_alive(self) -> None:
        if self._dead_message is not None:
            raise self._dead_error()

    def _set_dead(
        self, message: str, *, rank: int | None = None, cause: BaseException | None = None
    ) -> None:
        """Enter the dead state and wake every waiter (synchronous, idempotent)."""
        if self._dead_message is not None:
            return
        self._dead_message = message
        self._dead_rank = rank
        self._dead_cause = cause
        for call in self._pending_calls.values():
            call.dead = True
            call.event.set()
        for stream in self._streams.values():
            stream._fail(self._dead_error)
        self._raw_event.set()
        self._dead_event.set()

    def _on_process_exit(self, process: EngineProcess) -> None:
        if self._closing or self.dead:
            return
        if self._receive_scope is None:
            self._die_of_exit(process)
            return
        # Outputs the engine sent before exiting may still sit in the output socket:
        # the receive task drains them first (a few ms), then declares the death, so
        # that they reach their streams in order.
        self._exited.append(process)
        self._receive_scope.cancel()

    def _die_of_exit(self, process: EngineProcess) -> None:
        rank = process.ranks[0] if len(process.ranks) == 1 else None
        self._set_dead(f"engine process died: {process.describe_exit()}", rank=rank)

    # ------------------------------------------------------------------ routing

    def _choose_rank(self, rank: int | None) -> int:
        """The one place that picks an engine: the given rank, else least in flight."""
        if rank is not None:
            if rank not in self._rank_set:
                raise ValueError(f"no engine with rank {rank} (ranks: {self._ranks})")
            return rank
        return min(self._ranks, key=lambda r: (self._in_flight[r], r))

    def _request_started(self, rank: int) -> None:
        self._in_flight[rank] += 1

    def _request_ended(self, rank: int) -> None:
        self._in_flight[rank] -= 1

    def _release_stream(self, stream: RequestStream) -> None:
        # Each stream leaves the in-flight count exactly once (finish, abort or exit).
        if stream._in_flight:
            stream._in_flight = False
            self._request_ended(stream.rank)

    # ------------------------------------------------------------------ sending

    async def _send(self, rank: int, frames: Sequence[bytes]) -> None:
        try:
            await self._input.send([identity_for_rank(rank), *frames])
        except UnroutableError as exc:
            self._set_dead(f"engine {rank} is no longer connected", rank=rank, cause=exc)
            raise self._dead_error() from exc
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            self._check_alive()
            raise self._dead_error() from exc

    def _send_nowait_best_effort(self, rank: int, frames: Sequence[bytes]) -> bool:
        """Try to queue a message without a checkpoint; False if it could not go now."""
        if self.dead:
            return True
        try:
            self._input.send_nowait([identity_for_rank(rank), *frames])
        except anyio.WouldBlock:
            return False
        except (UnroutableError, anyio.ClosedResourceError, anyio.BrokenResourceError):
            return True  # nothing to abort on an engine that is gone
        return True

    # ------------------------------------------------------------------ requests

    def _check_new_request(self, request: Any) -> str:
        request_id = self._wire.request_id(request)
        if request_id in self._streams or request_id in self._raw_requests:
            raise ValueError(
                f"request id {request_id!r} is already live on this client; a duplicate "
                "live id would kill the engine (PROTOCOL.md §3.7)"
            )
        self._wire.validate_request(request)
        return request_id

    async def add_request(self, request: Any, *, rank: int | None = None) -> None:
        """Send an EngineCoreRequest; its outputs come from :meth:`get_output`.

        Raises ``ValueError`` before anything is sent if the request is invalid or its
        id is live on this client. Cancellation: if cancelled, nothing was sent and the
        id is free again.
        """
        self._check_alive()
        request_id = self._check_new_request(request)
        target = self._choose_rank(rank)
        frames = self._wire.encode_add(request)
        self._raw_mode = True
        self._raw_requests[request_id] = target
        self._request_started(target)
        try:
            await self._send(target, frames)
        except BaseException:
            if self._raw_requests.pop(request_id, None) is not None:
                self._request_ended(target)
            raise

    async def get_output(self) -> Any:
        """Wait for the next EngineCoreOutputs batch for raw requests (vLLM's get_output).

        Batches carry the outputs of requests sent with :meth:`add_request` (stream
        outputs are routed to their streams), plus scheduler stats and wave events.
        Utility replies never appear here. Batches are queued without bound, as in
        vLLM; consume them. Cancellation: nothing is consumed by a cancelled call.
        Raises :class:`~trio_vllm.EngineDeadError` once dead and the queue is empty.
        """
        self._raw_mode = True
        while True:
            await anyio.lowlevel.checkpoint()
            if self._raw_outputs:
                return self._raw_outputs.popleft()
            self._check_alive()
            if self._raw_event.is_set():
                self._raw_event = anyio.Event()
            await self._raw_event.wait()

    def get_output_nowait(self) -> Any:
        """The next queued batch, or ``anyio.WouldBlock``; not a checkpoint."""
        self._raw_mode = True
        if self._raw_outputs:
            return self._raw_outputs.popleft()
        self._check_alive()
        raise anyio.WouldBlock

    async def abort_requests(self, request_ids: Iterable[str], *, rank: int | None = None) -> None:
        """Abort requests by id (vLLM's abort_requests).

        Known ids are finished locally at once (a stream stops iterating with
        ``aborted`` set) and the ABORT goes to the engine serving each; unknown ids are
        sent to ``rank`` or to every engine (aborting is idempotent). The engine sends
        no output for a client-initiated abort.

        Cancellation: the one checkpoint comes first; once past it the requests are
        forgotten locally and every ABORT is queued without another checkpoint, so a
        cancelled call changed nothing and a completed one reached every owner.
        """
        self._check_alive()
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            if not isinstance(request_id, str):
                raise TypeError(f"request ids are strings, got {request_id!r}")
        await anyio.lowlevel.checkpoint()
        self._check_alive()
        by_rank: dict[int, list[str]] = {}
        for request_id in ids:
            owner = self._raw_requests.pop(request_id, None)
            if owner is not None:
                self._request_ended(owner)
            stream = self._streams.get(request_id)
            if stream is not None and not stream.finished:
                owner = stream.rank
                stream._abort_locally()
                self._release_stream(stream)
            if owner is not None:
                by_rank.setdefault(owner, []).append(request_id)
            else:
                for target in [rank] if rank is not None else self._ranks:
                    by_rank.setdefault(self._choose_rank(target), []).append(request_id)
        for target, rank_ids in by_rank.items():
            await self._send_abort(target, rank_ids)

    @contextlib.asynccontextmanager
    async def generate(
        self, request: Any, *, rank: int | None = None, max_pending: int | None = None
    ) -> AsyncIterator[RequestStream]:
        """Send ``request`` and yield a :class:`RequestStream` of its outputs.

        Leaving the block before the final output (``break``, an exception,
        cancellation) sends ABORT for the request, without a checkpoint, so it also
        works in cancelled code. ``max_pending`` bounds the stream's buffer (see
        :mod:`trio_vllm.client._streams` on coalescing). Raises ``ValueError`` before
        anything is sent for an invalid request or a live duplicate id.
        """
        self._check_alive()
        request_id = self._check_new_request(request)
        target = self._choose_rank(rank)
        frames = self._wire.encode_add(request)
        stream = RequestStream(request_id, target, max_pending=max_pending or self._stream_buffer)
        self._streams[request_id] = stream
        self._request_started(target)
        stream._in_flight = True
        sent = False
        try:
            await self._send(target, frames)
            sent = True
            yield stream
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            self._release_stream(stream)
            if sent and not stream.finished:
                stream.aborted = True
                await self._send_abort(target, [request_id])

    async def _send_abort(self, rank: int, request_ids: list[str]) -> None:
        """Queue an ABORT without a checkpoint when possible (safe in cancelled code)."""
        frames = self._wire.encode_abort(request_ids)
        if self._send_nowait_best_effort(rank, frames):
            return
        # The peer's queue is full (only with a finite HWM): wait briefly, shielded.
        with (
            anyio.CancelScope(shield=True),
            anyio.move_on_after(1.0),
            contextlib.suppress(TrioVllmError, anyio.ClosedResourceError),
        ):
            await self._send(rank, frames)

    # ------------------------------------------------------------------ utilities

    async def call_utility(self, method: str, *args: Any, rank: int | None = None) -> Any:
        """Call ``method(*args)`` on one engine (``rank``, else the least busy) and return
        its result.

        Raises :class:`~trio_vllm.UtilityCallError` with the engine's message if the
        method failed there, :class:`~trio_vllm.EngineDeadError` if the engine dies
        first. Cancellation: the pending entry is removed; a reply that arrives later
        is dropped quietly.
        """
        self._check_alive()
        if not method:
            raise ValueError(f"method must be a non-empty string, got {method!r}")
        target = self._choose_rank(rank)
        call_id = next(self._call_ids)
        frames = self._wire.encode_utility(0, call_id, method, list(args))
        call = _PendingCall(method, target, anyio.Event())
        self._pending_calls[call_id] = call
        try:
            await self._send(target, frames)
            await call.event.wait()
        finally:
            self._pending_calls.pop(call_id, None)
        if call.dead:
            raise self._dead_error()
        if call.failure is not None:
            raise UtilityCallError(method, call.failure, rank=target)
        return call.result

    async def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        """Call ``method(*args)`` on every engine concurrently; results in rank order.

        If any call fails, the first failure by rank is raised (an
        :class:`~trio_vllm.EngineDeadError` takes precedence) after all calls ended.
        """
        self._check_alive()
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}

        async def one(rank: int) -> None:
            try:
                results[rank] = await self.call_utility(method, *args, rank=rank)
            except (TrioVllmError, ValueError, TypeError) as exc:
                # Caller errors (unencodable arguments) too, so they surface as the
                # same plain exception call_utility raises, not as an exception group.
                errors[rank] = exc

        async with anyio.create_task_group() as tg:
            for rank in self._ranks:
                tg.start_soon(one, rank)
        if errors:
            dead = [e for e in errors.values() if isinstance(e, EngineDeadError)]
            raise dead[0] if dead else errors[min(errors)]
        return [results[r] for r in self._ranks]

    async def _call_all_equal(self, method: str, *args: Any) -> Any:
        results = await self.call_utility_all(method, *args)
        if any(r != results[0] for r in results[1:]):
            raise ProtocolError(f"engines disagree on {method}: {results}")
        return results[0]

    # Named utilities (PROTOCOL.md §6.3), with vLLM's fan-out rules.

    async def get_supported_tasks(self) -> tuple[str, ...]:
        """Tasks the model supports, e.g. ``("generate",)``."""
        return tuple(await self.call_utility("get_supported_tasks"))

    async def is_sleeping(self) -> bool:
        """Whether the engines sleep (all engines must agree)."""
        return bool(await self._call_all_equal("is_sleeping"))

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Put every engine to sleep (level 0 pauses, 1 offloads weights, 2 drops all)."""
        await self.call_utility_all("sleep", level, mode)

    async def wake_up(self, tags: Sequence[str] | None = None) -> bool:
        """Wake every engine (``tags`` among weights/kv_cache/scheduling; None = all)."""
        results = await self.call_utility_all("wake_up", None if tags is None else list(tags))
        return all(r is None or bool(r) for r in results)

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Reset the prefix cache of every engine; True if all succeeded."""
        results = await self.call_utility_all(
            "reset_prefix_cache", reset_running_requests, reset_connector
        )
        return all(bool(r) for r in results)

    async def reset_mm_cache(self) -> None:
        """Reset the multimodal cache of every engine."""
        await self.call_utility_all("reset_mm_cache")

    async def reset_encoder_cache(self) -> None:
        """Reset the encoder cache of every engine."""
        await self.call_utility_all("reset_encoder_cache")

    async def profile(
        self,
        is_start: bool = True,
        profile_prefix: str | None = None,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
    ) -> None:
        """Start or stop the torch profiler on every engine."""
        if self.vllm_version is not None and self.vllm_version.startswith("0.25."):
            await self.call_utility_all("profile", is_start, profile_prefix)
        else:
            await self.call_utility_all(
                "profile", is_start, profile_prefix, delay_iterations, max_iterations
            )

    async def add_lora(self, lora_request: Any) -> bool:
        """Load a LoRA adapter on every engine (``lora_request``: a LoRARequest struct)."""
        return all(bool(r) for r in await self.call_utility_all("add_lora", lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        """Unload a LoRA adapter from every engine."""
        return all(bool(r) for r in await self.call_utility_all("remove_lora", lora_id))

    async def list_loras(self) -> set[int]:
        """The LoRA ids loaded (union over engines)."""
        loaded: set[int] = set()
        for result in await self.call_utility_all("list_loras"):
            loaded.update(result)
        return loaded

    async def pin_lora(self, lora_id: int) -> bool:
        """Pin a LoRA adapter on every engine."""
        return all(bool(r) for r in await self.call_utility_all("pin_lora", lora_id))

    async def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause scheduling on every engine; returns once the pause completed."""
        await self.call_utility_all("pause_scheduler", mode, clear_cache)

    async def resume_scheduler(self) -> None:
        """Resume scheduling on every engine."""
        await self.call_utility_all("resume_scheduler")

    async def is_scheduler_paused(self) -> bool:
        """Whether scheduling is paused (all engines must agree)."""
        return bool(await self._call_all_equal("is_scheduler_paused"))

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,  # noqa: ASYNC109 - the engine-side RPC timeout
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """Run ``method`` on every worker of every engine; one result per worker."""
        results: list[Any] = []
        for result in await self.call_utility_all(
            "collective_rpc", method, timeout, list(args), None if kwargs is None else dict(kwargs)
        ):
            results.extend(result)
        return results

    async def execute_dummy_batch(self) -> None:
        """Run a dummy batch on every engine."""
        await self.call_utility_all("execute_dummy_batch")

    async def save_sharded_state(
        self, path: str, pattern: str | None = None, max_size: int | None = None
    ) -> None:
        """Save the model's sharded state (one engine)."""
        await self.call_utility("save_sharded_state", path, pattern, max_size)

    async def get_weight_version(self) -> str:
        """The engines' weight version (all must agree)."""
        return str(await self._call_all_equal("get_weight_version"))

    async def set_weight_version(self, weight_version: str) -> None:
        """Set the weight version label on every engine."""
        await self.call_utility_all("set_weight_version", weight_version)

    async def compute_weight_checksums(self) -> list[dict[str, str]]:
        """Weight checksums, one map per worker, concatenated over engines."""
        results: list[dict[str, str]] = []
        for result in await self.call_utility_all("compute_weight_checksums"):
            results.extend(result)
        return results

    # ------------------------------------------------------------------ receiving

    def _handle_frames(self, frames: Sequence[Any]) -> None:
        """Route one output-socket message; raises ProtocolError on bad input."""
        outputs = self._wire.decode_outputs(frames)
        if outputs is None:
            rank = self._ranks[0] if len(self._ranks) == 1 else None
            self._set_dead(
                "engine core sent ENGINE_CORE_DEAD (a fatal error in the engine; see its log)",
                rank=rank,
            )
            return
        engine_index = outputs.engine_index
        if engine_index not in self._rank_set:
            raise ProtocolError(
                f"output from unexpected engine_index {engine_index!r} "
                f"(expected one of {self._ranks})"
            )
        utility = outputs.utility_output
        if utility is not None:
            call_id = utility.call_id
            call = None if call_id in _RESERVED_CALL_IDS else self._pending_calls.get(call_id)
            if call is not None and not call.done:
                call.done = True
                call.failure = utility.failure_message
                call.result = self._wire.utility_value(utility)
                call.event.set()
            if not outputs.outputs:
                return
        raw: list[Any] = []
        for output in outputs.outputs:
            request_id = output.request_id
            stream = self._streams.get(request_id)
            if stream is not None:
                stream._deliver(output)
                if stream.finished:
                    self._release_stream(stream)
                continue
            owner = self._raw_requests.get(request_id)
            if owner is not None:
                raw.append(output)
                if output.finish_reason is not None:
                    del self._raw_requests[request_id]
                    self._request_ended(owner)
            # else: a late output of an aborted or finished request: drop (§3.4).
        if not self._raw_mode:
            return
        if raw or any(getattr(outputs, f, None) is not None for f in _RAW_INTEREST):
            if len(raw) != len(outputs.outputs):
                outputs = self._wire.replace_outputs(outputs, raw)
            self._raw_outputs.append(outputs)
            self._raw_event.set()

    async def _guard_input(self, socket: AsyncSocket, monitor: AsyncSocket | None) -> None:
        """After startup, an engine never sends on the input socket again: anything that
        arrives there (a stray ready response, an unknown identity) is a protocol error
        that makes the client dead. With ``monitor`` (engines whose process we cannot
        watch), a dropped engine connection makes it dead too. Ends on close or death,
        never raises."""
        if monitor is None:
            await self._guard_input_messages(socket)
            return
        async with anyio.create_task_group() as tg:

            async def guard_messages() -> None:
                await self._guard_input_messages(socket)
                tg.cancel_scope.cancel()

            tg.start_soon(guard_messages)
            await self._watch_disconnects(monitor)
            tg.cancel_scope.cancel()

    async def _watch_disconnects(self, monitor: AsyncSocket) -> None:
        try:
            while not self.dead:
                for frames in await monitor.receive_batch():
                    event = parse_monitor_message([_bytes(f) for f in frames])
                    if event["event"] == zmq.EVENT_DISCONNECTED and not self._closing:
                        raw_endpoint: object = event["endpoint"]
                        endpoint = (
                            raw_endpoint.decode(errors="replace")
                            if isinstance(raw_endpoint, bytes)
                            else str(raw_endpoint)
                        )
                        self._set_dead(
                            f"lost the connection to an engine on the input socket "
                            f"({endpoint}): the engine process or its host is gone"
                        )
                        return
        except anyio.ClosedResourceError:
            return
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            self._set_dead(f"input socket monitor failed: {exc!r}", cause=exc)

    async def _guard_input_messages(self, socket: AsyncSocket) -> None:
        try:
            while not self.dead:
                for message in await socket.receive_batch():
                    identity = _bytes(message[0]) if message else b""
                    try:
                        rank: object = rank_for_identity(identity)
                    except ProtocolError:
                        rank = None
                    known = rank in self._rank_set
                    what = "engine" if known else "unexpected identity"
                    exc = ProtocolError(
                        f"message on the input socket from {what} {identity.hex() or '(none)'}"
                        f" (rank {rank}) after startup, {len(message)} frame(s); engines send "
                        "only their ready response there"
                    )
                    self._set_dead(f"protocol error on the input socket: {exc}", cause=exc)
                    return
        except anyio.ClosedResourceError:
            return
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            self._set_dead(f"input socket failed: {exc!r}", cause=exc)

    async def _receive_loop(self, socket: AsyncSocket) -> None:
        """Receive task for one output socket; ends on close or death, never raises."""
        try:
            while self._dead_message is None:
                batch: list[Any] = []
                with anyio.CancelScope() as scope:
                    self._receive_scope = scope
                    if self._exited:
                        scope.cancel()
                    # Cancelled while waiting: nothing was dequeued (transport contract).
                    batch = await socket.receive_batch()
                self._receive_scope = None
                for frames in batch:
                    self._handle_frames(frames)
                    if self.dead:
                        return
                if self._exited:
                    await self._drain_after_exit(socket)
                    self._die_of_exit(self._exited[0])
                    return
        except anyio.ClosedResourceError:
            if not self._closing:
                self._set_dead("output socket closed", cause=None)
        except ProtocolError as exc:
            self._set_dead(f"protocol error on the output socket: {exc}", cause=exc)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            self._set_dead(f"receive task failed: {exc!r}", cause=exc)
        finally:
            self._receive_scope = None

    async def _drain_after_exit(self, socket: AsyncSocket) -> None:
        """Handle what the dead engine sent before exiting: read until the socket has
        been quiet for a few ms (ZeroMQ's I/O thread may still be moving the last
        messages from the kernel), at most ``_EXIT_DRAIN_S``."""
        deadline = anyio.current_time() + _EXIT_DRAIN_S
        quiet_since: float | None = None
        while not self.dead:
            try:
                frames = socket.receive_nowait()
            except anyio.WouldBlock:
                now = anyio.current_time()
                if quiet_since is None:
                    quiet_since = now
                if now - quiet_since >= _EXIT_QUIET_S or now >= deadline:
                    return
                await anyio.sleep(0.001)
                continue
            quiet_since = None
            self._handle_frames(frames)


# ---------------------------------------------------------------------- startup


@dataclass(slots=True)
class _Startup:
    handshake: ClientHandshake
    done: anyio.Event
    started_at: float
    on_progress: Callable[[StartupProgress], None] | None
    error: BaseException | None = None
    complete: HandshakeComplete | None = None
    exited: EngineProcess | None = None

    def is_complete(self) -> bool:
        return self.complete is not None

    def fail(self, error: BaseException) -> None:
        if self.error is None and self.complete is None:
            self.error = error
        self.done.set()

    def report(self, event: HandshakeEvent | None) -> None:
        if self.on_progress is None:
            return
        hs = self.handshake
        self.on_progress(
            StartupProgress(
                expected=tuple(hs.ranks),
                connected=tuple(hs.connected),
                ready=tuple(hs.ready),
                responded=tuple(hs.responded),
                elapsed=time.monotonic() - self.started_at,
                event=event,
            )
        )


async def _serve_handshake(
    startup: _Startup, handshake_socket: AsyncSocket, input_socket: AsyncSocket
) -> None:
    """Drive the handshake state machine until complete; never raises (records errors)."""
    hs = startup.handshake

    def feed(events: list[HandshakeEvent]) -> list[SendInitMetadata]:
        replies = []
        for event in events:
            if isinstance(event, SendInitMetadata):
                replies.append(event)
            elif isinstance(event, HandshakeComplete):
                startup.complete = event
            startup.report(event)
        return replies

    async def handshake_side() -> None:
        while not hs.handshake_socket_done:
            for message in await handshake_socket.receive_batch():
                if len(message) != 2:
                    raise ProtocolError(
                        f"handshake message with {len(message)} frames (expected "
                        "[identity][payload])"
                    )
                replies = feed(hs.receive_handshake(_bytes(message[0]), _bytes(message[1])))
                for reply in replies:
                    await handshake_socket.send([reply.identity, reply.payload])
                if startup.is_complete():
                    return

    async def input_side() -> None:
        while startup.complete is None:
            for message in await input_socket.receive_batch():
                if len(message) != 2:
                    raise ProtocolError(
                        f"ready response with {len(message)} frames (expected [identity][payload])"
                    )
                feed(hs.receive_input(_bytes(message[0]), _bytes(message[1])))
                if startup.is_complete():
                    return

    try:
        async with anyio.create_task_group() as tg:

            async def side(fn: Callable[[], Awaitable[None]]) -> None:
                await fn()
                if startup.complete is not None:
                    tg.cancel_scope.cancel()

            tg.start_soon(side, handshake_side)
            tg.start_soon(side, input_side)
        startup.done.set()
    except anyio.get_cancelled_exc_class():
        raise
    except BaseException as exc:  # includes groups from the two sides
        leaf = _first_leaf(exc)
        if isinstance(leaf, anyio.get_cancelled_exc_class()):
            raise
        startup.fail(leaf)


def _bytes(frame: Any) -> bytes:
    return frame if isinstance(frame, bytes) else bytes(frame.bytes)


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _startup_error(
    startup: _Startup,
    engines: EngineSource,
    processes: Sequence[EngineProcess],
    *,
    timed_out: float | None,
) -> EngineStartupError:
    waiting = startup.handshake.describe_waiting()
    if startup.exited is not None:
        process = startup.exited
        msg = (
            f"engine startup failed: {process.describe_exit()}\n"
            f"(while {waiting}). Fix the engine's error shown above and try again."
        )
        return EngineStartupError(msg)
    if startup.error is not None:
        return EngineStartupError(
            f"engine startup failed for {engines.describe()}: {startup.error}"
        )
    assert timed_out is not None
    lines = [
        f"engines did not become ready within {timed_out:g} s ({engines.describe()}): {waiting}.",
        engines.startup_hint(),
    ]
    for process in processes:
        tail = process.output_tail(10)
        if tail:
            indented = "\n".join("    " + line for line in tail.splitlines())
            lines.append(f"last output of {process.name} (pid {process.pid}):\n{indented}")
    return EngineStartupError("\n".join(lines))


@contextlib.asynccontextmanager
async def open_client(
    engines: EngineSource,
    *,
    ready_timeout: float | None = None,
    profile: ProtocolProfile | str | None = None,
    allow_insecure_serialization: bool = False,
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE,
    stream_buffer: int = 64,
    on_progress: Callable[[StartupProgress], None] | None = None,
) -> AsyncIterator[EngineCoreClient]:
    """Start (or wait for) engines, handshake with them, and yield a client.

    Args:
        engines: a :class:`ReferenceEngines`, :class:`VllmEngines` or
            :class:`ExternalEngines`.
        ready_timeout: seconds to wait for every engine to be ready (default
            ``VLLM_ENGINE_READY_TIMEOUT_S`` or 600).
        profile: pin the protocol profile (a profile object or a vLLM version string)
            instead of taking it from the engines' ready responses.
        allow_insecure_serialization: accept pickle payloads from engines.
        shutdown_grace: seconds between SIGTERM and SIGKILL for spawned engines.
        stream_buffer: default per-stream buffer before coalescing.
        on_progress: called (synchronously) on every startup step.

    Raises:
        EngineStartupError: an engine exited during startup (exit code and its last
            output lines in the message), the handshake failed (the
            :class:`ProtocolError` chained), or ``ready_timeout`` passed.

    On exit, by return, exception or cancellation: the client is dead (pending calls
    raise :class:`EngineDeadError`), every task has ended, spawned engines got
    SIGTERM, ``shutdown_grace`` seconds, then SIGKILL and were reaped, every socket is
    closed and the ipc directory is removed. Exceptions from the body propagate as
    they are (never wrapped in an exception group).
    """
    if stream_buffer < 1:
        raise ValueError(f"stream_buffer must be at least 1, got {stream_buffer}")
    timeout = _default_ready_timeout() if ready_timeout is None else ready_timeout
    layout = engines.layout()
    ranks = engines.ranks
    context: zmq.Context[Any] = zmq.Context(io_threads=2)
    ipc_dir = PrivateIpcDir()
    sockets: list[AsyncSocket] = []
    processes: list[EngineProcess] = []
    client: EngineCoreClient | None = None
    body_error: BaseException | None = None
    unbounded: dict[int, int | bytes | str] = {zmq.RCVHWM: 0, zmq.SNDHWM: 0}
    try:
        monitor_socket: AsyncSocket | None = None
        if layout.watch_disconnects:
            # The monitor is attached before the socket is wrapped (and bound): the
            # wrapper must be the only user of the socket afterwards.
            raw = context.socket(zmq.ROUTER)
            try:
                raw.setsockopt(zmq.LINGER, 0)
                raw.setsockopt(zmq.ROUTER_MANDATORY, 1)
                for option, value in unbounded.items():
                    raw.setsockopt(option, value)
                monitor_address = f"inproc://trio-vllm-monitor-{id(raw)}"
                raw.monitor(monitor_address, zmq.EVENT_DISCONNECTED)
                input_socket = AsyncSocket(raw)
            except BaseException:
                raw.close(linger=0)
                raise
            sockets.append(input_socket)
            monitor_socket = AsyncSocket.create(context, zmq.PAIR)
            sockets.append(monitor_socket)
            monitor_socket.connect(monitor_address)
        else:
            input_socket = AsyncSocket.create(context, zmq.ROUTER, options=unbounded)
            sockets.append(input_socket)
        output_socket = AsyncSocket.create(context, zmq.PULL, options=unbounded)
        sockets.append(output_socket)
        handshake_socket = AsyncSocket.create(context, zmq.ROUTER, options=unbounded)
        sockets.append(handshake_socket)
        if layout.data_host is None:
            input_address = _bind(input_socket, ipc_dir.endpoint("input"), "input")
            output_address = _bind(output_socket, ipc_dir.endpoint("output"), "output")
        else:
            bind = tcp_endpoint(layout.data_bind_host or layout.data_host, 0)
            input_address = _advertised(_bind(input_socket, bind, "input"), layout.data_host)
            output_address = _advertised(_bind(output_socket, bind, "output"), layout.data_host)
        if layout.handshake_bind is None:
            handshake_address = _bind(handshake_socket, ipc_dir.endpoint("handshake"), "handshake")
        else:
            handshake_address = _bind(handshake_socket, layout.handshake_bind, "handshake")
            if layout.data_host is not None:
                handshake_address = _advertised(handshake_address, layout.data_host)
        startup = _Startup(
            handshake=ClientHandshake(
                ranks,
                inputs=[input_address],
                outputs=[output_address],
                expect_local=layout.expect_local,
                expect_headless=layout.expect_headless,
            ),
            done=anyio.Event(),
            started_at=time.monotonic(),
            on_progress=on_progress,
        )
        async with anyio.create_task_group() as tg:
            try:
                started_client: list[EngineCoreClient] = []

                def on_exit(process: EngineProcess) -> None:
                    if started_client:
                        started_client[0]._on_process_exit(process)
                    elif startup.complete is None:
                        startup.exited = process
                        startup.fail(EngineStartupError(process.describe_exit()))

                try:
                    processes.extend(await engines.spawn(handshake_address))
                except OSError as exc:
                    raise EngineStartupError(
                        f"cannot start {engines.describe()}: {exc}. Check the python "
                        "executable and the command line."
                    ) from exc
                for process in processes:
                    tg.start_soon(process.watch, on_exit)
                tg.start_soon(_serve_handshake, startup, handshake_socket, input_socket)
                startup.report(None)
                with anyio.move_on_after(timeout) as waited:
                    await startup.done.wait()
                if startup.complete is None:
                    error = _startup_error(
                        startup,
                        engines,
                        processes,
                        timed_out=timeout if waited.cancelled_caught else None,
                    )
                    cause = startup.error if startup.exited is None else None
                    raise error from cause
                complete = startup.complete
                handshake_socket.close()
                try:
                    wire = Wire.create(
                        profile=profile,
                        vllm_version=complete.vllm_version,
                        allow_insecure_serialization=allow_insecure_serialization,
                    )
                except ProtocolError as exc:
                    raise EngineStartupError(
                        f"cannot talk to {engines.describe()}: {exc}. Pin a profile with "
                        "open_client(profile=...) only if you know the wire layout matches."
                    ) from exc
                wire.set_limits(complete.ready_responses)
                client = EngineCoreClient(
                    input_socket=input_socket,
                    ranks=ranks,
                    ready_responses=complete.ready_responses,
                    wire=wire,
                    stream_buffer=stream_buffer,
                )
                client._processes = list(processes)
                client._addresses = {
                    "input": input_address,
                    "output": output_address,
                    "handshake": handshake_address,
                }
                started_client.append(client)
                # An engine may have exited between READY and now.
                for process in processes:
                    if process.exited.is_set():
                        client._on_process_exit(process)
                tg.start_soon(client._receive_loop, output_socket)
                tg.start_soon(client._guard_input, input_socket, monitor_socket)
                yield client
            except BaseException as exc:
                body_error = exc
            finally:
                if client is not None:
                    client._closing = True
                    client._set_dead("the client is closed (open_client exited)")
                await _stop_processes(processes, shutdown_grace)
                tg.cancel_scope.cancel()
    finally:
        for socket in sockets:
            socket.close(linger=0)
        context.destroy(linger=0)  # closes anything left open, never blocks
        ipc_dir.cleanup()
    if body_error is not None:
        raise body_error


async def _stop_processes(processes: Sequence[EngineProcess], grace: float) -> None:
    if not processes:
        return
    with anyio.CancelScope(shield=True):
        async with anyio.create_task_group() as tg:
            for process in processes:
                tg.start_soon(process.stop, grace)


def _bind(socket: AsyncSocket, endpoint: str, what: str) -> str:
    try:
        return socket.bind(endpoint)
    except (zmq.ZMQError, OSError) as exc:
        raise EngineStartupError(
            f"cannot bind the {what} socket at {endpoint}: {exc}. Is the address local to "
            "this machine and the port free?"
        ) from exc


def _advertised(endpoint: str, host: str) -> str:
    """Replace the host of a bound tcp endpoint by the advertised one (keep the port)."""
    port = endpoint.rpartition(":")[2]
    return tcp_endpoint(host, int(port))
