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
import dataclasses
import itertools
import os
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, final

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
from ..protocol.routing import LoadBalancer, StartWave, WaveTracker
from ..transport import AsyncSocket, PrivateIpcDir, tcp_endpoint
from . import _args
from ._owner import LoopOwner
from ._streams import YIELD_INTERVAL, RequestStream
from ._wire import Wire

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence

    from ..protocol.profiles import ProtocolProfile
    from ._engines import EngineSource, SocketLayout
    from ._process import EngineProcess

__all__ = ["EngineCoreClient", "EngineEvent", "EngineEvents", "StartupProgress", "open_client"]

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


@dataclass(frozen=True, slots=True)
class EngineEvent:
    """Something an engine told the client unasked, or a rank's loss; see
    :attr:`EngineCoreClient.engine_events`.

    ``kind``: ``"elastic_ep"`` (call id -1: ``payload`` is ``[type, dp_rank]``, e.g.
    ``["RECONFIGURE_FINISHED", 2]``), ``"fault_tolerance"`` (call id -2: ``payload``
    is the status map), or ``"rank_lost"`` (``on_engine_death="continue"``: the rank
    died; ``payload`` is ``{"message": str, "requests": [ids failed]}``) and
    ``"rank_retired"`` (:meth:`EngineCoreClient.retire_rank` finished).
    """

    kind: str
    rank: int | None
    payload: Any


class EngineEvents:
    """The client's channel of :class:`EngineEvent`: ``async for event in
    client.engine_events`` or ``await client.engine_events.receive()``.

    Unbounded (the events are rare); iteration ends, and ``receive`` raises
    ``anyio.EndOfStream``, once the client is closed or dead and the queue is empty.
    Cancellation: a cancelled ``receive`` consumes nothing.
    """

    def __init__(self) -> None:
        self._queue: deque[EngineEvent] = deque()
        self._event = anyio.Event()
        self._closed = False

    def _put(self, event: EngineEvent) -> None:
        if not self._closed:
            self._queue.append(event)
            self._event.set()

    def _close(self) -> None:
        self._closed = True
        self._event.set()

    def receive_nowait(self) -> EngineEvent:
        """The next event, or ``anyio.WouldBlock`` (``anyio.EndOfStream`` when closed)."""
        if self._queue:
            return self._queue.popleft()
        if self._closed:
            raise anyio.EndOfStream
        raise anyio.WouldBlock

    async def receive(self) -> EngineEvent:
        """Wait for the next event."""
        while True:
            await anyio.lowlevel.checkpoint()
            if self._queue or self._closed:
                return self.receive_nowait()
            if self._event.is_set():
                self._event = anyio.Event()
            await self._event.wait()

    def __aiter__(self) -> EngineEvents:
        return self

    async def __anext__(self) -> EngineEvent:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None


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
        on_engine_death: Literal["fail", "continue"] = "fail",
        waves: bool = False,
    ) -> None:
        # Every public method refuses other threads and loops first (_owner.py).
        self._owner = LoopOwner()
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
        self._raw_yield_due = 0.0
        # The one place that decides where requests go (protocol/routing.py).
        self._balancer = LoadBalancer(self._ranks)
        self._waves = WaveTracker(self._ranks) if waves else None
        self._on_engine_death = on_engine_death
        self._lost_ranks: dict[int, str] = {}
        self._retiring: set[int] = set()
        # Ranks whose retirement finished draining: their exit or dropped connection
        # is expected. A retiring rank that dies while draining is a death as usual.
        self._retired: set[int] = set()
        # Scale-up (add_engines): set by open_client; one join at a time.
        self._join: _Join | None = None
        self._context: zmq.Context[Any] | None = None
        self._ipc_dir: PrivateIpcDir | None = None
        self._sockets: list[AsyncSocket] = []
        self._task_group: anyio.abc.TaskGroup | None = None
        self._data: dict[tuple[str | None, str | None, int], tuple[str, str, str]] = {}
        self._watching = False
        self._joins = 0
        self._output_socket: AsyncSocket | None = None
        self._drained: dict[int, anyio.Event] = {}
        self._shutdown_grace = DEFAULT_SHUTDOWN_GRACE
        # ENGINE_CORE_DEAD carries no rank: in "continue" mode with several live ranks
        # the rank is named by its process exit or dropped connection instead.
        self._unattributed_deaths = 0
        # Bound input endpoint -> the ranks that connect to it (to name a dropped one).
        self._endpoint_ranks: dict[str, list[int]] = {}
        self._events = EngineEvents()
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
    def live_ranks(self) -> list[int]:
        """Ranks new requests can go to: not lost (``on_engine_death="continue"``)
        and not retired."""
        return self._balancer.live_ranks

    @property
    def lost_ranks(self) -> dict[int, str]:
        """Rank -> why it is gone, for ranks lost while the client kept running."""
        return dict(self._lost_ranks)

    @property
    def engine_events(self) -> EngineEvents:
        """Unsolicited engine notices and rank losses, in arrival order.

        Elastic-EP (call id -1) and fault-tolerance (call id -2) messages are never
        matched against utility calls; they arrive here as :class:`EngineEvent`. The
        buffer is unbounded (these are rare); iteration ends when the client closes.
        """
        return self._events

    @property
    def in_flight(self) -> dict[int, int]:
        """Rank -> requests of this client in flight there (the routing load)."""
        return {r: self._balancer.in_flight(r) for r in self._ranks}

    @property
    def _in_flight(self) -> dict[int, int]:
        return self.in_flight

    @property
    def current_wave(self) -> int | None:
        """The DP wave the client believes current (``None`` without ``waves=True``)."""
        return None if self._waves is None else self._waves.current_wave

    @property
    def waves_started(self) -> int:
        """How many waves the client started or saw start (0 without ``waves=True``)."""
        return 0 if self._waves is None else self._waves.waves_started

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
        self._owner.check("wait_dead")
        await self._dead_event.wait()
        return self._dead_error()

    # ------------------------------------------------------------------ death

    def _dead_error(self) -> EngineDeadError:
        # A fresh instance per raise: one shared exception would collect tracebacks.
        error = EngineDeadError(self._dead_message or "engine core is dead", rank=self._dead_rank)
        error.__cause__ = self._dead_cause
        return error

    def _rank_error(self, rank: int) -> EngineDeadError:
        """The error for a call or request of ``rank`` that ended by a death."""
        if self.dead or rank not in self._lost_ranks:
            return self._dead_error()
        return EngineDeadError(f"engine rank {rank} died: {self._lost_ranks[rank]}", rank=rank)

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
        for drained in self._drained.values():
            drained.set()
        self._events._close()

    def _rank_died(
        self, rank: int | None, message: str, *, cause: BaseException | None = None
    ) -> None:
        """One rank is gone: the whole client dies (default, vLLM parity), or with
        ``on_engine_death="continue"`` only that rank's requests and calls fail."""
        if self.dead:
            return
        if rank is not None and rank in self._lost_ranks:
            return
        if self._on_engine_death != "continue" or rank is None or rank not in self._rank_set:
            self._set_dead(message, rank=rank, cause=cause)
            return
        self._lost_ranks[rank] = message
        self._balancer.remove(rank)
        if self._waves is not None:
            self._waves.set_ranks(self._balancer.live_ranks)
        if not self._balancer.live_ranks:
            self._set_dead(f"every engine is gone; the last: {message}", rank=rank, cause=cause)
            return

        def error() -> EngineDeadError:
            exc = EngineDeadError(f"engine rank {rank} died: {message}", rank=rank)
            exc.__cause__ = cause
            return exc

        drained = self._drained.get(rank)
        if drained is not None:
            drained.set()
        failed: list[str] = []
        for call in self._pending_calls.values():
            if call.rank == rank and not call.done:
                call.dead = True
                call.event.set()
        for request_id, stream in list(self._streams.items()):
            if stream.rank == rank and not stream.finished:
                failed.append(request_id)
                stream._fail(error)
                self._release_stream(stream)
        for request_id, owner in list(self._raw_requests.items()):
            if owner == rank:
                failed.append(request_id)
                del self._raw_requests[request_id]
                self._request_ended(rank)
        self._events._put(
            EngineEvent("rank_lost", rank, {"message": message, "requests": failed})
        )

    def _on_process_exit(self, process: EngineProcess) -> None:
        if self._closing or self.dead:
            return
        if all(rank in self._retired for rank in process.ranks):
            return  # stopped by retire_rank
        if self._receive_scope is None:
            self._die_of_exit(process)
            return
        # Outputs the engine sent before exiting may still sit in the output socket:
        # the receive task drains them first (a few ms), then declares the death, so
        # that they reach their streams in order.
        self._exited.append(process)
        self._receive_scope.cancel()

    def _die_of_exit(self, process: EngineProcess) -> None:
        message = f"engine process died: {process.describe_exit()}"
        if self._on_engine_death == "continue":
            for each in process.ranks:
                if each not in self._retired:
                    self._rank_died(each, message)
            return
        rank = process.ranks[0] if len(process.ranks) == 1 else None
        self._set_dead(message, rank=rank)

    # ------------------------------------------------------------------ routing

    def _choose_rank(self, rank: int | None) -> int:
        """The one place that picks an engine: the given rank, else the least loaded
        live one (:class:`~trio_vllm.protocol.routing.LoadBalancer`)."""
        try:
            return self._balancer.choose(rank)
        except LookupError:
            raise self._dead_error() from None

    def _request_target(self, request: Any, rank: int | None) -> int:
        pinned = rank if rank is not None else getattr(request, "data_parallel_rank", None)
        return self._choose_rank(pinned)

    def _request_started(self, rank: int) -> None:
        self._balancer.started(rank)

    def _request_ended(self, rank: int) -> None:
        self._balancer.ended(rank)
        drained = self._drained.get(rank)
        if drained is not None and self._balancer.in_flight(rank) == 0:
            drained.set()

    def _wave_frames(self, start: StartWave | None) -> None:
        """Queue START_DP_WAVE for ``start`` (the coordinator's role, §7.5); no
        checkpoint: a full peer queue only loses a wake-up that the next one repeats."""
        if start is None:
            return
        frames = self._wire.encode_start_dp_wave(start.wave, start.exclude)
        for target in start.ranks:
            if target in self._lost_ranks:
                continue
            self._send_nowait_best_effort(target, frames)

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
            self._rank_died(rank, f"engine {rank} is no longer connected", cause=exc)
            raise self._rank_error(rank) from exc
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
        self._owner.check("add_request")
        self._check_alive()
        request_id = self._check_new_request(request)
        target = self._request_target(request, rank)
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
        self._after_add(target)

    def _after_add(self, target: int) -> None:
        if self._waves is not None:
            self._wave_frames(self._waves.on_add(target))

    async def get_output(self) -> Any:
        """Wait for the next EngineCoreOutputs batch for raw requests (vLLM's get_output).

        Batches carry the outputs of requests sent with :meth:`add_request` (stream
        outputs are routed to their streams), plus scheduler stats and wave events.
        Utility replies never appear here. Batches are queued without bound, as in
        vLLM; consume them. Cancellation: nothing is consumed by a cancelled call.
        Raises :class:`~trio_vllm.EngineDeadError` once dead and the queue is empty.

        Scheduling: while batches are queued, a call yields to other tasks at most once
        per millisecond (it always checks for cancellation), so draining a backlog does
        not pay a full scheduler pass per batch.
        """
        self._owner.check("get_output")
        self._raw_mode = True
        if self._raw_outputs and time.monotonic() < self._raw_yield_due:
            await anyio.lowlevel.checkpoint_if_cancelled()
            return self._raw_outputs.popleft()
        await anyio.lowlevel.checkpoint()
        while True:
            self._raw_yield_due = time.monotonic() + YIELD_INTERVAL
            if self._raw_outputs:
                return self._raw_outputs.popleft()
            self._check_alive()
            if self._raw_event.is_set():
                self._raw_event = anyio.Event()
            # Waiting is a checkpoint: a woken call returns without another one.
            await self._raw_event.wait()

    def get_output_nowait(self) -> Any:
        """The next queued batch, or ``anyio.WouldBlock``; not a checkpoint."""
        self._owner.check("get_output_nowait")
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
        no output for a client-initiated abort. A refused call (``TypeError`` for a
        non-str id, ``ValueError`` for an unknown ``rank`` or an id that cannot be
        encoded) raises before anything changed.

        Cancellation: the one checkpoint comes first; once past it the requests are
        forgotten locally and every ABORT is queued without another checkpoint, so a
        cancelled call changed nothing and a completed one reached every owner.
        """
        self._owner.check("abort_requests")
        self._check_alive()
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            if not isinstance(request_id, str):
                raise TypeError(f"request ids are strings, got {request_id!r}")
        if rank is not None:
            self._choose_rank(rank)  # an unknown rank raises here, before the checkpoint
        await anyio.lowlevel.checkpoint()
        self._check_alive()
        # Plan, then commit: every target is chosen and every ABORT encoded (either may
        # raise: an unknown rank, an id that cannot be encoded) before any request is
        # forgotten, or a refused call would leave the engine running what it forgot.
        by_rank: dict[int, list[str]] = {}
        for request_id in ids:
            owner = self._raw_requests.get(request_id)
            stream = self._streams.get(request_id)
            if stream is not None and not stream.finished:
                owner = stream.rank
            if owner is not None:
                by_rank.setdefault(owner, []).append(request_id)
            else:
                for target in [rank] if rank is not None else self._balancer.live_ranks:
                    by_rank.setdefault(self._choose_rank(target), []).append(request_id)
        encoded = {target: self._wire.encode_abort(ids_) for target, ids_ in by_rank.items()}
        for request_id in ids:
            owner = self._raw_requests.pop(request_id, None)
            if owner is not None:
                self._request_ended(owner)
            stream = self._streams.get(request_id)
            if stream is not None and not stream.finished:
                stream._abort_locally()
                self._release_stream(stream)
        for target, rank_ids in by_rank.items():
            await self._send_abort(target, rank_ids, encoded[target])

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
        self._owner.check("generate")
        _args.check_max_pending(max_pending)
        self._check_alive()
        request_id = self._check_new_request(request)
        target = self._request_target(request, rank)
        frames = self._wire.encode_add(request)
        stream = RequestStream(request_id, target, max_pending=max_pending or self._stream_buffer)
        self._streams[request_id] = stream
        self._request_started(target)
        stream._in_flight = True
        sent = False
        try:
            await self._send(target, frames)
            sent = True
            self._after_add(target)
            yield stream
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            self._release_stream(stream)
            if sent and not stream.finished:
                stream.aborted = True
                await self._send_abort(target, [request_id])

    async def _send_abort(
        self, rank: int, request_ids: list[str], frames: list[Any] | None = None
    ) -> None:
        """Queue an ABORT without a checkpoint when possible (safe in cancelled code)."""
        if frames is None:
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
        self._owner.check("call_utility")
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
            raise self._rank_error(target)
        if call.failure is not None:
            raise UtilityCallError(method, call.failure, rank=target)
        return call.result

    async def call_utility_all(
        self, method: str, *args: Any, return_exceptions: bool = False
    ) -> list[Any]:
        """Call ``method(*args)`` on every live engine concurrently; results in rank
        order (of :attr:`live_ranks`).

        If any call fails, the first failure by rank is raised (an
        :class:`~trio_vllm.EngineDeadError` takes precedence) after all calls ended.
        With ``return_exceptions=True`` nothing is raised for engine-side trouble:
        each rank's entry is its result or its :class:`~trio_vllm.TrioVllmError`
        (:class:`~trio_vllm.UtilityCallError`, :class:`~trio_vllm.EngineDeadError`).
        Cancellation cancels every call.
        """
        self._owner.check("call_utility_all")
        self._check_alive()
        ranks = self._balancer.live_ranks
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
            for rank in ranks:
                tg.start_soon(one, rank)
        if return_exceptions:
            return [errors[r] if r in errors else results[r] for r in ranks]
        if errors:
            dead = [e for e in errors.values() if isinstance(e, EngineDeadError)]
            raise dead[0] if dead else errors[min(errors)]
        return [results[r] for r in ranks]

    async def retire_rank(self, rank: int, *, drain: bool = True) -> None:
        """Scale down: stop routing to ``rank``, finish or abort its requests, stop it.

        New requests go elsewhere at once. With ``drain`` the call waits until every
        request already on the rank finished; without, they are aborted (streams stop
        with ``aborted`` set, the engine gets ABORT). Then a process this client
        spawned for that rank alone is stopped (SIGTERM, grace, SIGKILL); an external
        engine is left running, unused. An :class:`EngineEvent` ``"rank_retired"``
        follows. Cancellation while draining: the rank stays out of routing and its
        requests keep running. Raises ``ValueError`` for an unknown or gone rank or the
        last live rank. A rank that dies while draining is a death as usual (the
        client dies, or with ``on_engine_death="continue"`` its requests fail), and
        this call raises :class:`~trio_vllm.EngineDeadError`.
        """
        self._owner.check("retire_rank")
        _args.check_rank(rank)
        self._check_alive()
        if rank not in self._rank_set or rank in self._lost_ranks or rank in self._retiring:
            raise ValueError(f"rank {rank} is not a live engine of this client")
        if self._balancer.live_ranks == [rank]:
            raise ValueError(f"rank {rank} is the last live engine; close the client instead")
        self._retiring.add(rank)
        self._balancer.remove(rank)
        if self._waves is not None:
            self._waves.set_ranks(self._balancer.live_ranks)
        if not drain:
            ids = [i for i, st in self._streams.items() if st.rank == rank and not st.finished]
            ids += [i for i, owner in self._raw_requests.items() if owner == rank]
            if ids:
                await self.abort_requests(ids)
        if self._balancer.in_flight(rank) > 0:
            drained = self._drained.setdefault(rank, anyio.Event())
            await drained.wait()
            self._check_alive()
            if rank in self._lost_ranks:
                raise self._rank_error(rank)  # it died while draining
        self._retired.add(rank)
        for process in self._processes:
            if process.ranks == (rank,):
                await process.stop(self._shutdown_grace)
        self._events._put(EngineEvent("rank_retired", rank, None))

    async def add_engines(
        self, source: EngineSource, *, ready_timeout: float | None = None
    ) -> list[int]:
        """Scale up: start (or wait for) ``source``'s engines and add their ranks.

        The new engines do the same handshake as at startup (with a handshake socket
        of their own, closed afterwards) and must report the same vLLM version. Their
        ranks must be new to this client. Returns the added ranks; they get requests
        at once. External engines can join only a client that started with an external
        source (their connections are watched by the same monitor). Raises
        :class:`~trio_vllm.EngineStartupError` if an engine exits, the handshake fails
        or ``ready_timeout`` passes; then, and on cancellation, spawned engines are
        stopped and nothing changed. Only one call at a time.
        """
        self._owner.check("add_engines")
        _args.check_add_engines(source, ready_timeout)
        self._check_alive()
        if self._join is not None or self._context is None or self._task_group is None:
            raise RuntimeError("another add_engines call is in progress")
        overlap = sorted(set(source.ranks) & (set(self._rank_set) | self._retired))
        if overlap:
            raise ValueError(f"rank(s) {overlap} are already known to this client")
        layout = source.layout()
        if layout.watch_disconnects and not self._watching:
            raise ValueError(
                "external engines can join only a client that started with an external "
                "source (its input socket has no connection monitor)"
            )
        timeout = _args.ready_timeout(ready_timeout)
        assert self._ipc_dir is not None
        assert self._output_socket is not None
        self._joins += 1
        own = len(self._data) + self._joins * 1000 if layout.watch_disconnects else -1
        key = (layout.data_host, layout.data_bind_host, own)
        if key not in self._data:
            self._data[key] = _bind_data(
                self._input, self._output_socket, layout, self._ipc_dir, f"-join{self._joins}"
            )
        bound_in, source_input, source_output = self._data[key]
        handshake_socket = AsyncSocket.create(
            self._context, zmq.ROUTER, options={zmq.RCVHWM: 0, zmq.SNDHWM: 0}
        )
        self._sockets.append(handshake_socket)
        processes: list[EngineProcess] = []
        try:
            if layout.handshake_bind is None:
                endpoint = self._ipc_dir.endpoint(f"handshake-join{self._joins}")
                address = _bind(handshake_socket, endpoint, "handshake")
            else:
                address = _bind(handshake_socket, layout.handshake_bind, "handshake")
                if layout.data_host is not None:
                    address = _advertised(address, layout.data_host)
            join = _Join(
                _Handshakes(
                    [
                        ClientHandshake(
                            source.ranks,
                            inputs=[source_input],
                            outputs=[source_output],
                            expect_local=layout.expect_local,
                            expect_headless=layout.expect_headless,
                        )
                    ]
                ),
                frozenset(source.ranks),
            )
            self._join = join

            def on_exit(process: EngineProcess) -> None:
                if not join.done.is_set():
                    join.fail(EngineStartupError(process.describe_exit()))
                else:
                    self._on_process_exit(process)

            with anyio.move_on_after(timeout) as waited:
                try:
                    processes.extend(await source.spawn(address))
                except OSError as exc:
                    raise EngineStartupError(f"cannot start {source.describe()}: {exc}") from exc
                for process in processes:
                    self._task_group.start_soon(process.watch, on_exit)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_serve_join_handshake, join, handshake_socket)
                    await join.done.wait()
                    tg.cancel_scope.cancel()
            self._check_alive()
            if join.complete is None:
                what = join.handshake.describe_waiting()
                if waited.cancelled_caught:
                    raise EngineStartupError(
                        f"engines did not become ready within {timeout:g} s "
                        f"({source.describe()}): {what}"
                    )
                raise EngineStartupError(
                    f"engine startup failed for {source.describe()}: {join.error}"
                ) from join.error
            version = join.complete.vllm_version
            if version != self._wire.vllm_version:
                raise EngineStartupError(
                    f"the new engines report vLLM {version}, the client's engines "
                    f"{self._wire.vllm_version}"
                )
        except BaseException:
            self._join = None
            self._retired.update(source.ranks)  # their exits are expected now
            with anyio.CancelScope(shield=True):
                for process in processes:
                    await process.stop(self._shutdown_grace)
            raise
        finally:
            self._join = None
            handshake_socket.close()
        # Commit (no checkpoint since the handshake completed).
        for rank, response in join.complete.ready_responses.items():
            self._ready_responses[rank] = dict(response)
        self._ranks = sorted([*self._ranks, *source.ranks])
        self._rank_set = frozenset(self._ranks)
        for rank in source.ranks:
            self._balancer.add(rank)
        if self._waves is not None:
            self._waves.set_ranks(self._balancer.live_ranks)
        self._wire.set_limits(self._ready_responses)
        self._processes.extend(processes)
        if layout.watch_disconnects:
            self._endpoint_ranks.setdefault(bound_in, []).extend(source.ranks)
        return list(source.ranks)

    async def _call_all_equal(self, method: str, *args: Any) -> Any:
        results = await self.call_utility_all(method, *args)
        if any(r != results[0] for r in results[1:]):
            raise ProtocolError(f"engines disagree on {method}: {results}")
        return results[0]

    # Named utilities (PROTOCOL.md §6.3), with vLLM's fan-out rules.

    async def get_supported_tasks(self) -> tuple[str, ...]:
        """Tasks the model supports, e.g. ``("generate",)``."""
        self._owner.check("get_supported_tasks")
        return tuple(await self.call_utility("get_supported_tasks"))

    async def is_sleeping(self) -> bool:
        """Whether the engines sleep (all engines must agree)."""
        self._owner.check("is_sleeping")
        return bool(await self._call_all_equal("is_sleeping"))

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Put every engine to sleep (level 0 pauses, 1 offloads weights, 2 drops all)."""
        self._owner.check("sleep")
        await self.call_utility_all("sleep", level, mode)

    async def wake_up(self, tags: Sequence[str] | None = None) -> bool:
        """Wake every engine (``tags`` among weights/kv_cache/scheduling; None = all)."""
        self._owner.check("wake_up")
        results = await self.call_utility_all("wake_up", None if tags is None else list(tags))
        return all(r is None or bool(r) for r in results)

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Reset the prefix cache of every engine; True if all succeeded."""
        self._owner.check("reset_prefix_cache")
        results = await self.call_utility_all(
            "reset_prefix_cache", reset_running_requests, reset_connector
        )
        return all(bool(r) for r in results)

    async def reset_mm_cache(self) -> None:
        """Reset the multimodal cache of every engine."""
        self._owner.check("reset_mm_cache")
        await self.call_utility_all("reset_mm_cache")

    async def reset_encoder_cache(self) -> None:
        """Reset the encoder cache of every engine."""
        self._owner.check("reset_encoder_cache")
        await self.call_utility_all("reset_encoder_cache")

    async def profile(
        self,
        is_start: bool = True,
        profile_prefix: str | None = None,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
    ) -> None:
        """Start or stop the torch profiler on every engine."""
        self._owner.check("profile")
        if self.vllm_version is not None and self.vllm_version.startswith("0.25."):
            await self.call_utility_all("profile", is_start, profile_prefix)
        else:
            await self.call_utility_all(
                "profile", is_start, profile_prefix, delay_iterations, max_iterations
            )

    async def add_lora(self, lora_request: Any) -> bool:
        """Load a LoRA adapter on every engine (``lora_request``: a LoRARequest struct)."""
        self._owner.check("add_lora")
        return all(bool(r) for r in await self.call_utility_all("add_lora", lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        """Unload a LoRA adapter from every engine."""
        self._owner.check("remove_lora")
        return all(bool(r) for r in await self.call_utility_all("remove_lora", lora_id))

    async def list_loras(self) -> set[int]:
        """The LoRA ids loaded (union over engines)."""
        self._owner.check("list_loras")
        loaded: set[int] = set()
        for result in await self.call_utility_all("list_loras"):
            loaded.update(result)
        return loaded

    async def pin_lora(self, lora_id: int) -> bool:
        """Pin a LoRA adapter on every engine."""
        self._owner.check("pin_lora")
        return all(bool(r) for r in await self.call_utility_all("pin_lora", lora_id))

    async def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause scheduling on every engine; returns once the pause completed."""
        self._owner.check("pause_scheduler")
        await self.call_utility_all("pause_scheduler", mode, clear_cache)

    async def resume_scheduler(self) -> None:
        """Resume scheduling on every engine."""
        self._owner.check("resume_scheduler")
        await self.call_utility_all("resume_scheduler")

    async def is_scheduler_paused(self) -> bool:
        """Whether scheduling is paused (all engines must agree)."""
        self._owner.check("is_scheduler_paused")
        return bool(await self._call_all_equal("is_scheduler_paused"))

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,  # noqa: ASYNC109 - the engine-side RPC timeout
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """Run ``method`` on every worker of every engine; one result per worker."""
        self._owner.check("collective_rpc")
        results: list[Any] = []
        for result in await self.call_utility_all(
            "collective_rpc", method, timeout, list(args), None if kwargs is None else dict(kwargs)
        ):
            results.extend(result)
        return results

    async def execute_dummy_batch(self) -> None:
        """Run a dummy batch on every engine."""
        self._owner.check("execute_dummy_batch")
        await self.call_utility_all("execute_dummy_batch")

    async def save_sharded_state(
        self, path: str, pattern: str | None = None, max_size: int | None = None
    ) -> None:
        """Save the model's sharded state (one engine)."""
        self._owner.check("save_sharded_state")
        await self.call_utility("save_sharded_state", path, pattern, max_size)

    async def get_weight_version(self) -> str:
        """The engines' weight version (all must agree)."""
        self._owner.check("get_weight_version")
        return str(await self._call_all_equal("get_weight_version"))

    async def set_weight_version(self, weight_version: str) -> None:
        """Set the weight version label on every engine."""
        self._owner.check("set_weight_version")
        await self.call_utility_all("set_weight_version", weight_version)

    async def compute_weight_checksums(self) -> list[dict[str, str]]:
        """Weight checksums, one map per worker, concatenated over engines."""
        self._owner.check("compute_weight_checksums")
        results: list[dict[str, str]] = []
        for result in await self.call_utility_all("compute_weight_checksums"):
            results.extend(result)
        return results

    # ------------------------------------------------------------------ receiving

    def _handle_frames(self, frames: Sequence[Any]) -> None:
        """Route one output-socket message; raises ProtocolError on bad input."""
        outputs = self._wire.decode_outputs(frames)
        if outputs is None:
            live = self._balancer.live_ranks
            if self._on_engine_death == "continue" and len(live) > 1:
                # No rank in the frame: the engine's exit (or dropped connection),
                # which follows at once, names it (§8.3).
                self._unattributed_deaths += 1
                return
            rank = live[0] if len(live) == 1 else None
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
        if engine_index in self._lost_ranks:
            return  # the rank's requests already failed; late words are dropped
        stats = outputs.scheduler_stats
        if stats is not None:
            self._balancer.update_stats(
                engine_index, stats.num_waiting_reqs, stats.num_running_reqs
            )
        if self._waves is not None:
            if outputs.wave_complete is not None:
                self._wave_frames(
                    self._waves.on_wave_complete(
                        outputs.wave_complete,
                        requests_in_flight=any(
                            self._balancer.in_flight(r) for r in self._balancer.live_ranks
                        ),
                    )
                )
            if outputs.start_wave is not None:
                self._wave_frames(self._waves.on_start_wave(outputs.start_wave, engine_index))
        utility = outputs.utility_output
        if utility is not None:
            call_id = utility.call_id
            if call_id in _RESERVED_CALL_IDS:
                kind = "elastic_ep" if call_id == -1 else "fault_tolerance"
                value = self._wire.utility_value(utility)
                self._events._put(EngineEvent(kind, engine_index, value))
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
                        if self._endpoint_ranks and endpoint not in self._endpoint_ranks:
                            continue  # an engine whose process exit is watched instead
                        message = (
                            f"lost the connection to an engine on the input socket "
                            f"({endpoint}): the engine process or its host is gone"
                        )
                        ranks = [
                            r
                            for r in self._endpoint_ranks.get(endpoint, [])
                            if r not in self._lost_ranks and r not in self._retired
                        ]
                        if not ranks and self._endpoint_ranks.get(endpoint):
                            continue  # a retired or already lost engine
                        if self._on_engine_death == "continue" and ranks:
                            # Several engines of one source behind this endpoint: the
                            # connection does not say which left, and a headless vLLM
                            # launcher stops all its engines when one dies (§2.3), so
                            # the source is the unit that is lost.
                            for rank in ranks:
                                self._rank_died(rank, message)
                        else:
                            self._rank_died(ranks[0] if len(ranks) == 1 else None, message)
                        if self._dead_message is not None:
                            return
        except anyio.ClosedResourceError:
            return
        except Exception as exc:  # cancellation is a BaseException: it passes through
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
                    join = self._join
                    if join is not None and rank in join.ranks and len(message) == 2:
                        # A joining engine's ready response (add_engines).
                        join.receive_input(identity, _bytes(message[1]))
                        continue
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
        except Exception as exc:  # cancellation is a BaseException: it passes through
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
                    exited, self._exited = self._exited, []
                    for process in exited:
                        self._die_of_exit(process)
                    if self.dead:
                        return
        except anyio.ClosedResourceError:
            if not self._closing:
                self._set_dead("output socket closed", cause=None)
        except ProtocolError as exc:
            self._set_dead(f"protocol error on the output socket: {exc}", cause=exc)
        except Exception as exc:  # cancellation is a BaseException: it passes through
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
            # The deadline is checked on every message, not only when the socket is
            # empty: with data parallelism other engines share the socket, and one that
            # keeps it full would otherwise hold the death back until it goes quiet.
            now = anyio.current_time()
            if now >= deadline:
                return
            try:
                frames = socket.receive_nowait()
            except anyio.WouldBlock:
                if quiet_since is None:
                    quiet_since = now
                if now - quiet_since >= _EXIT_QUIET_S:
                    return
                await anyio.sleep(0.001)
                continue
            quiet_since = None
            self._handle_frames(frames)


# ---------------------------------------------------------------------- startup


@dataclass(slots=True)
class _Startup:
    handshake: _Handshakes
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
    engines: _SourceSet,
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


@dataclass(slots=True)
class _Join:
    """One add_engines call in progress: the guard feeds it the ready responses."""

    handshake: _Handshakes
    ranks: frozenset[int]
    done: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    complete: HandshakeComplete | None = None
    error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        if self.error is None and self.complete is None:
            self.error = error
        self.done.set()

    def feed(self, events: list[HandshakeEvent]) -> list[SendInitMetadata]:
        replies = []
        for event in events:
            if isinstance(event, SendInitMetadata):
                replies.append(event)
            elif isinstance(event, HandshakeComplete):
                self.complete = event
                self.done.set()
        return replies

    def receive_input(self, identity: bytes, payload: bytes) -> None:
        try:
            self.feed(self.handshake.receive_input(identity, payload))
        except ProtocolError as exc:
            self.fail(exc)


async def _serve_join_handshake(join: _Join, socket: AsyncSocket) -> None:
    """The handshake-socket side of a join; records errors, never raises them."""
    try:
        while not join.handshake.handshake_socket_done:
            for message in await socket.receive_batch():
                if len(message) != 2:
                    raise ProtocolError(f"handshake message with {len(message)} frames")
                events = join.handshake.receive_handshake(_bytes(message[0]), _bytes(message[1]))
                for reply in join.feed(events):
                    await socket.send([reply.identity, reply.payload])
    except (ProtocolError, anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
        join.fail(exc)


def _bind_data(
    input_socket: AsyncSocket,
    output_socket: AsyncSocket,
    layout: SocketLayout,
    ipc_dir: PrivateIpcDir,
    suffix: str,
) -> tuple[str, str, str]:
    """Bind the input and output sockets for a layout: (bound input, advertised
    input, advertised output)."""
    if layout.data_host is None:
        bound_in = _bind(input_socket, ipc_dir.endpoint(f"input{suffix}"), "input")
        bound_out = _bind(output_socket, ipc_dir.endpoint(f"output{suffix}"), "output")
        return bound_in, bound_in, bound_out
    bind = tcp_endpoint(layout.data_bind_host or layout.data_host, 0)
    bound_in = _bind(input_socket, bind, "input")
    return (
        bound_in,
        _advertised(bound_in, layout.data_host),
        _advertised(_bind(output_socket, bind, "output"), layout.data_host),
    )


class _SourceSet:
    """Several engine sources behind one client: their ranks must not overlap."""

    def __init__(self, engines: EngineSource | Sequence[EngineSource]) -> None:
        self.sources: list[EngineSource] = (
            list(engines) if isinstance(engines, (list, tuple)) else [engines]  # type: ignore[list-item]
        )
        if not self.sources:
            raise ValueError("expected at least one engine source")
        seen: dict[int, EngineSource] = {}
        for source in self.sources:
            for rank in source.ranks:
                if rank in seen:
                    raise ValueError(
                        f"rank {rank} is in two engine sources: {seen[rank].describe()} and "
                        f"{source.describe()}; give each source its own start_rank"
                    )
                seen[rank] = source
        self.ranks = sorted(seen)

    def describe(self) -> str:
        return " + ".join(source.describe() for source in self.sources)

    def startup_hint(self) -> str:
        hints = dict.fromkeys(source.startup_hint() for source in self.sources)
        return " ".join(hints)


class _Handshakes:
    """One :class:`ClientHandshake` per source (each advertises its own addresses),
    seen as one: messages are dispatched by the sender's rank."""

    def __init__(self, parts: Sequence[ClientHandshake]) -> None:
        self._parts = list(parts)
        self._by_rank = {rank: part for part in self._parts for rank in part.ranks}
        self._done: dict[int, HandshakeComplete] = {}
        self._complete = False

    @property
    def ranks(self) -> list[int]:
        return sorted(self._by_rank)

    @property
    def connected(self) -> list[int]:
        return sorted(r for p in self._parts for r in p.connected)

    @property
    def ready(self) -> list[int]:
        return sorted(r for p in self._parts for r in p.ready)

    @property
    def responded(self) -> list[int]:
        return sorted(r for p in self._parts for r in p.responded)

    @property
    def handshake_socket_done(self) -> bool:
        return all(p.handshake_socket_done for p in self._parts)

    def describe_waiting(self) -> str:
        waiting = [p.describe_waiting() for p in self._parts]
        busy = [w for w in waiting if w != "nothing (handshake complete)"]
        return "; ".join(busy) if busy else waiting[0]

    def _part(self, identity: bytes) -> ClientHandshake:
        try:
            return self._by_rank.get(rank_for_identity(identity), self._parts[0])
        except ProtocolError:
            return self._parts[0]  # it words the error for the bad identity

    def receive_handshake(self, identity: bytes, payload: bytes) -> list[HandshakeEvent]:
        part = self._part(identity)
        return self._merge(part, part.receive_handshake(identity, payload))

    def receive_input(self, identity: bytes, payload: bytes) -> list[HandshakeEvent]:
        part = self._part(identity)
        return self._merge(part, part.receive_input(identity, payload))

    def _merge(self, part: ClientHandshake, events: list[HandshakeEvent]) -> list[HandshakeEvent]:
        kept: list[HandshakeEvent] = []
        for event in events:
            if isinstance(event, HandshakeComplete):
                self._done[id(part)] = event
            else:
                kept.append(event)
        if self._complete or len(self._done) < len(self._parts):
            return kept
        versions = {done.vllm_version for done in self._done.values()}
        if len(versions) > 1:
            raise ProtocolError(
                f"engines report different vLLM versions: {sorted(map(str, versions))}"
            )
        self._complete = True
        responses: dict[int, Mapping[str, Any]] = {}
        for done in self._done.values():
            responses.update(done.ready_responses)
        kept.append(HandshakeComplete(dict(sorted(responses.items())), versions.pop()))
        return kept


@contextlib.asynccontextmanager
async def open_client(
    engines: EngineSource | Sequence[EngineSource],
    *,
    ready_timeout: float | None = None,
    profile: ProtocolProfile | str | None = None,
    allow_insecure_serialization: bool = False,
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE,
    stream_buffer: int = 64,
    on_progress: Callable[[StartupProgress], None] | None = None,
    on_engine_death: Literal["fail", "continue"] = "fail",
    waves: bool = False,
    vocab_size: int | None = None,
) -> AsyncIterator[EngineCoreClient]:
    """Start (or wait for) engines, handshake with them, and yield a client.

    Args:
        engines: a :class:`ReferenceEngines`, :class:`VllmEngines` or
            :class:`ExternalEngines`, or a list of them whose ranks do not overlap
            (data parallel over several sources and hosts; each source's engines get
            the addresses of its own layout, e.g. its own host).
        ready_timeout: seconds to wait for every engine to be ready (default
            ``VLLM_ENGINE_READY_TIMEOUT_S`` or 600).
        profile: pin the protocol profile (a profile object or a vLLM version string)
            instead of taking it from the engines' ready responses.
        allow_insecure_serialization: accept pickle payloads from engines.
        shutdown_grace: seconds between SIGTERM and SIGKILL for spawned engines.
        stream_buffer: default per-stream buffer before coalescing.
        on_progress: called (synchronously) on every startup step.
        on_engine_death: ``"fail"`` (default, as vLLM): one rank's death makes the
            client dead, the error naming the rank. ``"continue"``: only that rank's
            requests and utility calls fail (:class:`EngineDeadError` with its
            ``rank``), new requests go to the surviving ranks, an
            :class:`EngineEvent` ``"rank_lost"`` is queued; the client dies when the
            last rank does.
        waves: play the DP coordinator's wave role for MoE engines (PROTOCOL.md
            §7.4/§7.5): wake idle ranks with START_DP_WAVE when a request goes to one
            of them, follow ``wave_complete``/``start_wave``. Only for engines that
            run DP waves (without a coordinator); others log each START_DP_WAVE.
        vocab_size: the model's vocabulary size, when known: a request holding a
            token id at or above it (prompt, ``allowed_token_ids``, ``logit_bias``,
            stop ids, ...) is refused with ``ValueError`` before it is sent, since a
            stock engine core dies of such an id.

    Raises:
        TypeError, ValueError: a bad argument (named in the message), before any
            socket is bound or process started.
        EngineStartupError: an engine exited during startup (exit code and its last
            output lines in the message), the handshake failed (the
            :class:`ProtocolError` chained), or ``ready_timeout`` passed.

    On exit, by return, exception or cancellation: the client is dead (pending calls
    raise :class:`EngineDeadError`), every task has ended, spawned engines got
    SIGTERM, ``shutdown_grace`` seconds, then SIGKILL and were reaped, every socket is
    closed and the ipc directory is removed. Exceptions from the body propagate as
    they are (never wrapped in an exception group).
    """
    _args.check_open_client(
        engines,
        ready_timeout_s=ready_timeout,
        profile=profile,
        allow_insecure_serialization=allow_insecure_serialization,
        shutdown_grace=shutdown_grace,
        stream_buffer=stream_buffer,
        on_progress=on_progress,
        on_engine_death=on_engine_death,
        waves=waves,
        vocab_size=vocab_size,
    )
    timeout = _args.ready_timeout(ready_timeout)
    shutdown_grace = float(shutdown_grace)
    source_set = _SourceSet(engines)
    layouts = [source.layout() for source in source_set.sources]
    ranks = source_set.ranks
    context: zmq.Context[Any] = zmq.Context(io_threads=2)
    ipc_dir = PrivateIpcDir()
    sockets: list[AsyncSocket] = []
    processes: list[EngineProcess] = []
    client: EngineCoreClient | None = None
    body_error: BaseException | None = None
    unbounded: dict[int, int | bytes | str] = {zmq.RCVHWM: 0, zmq.SNDHWM: 0}
    try:
        monitor_socket: AsyncSocket | None = None
        watched: dict[str, list[int]] = {}
        if any(layout.watch_disconnects for layout in layouts):
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
        # One input ROUTER and one output PULL serve every engine (ROUTER routes by
        # identity whatever endpoint a peer came through); each source's engines are
        # given endpoints bound where they can reach them. Watched (external) sources
        # get endpoints of their own so that a dropped connection names its ranks.
        data: dict[tuple[str | None, str | None, int], tuple[str, str, str]] = {}
        handshake_binds: dict[str, str] = {}
        parts: list[ClientHandshake] = []
        source_handshakes: list[str] = []
        for index, (source, layout) in enumerate(zip(source_set.sources, layouts, strict=True)):
            own = index if layout.watch_disconnects else -1
            key = (layout.data_host, layout.data_bind_host, own)
            if key not in data:
                n = len(data)
                data[key] = _bind_data(input_socket, output_socket, layout, ipc_dir, str(n or ""))
            bound_in, source_input, source_output = data[key]
            if layout.watch_disconnects:
                watched.setdefault(bound_in, []).extend(source.ranks)
            wanted = layout.handshake_bind or "ipc"
            if wanted in handshake_binds and not wanted.endswith(":0"):
                source_handshake = handshake_binds[wanted]
            else:
                if layout.handshake_bind is None:
                    source_handshake = _bind(
                        handshake_socket, ipc_dir.endpoint("handshake"), "handshake"
                    )
                else:
                    source_handshake = _bind(handshake_socket, layout.handshake_bind, "handshake")
                    if layout.data_host is not None:
                        source_handshake = _advertised(source_handshake, layout.data_host)
                handshake_binds[wanted] = source_handshake
            source_handshakes.append(source_handshake)
            parts.append(
                ClientHandshake(
                    source.ranks,
                    inputs=[source_input],
                    outputs=[source_output],
                    expect_local=layout.expect_local,
                    expect_headless=layout.expect_headless,
                )
            )
        first_data = next(iter(data.values()))
        input_address, output_address = first_data[1], first_data[2]
        handshake_address = source_handshakes[0]
        startup = _Startup(
            handshake=_Handshakes(parts),
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

                for source, source_handshake in zip(
                    source_set.sources, source_handshakes, strict=True
                ):
                    try:
                        processes.extend(await source.spawn(source_handshake))
                    except OSError as exc:
                        raise EngineStartupError(
                            f"cannot start {source.describe()}: {exc}. Check the python "
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
                        source_set,
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
                        f"cannot talk to {source_set.describe()}: {exc}. Pin a profile with "
                        "open_client(profile=...) only if you know the wire layout matches."
                    ) from exc
                wire.set_limits(complete.ready_responses)
                wire.vocab_size = vocab_size
                client = EngineCoreClient(
                    input_socket=input_socket,
                    ranks=ranks,
                    ready_responses=complete.ready_responses,
                    wire=wire,
                    stream_buffer=stream_buffer,
                    on_engine_death=on_engine_death,
                    waves=waves,
                )
                client._processes = list(processes)
                client._endpoint_ranks = watched
                client._context = context
                client._ipc_dir = ipc_dir
                client._sockets = sockets
                client._task_group = tg
                client._data = data
                client._watching = monitor_socket is not None
                client._output_socket = output_socket
                client._shutdown_grace = shutdown_grace
                client._addresses = {
                    "input": input_address,
                    "output": output_address,
                    "handshake": handshake_address,
                }
                for i, (_bound, advertised_in, advertised_out) in enumerate(data.values()):
                    if i:
                        client._addresses[f"input{i}"] = advertised_in
                        client._addresses[f"output{i}"] = advertised_out
                for i, source_handshake in enumerate(source_handshakes):
                    if i:
                        client._addresses[f"handshake{i}"] = source_handshake
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
                # The client's list also holds engines added by add_engines.
                await _stop_processes(
                    processes if client is None else client._processes, shutdown_grace
                )
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
