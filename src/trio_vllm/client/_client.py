"""The structured-concurrency engine-core client: `open_client` and its client.

`EngineCoreClient` is an I/O shell over the sans-I/O
`ClientSession`, which holds every rule (ranks,
requests, utility calls, death, waves, routing). The shell owns the sockets and
tasks and carries out the session's actions.

One task group, owned by the `open_client` context manager, holds every task
the client runs: the handshake (during startup and each join), one receive task on
the output socket, a guard on the input socket (engines must not send there after
their ready response; a joining engine's ready response is handed to its join), and
one watcher per spawned engine process. Nothing else runs in the background and
nothing outlives the ``async with`` block.

Tasks never raise into the group for engine trouble: an engine exit, an
``ENGINE_CORE_DEAD`` frame, an undecodable frame or a broken socket moves the client to
the *dead* state, which wakes every waiter at once with
`EngineDeadError` (the cause chained) and makes every later call
raise it too. A death noticed outside the output stream (a send that found no peer, a
dropped connection, a process exit) is declared only after the receive task drained
what the engine sent before, so those outputs reach their streams first. The body of
the ``async with`` is never cancelled by the client.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, Unpack, final

import anyio
import anyio.abc
import anyio.lowlevel

from .._exceptions import (
    EngineDeadError,
    EngineStartupError,
    InvalidRequestError,
    ProtocolError,
)
from ..protocol.liveness import STALL_PROBE, heartbeat_timing
from ..protocol.session import (
    ClientSession,
    Died,
    EmitEvent,
    EngineEvent,
    FailCall,
    FailRequest,
    QueueRaw,
    RankDrained,
    ResolveCall,
    SendWave,
)
from ..protocol.structs import EngineCoreOutput, EngineCoreRequest, FinishReason
from . import _args
from ._calls import call_all, call_one
from ._cancel import backend_pending
from ._engines import check_sources
from ._liveness import watch_stalls
from ._mailbox import Mailbox
from ._options import ClientOptions, resolve_options
from ._owner import LoopOwner
from ._owner import get_ident as _get_ident
from ._owner import get_running_loop as _get_running_loop
from ._owner import sniffio_local as _sniffio
from ._receiver import Receiver
from ._scaling import Scaling
from ._sender import Sender
from ._startup import (
    DEFAULT_READY_TIMEOUT,
    Sockets,
    SourceSet,
    StartupProgress,
    connect_engines,
    default_ready_timeout,
    stop_processes,
)
from ._streams import RequestStream
from ._utilities import NamedUtilities, NamedUtility, combine_results, wire_args
from ._wire import Wire

if TYPE_CHECKING:
    from collections.abc import (
        AsyncIterator,
        Awaitable,
        Callable,
        Coroutine,
        Iterable,
        Mapping,
        Sequence,
    )

    from ..protocol.profiles import ProtocolProfile
    from ..protocol.session import DeathRecord
    from ..protocol.structs import EngineCoreOutputs
    from ._engines import EngineSource
    from ._process import EngineProcess
    from ._types import Session, ShellAction

__all__ = [
    "DEFAULT_READY_TIMEOUT",
    "EngineCoreClient",
    "EngineEvent",
    "EngineEvents",
    "StartupProgress",
    "open_client",
]

R = TypeVar("R")
_default_ready_timeout = default_ready_timeout  # the name tests and callers know

logger = logging.getLogger("trio_vllm.client")


class EngineEvents(Mailbox[EngineEvent]):
    """The client's channel of `EngineEvent`: ``async for event in
    client.engine_events`` or ``await client.engine_events.receive()``.

    Unbounded (the events are rare); iteration ends, and ``receive`` raises
    ``anyio.EndOfStream``, once the client is closed or dead and the queue is empty.
    Cancellation: a cancelled ``receive`` consumes nothing.
    """

    def __aiter__(self) -> EngineEvents:
        return self


class _Controls:
    """What `open_client`, the client's owner, drives of the client it made: filled by
    `EngineCoreClient` when it is built (its tasks, its exit and close steps)."""

    __slots__ = ("apply", "on_process_exit", "receiver", "stall_watch")

    def __init__(self) -> None:
        self.stall_watch: Callable[[], Coroutine[object, object, None]] | None = None
        self.receiver: Receiver | None = None
        self.apply: Callable[[list[ShellAction]], None] | None = None
        self.on_process_exit: Callable[[EngineProcess], None] | None = None


@dataclass(frozen=True, slots=True)
class _Parts:
    """Everything a client is made of, gathered by `open_client`."""

    session: Session
    sockets: Sockets
    wire: Wire
    ready_responses: Mapping[int, Mapping[str, object]]
    processes: list[EngineProcess]
    task_group: anyio.abc.TaskGroup
    stream_buffer: int
    shutdown_grace: float
    addresses: dict[str, str]
    controls: _Controls
    hang_timeout: float | None = None
    stall_timeout: float | None = None


@final
class EngineCoreClient(NamedUtilities):
    """A connection to one or more engine cores; created only by `open_client`.

    Two layers of API:

    * per-request streams: ``async with client.generate(request) as stream`` then
      ``async for output in stream``; leaving the block before the final output
      (break, exception, cancellation) aborts the request on the engine;
    * raw parity with vLLM's ``EngineCoreClient``: `add_request`,
      `get_output`, `abort_requests`, `call_utility`,
      `call_utility_all` and the named utilities (``sleep``, ``wake_up``,
      ``profile``, ``collective_rpc``, ...; see ``_utilities.py``).

    Every method raises `EngineDeadError` once an engine died or
    the client was closed. Cancelling one caller never affects another. The client
    belongs to the event loop and thread that opened it: every public method raises
    ``RuntimeError`` when called from another, before anything is sent (``_owner.py``).
    """

    def __init__(self, parts: _Parts) -> None:
        # Every public method refuses other threads and loops first (_owner.py).
        self._owner = LoopOwner()
        self._session = parts.session
        self._sockets = parts.sockets
        self._input = parts.sockets.input
        self._wire = parts.wire
        self._ready_responses = {r: dict(v) for r, v in parts.ready_responses.items()}
        self._processes = parts.processes
        self._stream_buffer = parts.stream_buffer
        self._addresses = parts.addresses
        self._events = EngineEvents()
        self._raw: Mailbox[EngineCoreOutputs] = Mailbox()
        # Bound once: one call each per message (apply) and per batch (get_output).
        self._queue_raw = self._raw.put_nowait
        self._raw_take_now = self._raw.take_now
        # Probe the backend's cancel state now (once per process: anyio's version is a
        # metadata lookup of ~10-20 ms), not in the first buffered receive.
        backend_pending()
        self._dead_event = anyio.Event()
        self._receiver = Receiver(
            self._session,
            self._sockets,
            self._wire,
            self._apply,
            self._raw.put_many,
            lambda: self._scaling.join,
            processes=self._processes,
            hang_timeout=parts.hang_timeout,
        )
        self._stall_timeout = parts.stall_timeout
        self._drain_after_exit = self._receiver.drain_after_exit
        self._sender = Sender(self._input, self._session, self._wire, self._receiver.wake)
        self._scaling = Scaling(
            session=self._session,
            sockets=self._sockets,
            wire=self._wire,
            processes=self._processes,
            ready_responses=self._ready_responses,
            task_group=parts.task_group,
            shutdown_grace=parts.shutdown_grace,
            check_alive=self._check_alive,
            apply=self._apply,
            abort_requests=self.abort_requests,
            on_process_exit=self._on_process_exit,
        )
        controls = parts.controls
        controls.receiver = self._receiver
        controls.apply = self._apply
        controls.on_process_exit = self._on_process_exit
        controls.stall_watch = self._watch_stalls if parts.stall_timeout is not None else None

    async def _watch_stalls(self) -> None:
        assert self._stall_timeout is not None

        def probe(rank: int) -> Awaitable[object]:
            return self.call_utility(STALL_PROBE, rank=rank)

        await watch_stalls(self._session, self._stall_timeout, probe, self._receiver.wake)

    # ------------------------------------------------------------------ properties

    @property
    def ranks(self) -> list[int]:
        """Data-parallel ranks of the engines behind this client."""
        return self._session.ranks

    @property
    def live_ranks(self) -> list[int]:
        """Ranks new requests can go to: not lost (``on_engine_death="continue"``)
        and not retired."""
        return self._session.live_ranks

    @property
    def lost_ranks(self) -> dict[int, str]:
        """Rank -> why it is gone, for ranks lost while the client kept running."""
        return self._session.lost_ranks

    @property
    def engine_events(self) -> EngineEvents:
        """Unsolicited engine notices and rank losses, in arrival order.

        Elastic-EP (call id -1) and fault-tolerance (call id -2) messages are never
        matched against utility calls; they arrive here as `EngineEvent`. The
        buffer is unbounded (these are rare); iteration ends when the client closes.
        """
        return self._events

    @property
    def in_flight(self) -> dict[int, int]:
        """Rank -> requests of this client in flight there (the routing load)."""
        return {r: self._session.in_flight(r) for r in self._session.ranks}

    _in_flight = in_flight

    @property
    def current_wave(self) -> int | None:
        """The DP wave the client believes current (``None`` without ``waves=True``)."""
        return self._session.current_wave

    @property
    def waves_started(self) -> int:
        """How many waves the client started or saw start (0 without ``waves=True``)."""
        return self._session.waves_started

    @property
    def ready_responses(self) -> dict[int, dict[str, object]]:
        """Each engine's EngineCoreReadyResponse (a plain map; keys vary by version)."""
        return {r: dict(v) for r, v in self._ready_responses.items()}

    @property
    def vllm_version(self) -> str | None:
        """The ``vllm_version`` the engines reported (``None`` if they did not say)."""
        return self._wire.vllm_version

    @property
    def protocol_profile(self) -> ProtocolProfile:
        """The protocol profile in use (from the ready response or pinned)."""
        return self._wire.profile

    @property
    def max_model_len(self) -> int | None:
        """The smallest ``max_model_len`` any engine reported, if any did."""
        return self._wire.max_model_len

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
        return self._session.dead

    @property
    def pending_utility_calls(self) -> int:
        """Utility calls awaiting a reply (for diagnostics and tests)."""
        return self._session.pending_calls

    @property
    def live_requests(self) -> list[str]:
        """Request ids the client considers running (streams and raw requests)."""
        return self._session.live_requests

    def dead_error(self) -> EngineDeadError | None:
        """A fresh copy of the error calls raise once dead (``None`` while alive)."""
        return self._session.dead_error() if self.dead else None

    async def wait_dead(self) -> EngineDeadError:
        """Wait until the client is dead; return the error calls raise from then on."""
        self._owner.check("wait_dead")
        await self._dead_event.wait()
        return self._session.dead_error()

    # ------------------------------------------------------------------ actions

    def _check_alive(self) -> None:
        if self._session.dead:
            raise self._session.dead_error()

    def _apply(self, actions: list[ShellAction]) -> None:
        """Carry out the session's actions, in order (synchronous)."""
        for action in actions:
            if type(action) is tuple:  # Deliver, the hot path: one per output
                action[0].deliver(action[1])
            elif type(action) is QueueRaw:
                self._queue_raw(action.outputs)
            elif isinstance(action, ResolveCall):
                call = action.handle
                call.failure, call.result = action.failure, action.result
                call.event.set()
            elif isinstance(action, FailCall):
                call = action.handle
                call.record = action.record
                call.event.set()
            elif isinstance(action, FailRequest):
                action.handle.fail(action.record.error)
            elif isinstance(action, EmitEvent):
                if action.event.kind == "rank_lost":
                    logger.warning(
                        "engine rank %s lost: %s", action.event.rank, action.event.payload
                    )
                self._events.put_nowait(action.event)
            elif isinstance(action, SendWave):
                start = action.start
                logger.debug(
                    "START_DP_WAVE %d (exclude %s) to %s", start.wave, start.exclude, start.ranks
                )
                frames = self._wire.encode_start_dp_wave(start.wave, start.exclude)
                for target in start.ranks:
                    self._sender.send_nowait_best_effort(target, frames)
            elif isinstance(action, RankDrained):
                self._scaling.rank_drained(action.rank)
            elif isinstance(action, Died):
                self._on_died(action.record)

    def _on_died(self, record: DeathRecord) -> None:
        if self._receiver.closing:
            logger.info("client closed")
        else:
            logger.warning("client dead: %s (cause: %r)", record.message, record.cause)
        self._raw.end(record.error)
        self._events.end()
        self._dead_event.set()
        self._scaling.client_died(record)

    def _on_process_exit(self, process: EngineProcess) -> None:
        if self._session.notice_exit(process.ranks, process.describe_exit()):
            logger.info("engine process %s (ranks %s) exited", process.name, process.ranks)
            self._receiver.wake()

    # ------------------------------------------------------------------ requests

    def _prepare(
        self, request: EngineCoreRequest, rank: int | None
    ) -> tuple[str, int, list[bytes]]:
        """Check and encode a new request: (id, target rank, frames); raises before
        anything is sent or registered."""
        self._check_alive()
        request_id = self._wire.request_id(request)
        self._session.check_new(request_id)
        self._wire.validate_request(request)
        pinned = rank if rank is not None else getattr(request, "data_parallel_rank", None)
        target = self._session.choose_rank(pinned)
        return request_id, target, self._wire.encode_add(request)

    async def add_request(self, request: EngineCoreRequest, *, rank: int | None = None) -> None:
        """Send an EngineCoreRequest; its outputs come from `get_output`.

        Raises ``ValueError`` before anything is sent if the request is invalid or its
        id is live on this client. Cancellation: if cancelled, nothing was sent and the
        id is free again.
        """
        self._owner.check("add_request")
        request_id, target, frames = self._prepare(request, rank)
        self._session.start_request(request_id, target)
        try:
            await self._sender.send(target, frames, request_id=request_id)
        except BaseException:
            self._apply(self._session.end_request(request_id))
            raise
        self._apply(self._session.request_sent(target))

    async def get_output(self) -> EngineCoreOutputs:
        """Wait for the next EngineCoreOutputs batch for raw requests (vLLM's get_output).

        Batches carry the outputs of requests sent with `add_request` (stream
        outputs are routed to their streams), plus scheduler stats and wave events
        while the raw API is in use (a raw request live, a call waiting, or one in
        the last 2 s). Utility replies never appear here. Batches are queued without
        bound, as in vLLM; consume them. Cancellation: nothing is consumed by a
        cancelled call. Raises `EngineDeadError` once dead and the
        queue is empty.

        Scheduling: while batches are queued, a call yields to other tasks at most once
        per millisecond (it always checks for cancellation), so draining a backlog does
        not pay a full scheduler pass per batch.
        """
        owner = self._owner
        if (
            _get_ident() != owner.thread
            or _get_running_loop() is not owner.asyncio_loop
            or _sniffio.name != owner.library
        ):
            owner.check("get_output")  # LoopOwner.check inlined: it raises here
        session = self._session
        session.raw_called = True  # session.raw_api_used(), inlined: once per batch
        # The mailbox's buffered path without a coroutine of its own (one per batch):
        # the cancellation check passed and the batch taken in one call; None sends a
        # possibly cancelled call to the awaiting path (a cancelled call consumed nothing).
        item = self._raw_take_now()
        if item is not None:
            return item
        raw = self._raw
        if len(raw):  # nothing to wait for: no waiter to count
            return await raw.__anext__()  # never StopAsyncIteration: raw never ends
        session.raw_waiters += 1
        try:
            return await raw.__anext__()
        finally:
            session.raw_waiters -= 1

    def get_output_nowait(self) -> EngineCoreOutputs:
        """The next queued batch, or ``anyio.WouldBlock``; not a checkpoint."""
        self._owner.check("get_output_nowait")
        self._session.raw_called = True  # session.raw_api_used(), inlined
        return self._raw.receive_nowait()

    async def abort_requests(self, request_ids: Iterable[str], *, rank: int | None = None) -> None:
        """Abort requests by id (vLLM's abort_requests).

        Known ids are finished locally at once (a stream stops iterating with
        ``aborted`` set) and the ABORT goes to the engine serving each; unknown ids are
        sent to ``rank`` or to every engine (aborting is idempotent). The engine sends
        no output for a client-initiated abort.

        Cancellation: the one checkpoint comes first; once past it the requests are
        forgotten locally and every ABORT is queued without another checkpoint, so a
        cancelled call changed nothing and a completed one reached every owner.
        Raises ``TypeError``/``ValueError`` (a non-string or unencodable id, an unknown
        ``rank``) before changing anything.
        """
        self._owner.check("abort_requests")
        self._check_alive()
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            if not isinstance(request_id, str):
                raise TypeError(f"request ids are strings, got {request_id!r}")
        if rank is not None:
            # A bad explicit rank is refused even when every id is known (the session
            # checks it only when an unknown id needs it).
            self._session.choose_rank(rank)
        self._wire.encode_abort(ids)  # refuses unencodable ids before anything changes
        await anyio.lowlevel.checkpoint()
        self._check_alive()
        aborted = self._session.abort(ids, rank)
        for stream in aborted.streams:
            stream.abort_locally()
        self._apply(aborted.actions)
        for target, rank_ids in aborted.by_rank.items():
            await self._sender.send_abort(target, rank_ids)

    @contextlib.asynccontextmanager
    async def generate(
        self, request: EngineCoreRequest, *, rank: int | None = None, max_pending: int | None = None
    ) -> AsyncIterator[RequestStream]:
        """Send ``request`` and yield a `RequestStream` of its outputs.

        Leaving the block before the final output (``break``, an exception,
        cancellation) sends ABORT for the request, without a checkpoint, so it also
        works in cancelled code. ``max_pending`` bounds the stream's buffer (see
        `trio_vllm.client._streams` on coalescing). Raises ``ValueError`` before
        anything is sent for an invalid request or a live duplicate id, and for a
        ``max_pending`` that is not an int >= 1.
        """
        self._owner.check("generate")
        _args.check_max_pending(max_pending)
        request_id, target, frames = self._prepare(request, rank)
        stream = RequestStream(
            request_id,
            target,
            max_pending=max_pending or self._stream_buffer,
            budget=self._receiver.budget,
        )
        self._session.start_request(request_id, target, stream)
        sent = False
        try:
            await self._sender.send(target, frames, request_id=request_id)
            sent = True
            self._apply(self._session.request_sent(target))
            yield stream
        finally:
            self._apply(self._session.end_request(request_id))
            if sent and not stream.finished:
                stream.aborted = True
                await self._sender.send_abort(target, [request_id])

    async def encode(
        self, request: EngineCoreRequest, *, rank: int | None = None
    ) -> EngineCoreOutput:
        """Send a pooling request and return its final output (vLLM's ``encode``).

        ``request.pooling_params`` must be set (`make_pooling_request` builds one); the
        result's ``pooling_output`` is the tensor the engine pooled (an embedding
        ``[hidden]``, per-token rows ``[tokens, hidden]``, class scores...), its
        ``finish_reason`` STOP. The first call asks an engine for its supported tasks
        (``get_supported_tasks``, once per client): a task the model does not run
        would kill a stock engine, so it is refused here with vLLM's message.

        A request aborted (by the engine, or by `abort_requests` from another task)
        returns an output with ``finish_reason`` ABORT (or ERROR) and no
        ``pooling_output``. Raises `InvalidRequestError` (a ``ValueError``) before
        anything is sent for an invalid request, `EngineDeadError` if the engines die.
        Cancellation: the request is aborted on the engine (as leaving `generate`
        early); a cancelled first call may have cached the supported tasks, nothing else.
        """
        self._owner.check("encode")
        if getattr(request, "pooling_params", None) is None:
            raise InvalidRequestError(
                "encode needs an EngineCoreRequest with pooling_params set "
                "(make_pooling_request); use generate for sampling requests",
                field="pooling_params",
            )
        if self._wire.supported_tasks is None:
            tasks = await self.get_supported_tasks()
            self._wire.supported_tasks = frozenset(str(t) for t in tasks)
        last: EngineCoreOutput | None = None
        async with self.generate(request, rank=rank) as stream:
            async for output in stream:
                last = output
        if last is None or last.finish_reason is None:  # aborted by the client
            return EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ABORT)
        return last

    # ------------------------------------------------------------------ utilities

    async def call_utility(self, method: str, *args: object, rank: int | None = None) -> object:
        """Call ``method(*args)`` on one engine (``rank``, else the least busy) and return
        its result.

        Raises `UtilityCallError` with the engine's message if the
        method failed there, `EngineDeadError` if the engine dies
        (or its rank is retired) first. Cancellation: the pending entry is removed; a
        reply that arrives later is dropped quietly.
        """
        self._owner.check("call_utility")
        self._check_alive()
        return await call_one(self._session, self._wire, self._sender, method, list(args), rank)

    async def call_utility_all(
        self, method: str, *args: object, return_exceptions: bool = False
    ) -> list[object]:
        """Call ``method(*args)`` on every live engine concurrently; results in rank
        order (of `live_ranks`).

        If any call fails, the first failure by rank is raised (an
        `EngineDeadError` takes precedence) after all calls ended.
        With ``return_exceptions=True`` nothing is raised for engine-side trouble:
        each rank's entry is its result or its `TrioVllmError`
        (`UtilityCallError`, `EngineDeadError`).
        Cancellation cancels every call.
        """
        self._owner.check("call_utility_all")
        self._check_alive()

        def call(rank: int) -> Awaitable[object]:
            return self.call_utility(method, *args, rank=rank)

        return await call_all(call, self._session.live_ranks, return_exceptions=return_exceptions)

    async def run_named_utility(self, spec: NamedUtility[..., R], args: list[object]) -> R:
        """Run one row of the utilities table (``_utilities.py``) with its user
        arguments: what every named utility method (``sleep``, ``profile``, ...) calls,
        so this is where it refuses a foreign caller. Call those methods instead."""
        self._owner.check(spec.name)
        args = wire_args(spec, args, self._wire.profile)
        if spec.fan_out == "one":
            return combine_results(spec, [await self.call_utility(spec.name, *args)])
        return combine_results(spec, await self.call_utility_all(spec.name, *args))

    # ------------------------------------------------------------------ scaling

    async def retire_rank(self, rank: int, *, drain: bool = True) -> None:
        """Scale down: stop routing to ``rank``, finish or abort its requests, stop it.

        New requests go elsewhere at once. With ``drain`` the call waits until every
        request already on the rank finished; without, they are aborted (streams stop
        with ``aborted`` set, the engine gets ABORT). Then a process this client
        spawned for that rank alone is stopped (SIGTERM, grace, SIGKILL); an external
        engine is left running, unused. Utility calls still pending on the rank fail
        with `EngineDeadError`. An `EngineEvent`
        ``"rank_retired"`` follows. Cancellation while draining: the rank stays out of
        routing and its requests keep running. Raises ``ValueError`` for an unknown or
        gone rank or the last live rank. A rank that dies while draining is a death as
        usual (the client dies, or with ``on_engine_death="continue"`` its requests
        fail), and this call raises `EngineDeadError`.
        """
        self._owner.check("retire_rank")
        await self._scaling.retire(rank, drain)

    async def add_engines(
        self, source: EngineSource, *, ready_timeout: float | None = None
    ) -> list[int]:
        """Scale up: start (or wait for) ``source``'s engines and add their ranks.

        The new engines do the same handshake as at startup (with a handshake socket
        of their own, closed afterwards) and must report the same vLLM version. Their
        ranks must be new to this client. Returns the added ranks; they get requests
        at once. External engines can join only a client that started with an external
        source (their connections are watched by the same monitor). Raises
        `EngineStartupError` if an engine exits, the handshake fails
        or ``ready_timeout`` passes, `EngineDeadError` as soon as
        the client dies meanwhile; then, and on cancellation, spawned engines are
        stopped and nothing changed (the ranks stay reserved: a late answer from them
        is dropped quietly). Only one call at a time. A bad argument raises
        ``TypeError``/``ValueError`` naming it before any process starts.
        """
        self._owner.check("add_engines")
        return await self._scaling.add(source, ready_timeout)


@contextlib.asynccontextmanager
async def open_client(
    engines: EngineSource | Sequence[EngineSource], **options: Unpack[ClientOptions]
) -> AsyncIterator[EngineCoreClient]:
    """Start (or wait for) engines, handshake with them, and yield a client.

    Args:
        engines: a `ReferenceEngines`, `VllmEngines` or
            `ExternalEngines`, or a list of them whose ranks do not overlap
            (data parallel over several sources and hosts; each source's engines get
            the addresses of its own layout, e.g. its own host).
        **options: the `ClientOptions` (``ready_timeout``, ``profile``,
            ``allow_insecure_serialization``, ``shutdown_grace``, ``stream_buffer``,
            ``on_progress``, ``on_engine_death``, ``waves``, ``vocab_size``,
            ``hang_timeout``, ``stall_timeout``), each documented there.

    Raises:
        TypeError, ValueError: a bad argument or an unknown keyword (named in the
            message), before any socket is bound or process started.
        EngineStartupError: an engine exited during startup (exit code and its last
            output lines in the message), the handshake failed (the
            `ProtocolError` chained), or ``ready_timeout`` passed.

    On exit, by return, exception or cancellation: the client is dead (pending calls
    raise `EngineDeadError`), every task has ended, spawned engines got
    SIGTERM, ``shutdown_grace`` seconds, then SIGKILL and were reaped, every socket is
    closed and the ipc directory is removed. Exceptions from the body propagate as
    they are (never wrapped in an exception group).
    """
    check_sources(engines)
    resolved = resolve_options(options)
    timeout = resolved["ready_timeout"]
    assert timeout is not None  # resolved: the caller's, the environment's or 600 s
    shutdown_grace = resolved["shutdown_grace"]
    on_progress = resolved["on_progress"]
    on_engine_death = resolved["on_engine_death"]
    profile = resolved["profile"]
    source_set = SourceSet(engines)
    session: Session = ClientSession(
        source_set.ranks, on_engine_death=on_engine_death, waves=resolved["waves"]
    )
    hang_timeout = resolved["hang_timeout"]
    sockets = Sockets(
        watch_disconnects=any(lay.watch_disconnects for lay in source_set.layouts),
        heartbeat=None if hang_timeout is None else heartbeat_timing(hang_timeout),
    )
    processes: list[EngineProcess] = []
    controls = _Controls()
    body_error: BaseException | None = None
    try:

        def on_exit(process: EngineProcess) -> None:
            if controls.on_process_exit is not None:
                controls.on_process_exit(process)

        async with anyio.create_task_group() as tg:
            try:
                connected = await connect_engines(
                    sockets,
                    source_set,
                    processes=processes,
                    task_group=tg,
                    on_exit=on_exit,
                    input_socket=sockets.input,
                    ready_timeout=timeout,
                    on_progress=on_progress,
                )
                for bound_input, ranks in connected.watched:
                    sockets.watch(bound_input, ranks)
                try:
                    wire = Wire.create(
                        profile=profile,
                        vllm_version=connected.complete.vllm_version,
                        allow_insecure_serialization=resolved["allow_insecure_serialization"],
                    )
                except ProtocolError as exc:
                    raise EngineStartupError(
                        f"cannot talk to {source_set.describe()}: {exc}. Pin a profile with "
                        "open_client(profile=...) only if you know the wire layout matches."
                    ) from exc
                wire.client_index = source_set.sources[0].client_index
                wire.client_count = source_set.sources[0].client_count
                wire.set_limits(connected.complete.ready_responses)
                wire.vocab_size = resolved["vocab_size"]
                client = EngineCoreClient(
                    _Parts(
                        session=session,
                        sockets=sockets,
                        wire=wire,
                        ready_responses=connected.complete.ready_responses,
                        processes=processes,
                        task_group=tg,
                        stream_buffer=resolved["stream_buffer"],
                        shutdown_grace=shutdown_grace,
                        addresses=sockets.addresses(connected.handshakes),
                        controls=controls,
                        hang_timeout=hang_timeout,
                        stall_timeout=resolved["stall_timeout"],
                    )
                )
                # An engine may have exited between READY and now.
                for process in processes:
                    if process.exited.is_set():
                        on_exit(process)
                receiver = controls.receiver
                assert receiver is not None
                tg.start_soon(receiver.receive_loop)
                tg.start_soon(receiver.guard_input)
                if controls.stall_watch is not None:
                    tg.start_soon(controls.stall_watch)
                yield client
            except BaseException as exc:
                body_error = exc
            finally:
                if controls.receiver is not None and controls.apply is not None:
                    controls.receiver.closing = True
                    controls.apply(session.close())
                # The list also holds engines added by add_engines.
                await stop_processes(processes, shutdown_grace)
                tg.cancel_scope.cancel()
    finally:
        sockets.close()
    if body_error is not None:
        raise body_error
