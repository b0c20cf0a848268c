"""The structured-concurrency engine-core client: :func:`open_client` and its client.

:class:`EngineCoreClient` is an I/O shell over the sans-I/O
:class:`~trio_vllm.protocol.session.ClientSession`, which holds every rule (ranks,
requests, utility calls, death, waves, routing). The shell owns the sockets and
tasks and carries out the session's actions.

One task group, owned by the :func:`open_client` context manager, holds every task
the client runs: the handshake (during startup and each join), one receive task on
the output socket, a guard on the input socket (engines must not send there after
their ready response; a joining engine's ready response is handed to its join), and
one watcher per spawned engine process. Nothing else runs in the background and
nothing outlives the ``async with`` block.

Tasks never raise into the group for engine trouble: an engine exit, an
``ENGINE_CORE_DEAD`` frame, an undecodable frame or a broken socket moves the client to
the *dead* state, which wakes every waiter at once with
:class:`~trio_vllm.EngineDeadError` (the cause chained) and makes every later call
raise it too. A death noticed outside the output stream (a send that found no peer, a
dropped connection, a process exit) is declared only after the receive task drained
what the engine sent before, so those outputs reach their streams first. The body of
the ``async with`` is never cancelled by the client.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal, TypeVar, cast, final

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
from ..protocol.handshake import identity_for_rank, rank_for_identity
from ..protocol.session import (
    ClientSession,
    DeathRecord,
    Deliver,
    Died,
    EmitEvent,
    EngineEvent,
    FailCall,
    FailRequest,
    QueueRaw,
    RankDrained,
    RankState,
    ResolveCall,
    SendWave,
)
from ._mailbox import Mailbox
from ._startup import (
    DEFAULT_READY_TIMEOUT,
    DEFAULT_SHUTDOWN_GRACE,
    HandshakeRun,
    Sockets,
    SourceSet,
    StartupProgress,
    _bytes,
    default_ready_timeout,
    handshake_parts,
    start_engines,
    stop_processes,
)
from ._streams import RequestStream
from ._utilities import NamedUtilities, NamedUtility, combine_results, wire_args
from ._wire import Wire

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence

    from ..protocol.profiles import ProtocolProfile
    from ..protocol.session import Action
    from ..protocol.structs import EngineCoreOutputs, EngineCoreRequest
    from ..transport import AsyncSocket
    from ._engines import EngineSource
    from ._process import EngineProcess

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
# After a death noticed outside the output stream: drain the engine's last outputs until
# quiet this long, at most _EXIT_DRAIN_S, then declare it (inside the 100 ms promise).
_EXIT_QUIET_S: Final = 0.004
_EXIT_DRAIN_S: Final = 0.03

logger = logging.getLogger("trio_vllm.client")


class EngineEvents(Mailbox[EngineEvent]):
    """The client's channel of :class:`EngineEvent`: ``async for event in
    client.engine_events`` or ``await client.engine_events.receive()``.

    Unbounded (the events are rare); iteration ends, and ``receive`` raises
    ``anyio.EndOfStream``, once the client is closed or dead and the queue is empty.
    Cancellation: a cancelled ``receive`` consumes nothing.
    """

    def __aiter__(self) -> EngineEvents:
        return self


@dataclass(slots=True)
class _Call:
    event: anyio.Event
    failure: str | None = None
    result: object = None
    record: DeathRecord | None = None


@dataclass(frozen=True, slots=True)
class _Parts:
    """Everything a client is made of, gathered by :func:`open_client`."""

    session: ClientSession
    sockets: Sockets
    wire: Wire
    ready_responses: Mapping[int, Mapping[str, object]]
    processes: list[EngineProcess]
    task_group: anyio.abc.TaskGroup
    stream_buffer: int
    shutdown_grace: float
    addresses: dict[str, str]


@final
class EngineCoreClient(NamedUtilities):
    """A connection to one or more engine cores; created only by :func:`open_client`.

    Two layers of API:

    * per-request streams: ``async with client.generate(request) as stream`` then
      ``async for output in stream``; leaving the block before the final output
      (break, exception, cancellation) aborts the request on the engine;
    * raw parity with vLLM's ``EngineCoreClient``: :meth:`add_request`,
      :meth:`get_output`, :meth:`abort_requests`, :meth:`call_utility`,
      :meth:`call_utility_all` and the named utilities (``sleep``, ``wake_up``,
      ``profile``, ``collective_rpc``, ...; see ``_utilities.py``).

    Every method raises :class:`~trio_vllm.EngineDeadError` once an engine died or
    the client was closed. Cancelling one caller never affects another.
    """

    def __init__(self, parts: _Parts) -> None:
        self._session = parts.session
        self._sockets = parts.sockets
        self._input = parts.sockets.input
        self._wire = parts.wire
        self._ready_responses = {r: dict(v) for r, v in parts.ready_responses.items()}
        self._processes = parts.processes
        self._task_group = parts.task_group
        self._stream_buffer = parts.stream_buffer
        self._shutdown_grace = parts.shutdown_grace
        self._addresses = parts.addresses
        self._events = EngineEvents()
        self._raw: Mailbox[EngineCoreOutputs] = Mailbox()
        self._dead_event = anyio.Event()
        self._drained: dict[int, anyio.Event] = {}  # retire_rank waiters
        self._join: HandshakeRun | None = None  # one add_engines at a time
        self._closing = False
        self._receiving = False
        self._receive_scope: anyio.CancelScope | None = None

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
        matched against utility calls; they arrive here as :class:`EngineEvent`. The
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
        await self._dead_event.wait()
        return self._session.dead_error()

    # ------------------------------------------------------------------ actions

    def _check_alive(self) -> None:
        if self._session.dead:
            raise self._session.dead_error()

    def _apply(self, actions: list[Action]) -> None:
        """Carry out the session's actions, in order (synchronous)."""
        for action in actions:
            kind = type(action)
            if kind is Deliver:  # the hot path: one per output
                deliver = cast("Deliver", action)
                cast("RequestStream", deliver.handle)._deliver(deliver.output)
            elif kind is QueueRaw:
                self._raw._put(cast("QueueRaw", action).outputs)
            elif isinstance(action, ResolveCall):
                call = action.handle
                assert isinstance(call, _Call)
                call.failure, call.result = action.failure, action.result
                call.event.set()
            elif isinstance(action, FailCall):
                call = action.handle
                assert isinstance(call, _Call)
                call.record = action.record
                call.event.set()
            elif isinstance(action, FailRequest):
                stream = action.handle
                assert isinstance(stream, RequestStream)
                stream._fail(action.record.error)
            elif isinstance(action, EmitEvent):
                if action.event.kind == "rank_lost":
                    logger.warning(
                        "engine rank %s lost: %s", action.event.rank, action.event.payload
                    )
                self._events._put(action.event)
            elif isinstance(action, SendWave):
                start = action.start
                logger.debug(
                    "START_DP_WAVE %d (exclude %s) to %s", start.wave, start.exclude, start.ranks
                )
                frames = self._wire.encode_start_dp_wave(start.wave, start.exclude)
                for target in start.ranks:
                    self._send_nowait_best_effort(target, frames)
            elif isinstance(action, RankDrained):
                drained = self._drained.get(action.rank)
                if drained is not None:
                    drained.set()
            elif isinstance(action, Died):
                self._on_died(action.record)

    def _on_died(self, record: DeathRecord) -> None:
        if self._closing:
            logger.info("client closed")
        else:
            logger.warning("client dead: %s (cause: %r)", record.message, record.cause)
        self._raw._close(record.error)
        self._events._close()
        self._dead_event.set()
        for drained in self._drained.values():
            drained.set()
        if self._join is not None:
            self._join.fail(record.error())

    def _die(self, message: str, cause: BaseException | None = None) -> None:
        self._apply(self._session.rank_died(None, message, cause))

    def _wake_receiver(self) -> None:
        """A death was noticed: the receive task drains, then declares it; without a
        receive task running it is declared at once."""
        if not self._receiving:
            self._apply(self._session.declare_noticed())
        elif self._receive_scope is not None:
            self._receive_scope.cancel()

    def _on_process_exit(self, process: EngineProcess) -> None:
        if self._session.notice_exit(process.ranks, process.describe_exit()):
            logger.info("engine process %s (ranks %s) exited", process.name, process.ranks)
            self._wake_receiver()

    # ------------------------------------------------------------------ sending

    async def _send(self, rank: int, frames: Sequence[bytes]) -> None:
        try:
            await self._input.send([identity_for_rank(rank), *frames])
        except UnroutableError as exc:
            record = self._session.notice_rank(rank, f"engine {rank} is no longer connected", exc)
            self._wake_receiver()
            raise record.error() from exc
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            raise self._session.dead_error() from exc

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
        """Send an EngineCoreRequest; its outputs come from :meth:`get_output`.

        Raises ``ValueError`` before anything is sent if the request is invalid or its
        id is live on this client. Cancellation: if cancelled, nothing was sent and the
        id is free again.
        """
        request_id, target, frames = self._prepare(request, rank)
        self._session.start_request(request_id, target)
        try:
            await self._send(target, frames)
        except BaseException:
            self._apply(self._session.end_request(request_id))
            raise
        self._apply(self._session.request_sent(target))

    async def get_output(self) -> EngineCoreOutputs:
        """Wait for the next EngineCoreOutputs batch for raw requests (vLLM's get_output).

        Batches carry the outputs of requests sent with :meth:`add_request` (stream
        outputs are routed to their streams), plus scheduler stats and wave events
        while the raw API is in use (a raw request live, a call waiting, or one in
        the last 2 s). Utility replies never appear here. Batches are queued without
        bound, as in vLLM; consume them. Cancellation: nothing is consumed by a
        cancelled call. Raises :class:`~trio_vllm.EngineDeadError` once dead and the
        queue is empty.

        Scheduling: while batches are queued, a call yields to other tasks at most once
        per millisecond (it always checks for cancellation), so draining a backlog does
        not pay a full scheduler pass per batch.
        """
        session = self._session
        session.raw_api_used()
        session.raw_waiters += 1
        try:
            return await self._raw.receive()
        finally:
            session.raw_waiters -= 1

    def get_output_nowait(self) -> EngineCoreOutputs:
        """The next queued batch, or ``anyio.WouldBlock``; not a checkpoint."""
        self._session.raw_api_used()
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
        self._check_alive()
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            if not isinstance(request_id, str):
                raise TypeError(f"request ids are strings, got {request_id!r}")
        self._wire.encode_abort(ids)  # refuses unencodable ids before anything changes
        await anyio.lowlevel.checkpoint()
        self._check_alive()
        by_rank, streams, actions = self._session.abort(ids, rank)
        for stream in streams:
            assert isinstance(stream, RequestStream)
            stream._abort_locally()
        self._apply(actions)
        for target, rank_ids in by_rank.items():
            await self._send_abort(target, rank_ids)

    @contextlib.asynccontextmanager
    async def generate(
        self, request: EngineCoreRequest, *, rank: int | None = None, max_pending: int | None = None
    ) -> AsyncIterator[RequestStream]:
        """Send ``request`` and yield a :class:`RequestStream` of its outputs.

        Leaving the block before the final output (``break``, an exception,
        cancellation) sends ABORT for the request, without a checkpoint, so it also
        works in cancelled code. ``max_pending`` bounds the stream's buffer (see
        :mod:`trio_vllm.client._streams` on coalescing). Raises ``ValueError`` before
        anything is sent for an invalid request or a live duplicate id.
        """
        request_id, target, frames = self._prepare(request, rank)
        stream = RequestStream(request_id, target, max_pending=max_pending or self._stream_buffer)
        self._session.start_request(request_id, target, stream)
        sent = False
        try:
            await self._send(target, frames)
            sent = True
            self._apply(self._session.request_sent(target))
            yield stream
        finally:
            self._apply(self._session.end_request(request_id))
            if sent and not stream.finished:
                stream.aborted = True
                await self._send_abort(target, [request_id])

    # ------------------------------------------------------------------ utilities

    async def call_utility(self, method: str, *args: object, rank: int | None = None) -> object:
        """Call ``method(*args)`` on one engine (``rank``, else the least busy) and return
        its result.

        Raises :class:`~trio_vllm.UtilityCallError` with the engine's message if the
        method failed there, :class:`~trio_vllm.EngineDeadError` if the engine dies
        (or its rank is retired) first. Cancellation: the pending entry is removed; a
        reply that arrives later is dropped quietly.
        """
        self._check_alive()
        if not method:
            raise ValueError(f"method must be a non-empty string, got {method!r}")
        target = self._session.choose_rank(rank)
        call = _Call(anyio.Event())
        call_id = self._session.start_call(method, target, call)
        try:
            frames = self._wire.encode_utility(0, call_id, method, list(args))
            await self._send(target, frames)
            await call.event.wait()
        finally:
            self._session.end_call(call_id)
        if call.record is not None:
            raise call.record.error()
        if call.failure is not None:
            raise UtilityCallError(method, call.failure, rank=target)
        return call.result

    async def call_utility_all(
        self, method: str, *args: object, return_exceptions: bool = False
    ) -> list[object]:
        """Call ``method(*args)`` on every live engine concurrently; results in rank
        order (of :attr:`live_ranks`).

        If any call fails, the first failure by rank is raised (an
        :class:`~trio_vllm.EngineDeadError` takes precedence) after all calls ended.
        With ``return_exceptions=True`` nothing is raised for engine-side trouble:
        each rank's entry is its result or its :class:`~trio_vllm.TrioVllmError`
        (:class:`~trio_vllm.UtilityCallError`, :class:`~trio_vllm.EngineDeadError`).
        Cancellation cancels every call.
        """
        self._check_alive()
        ranks = self._session.live_ranks
        results: dict[int, object] = {}
        errors: dict[int, Exception] = {}

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

    async def _named_utility(self, spec: NamedUtility[..., R], args: list[object]) -> R:
        """Run one row of the utilities table (``_utilities.py``)."""
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
        with :class:`~trio_vllm.EngineDeadError`. An :class:`EngineEvent`
        ``"rank_retired"`` follows. Cancellation while draining: the rank stays out of
        routing and its requests keep running. Raises ``ValueError`` for an unknown or
        gone rank or the last live rank. A rank that dies while draining is a death as
        usual (the client dies, or with ``on_engine_death="continue"`` its requests
        fail), and this call raises :class:`~trio_vllm.EngineDeadError`.
        """
        self._check_alive()
        ids = self._session.begin_retire(rank)
        logger.info("retiring engine rank %d (drain=%s)", rank, drain)
        if not drain and ids:
            await self.abort_requests(ids)
        if self._session.in_flight(rank) > 0:
            drained = self._drained.setdefault(rank, anyio.Event())
            await drained.wait()
            self._check_alive()
            if self._session.state(rank) is RankState.LOST:
                raise self._session.rank_record(rank).error()  # it died while draining
        self._drained.pop(rank, None)
        actions = self._session.finish_retire(rank)  # its exit is expected from now on
        for process in self._processes:
            if process.ranks == (rank,):
                await process.stop(self._shutdown_grace)
        self._apply(actions)

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
        or ``ready_timeout`` passes, :class:`~trio_vllm.EngineDeadError` as soon as
        the client dies meanwhile; then, and on cancellation, spawned engines are
        stopped and nothing changed (the ranks stay reserved: a late answer from them
        is dropped quietly). Only one call at a time.
        """
        self._check_alive()
        if self._join is not None:
            raise RuntimeError("another add_engines call is in progress")
        engines = SourceSet(source)
        if engines.layouts[0].watch_disconnects and self._sockets.monitor is None:
            raise ValueError(
                "external engines can join only a client that started with an external "
                "source (its input socket has no connection monitor)"
            )
        timeout = default_ready_timeout() if ready_timeout is None else ready_timeout
        self._session.begin_join(engines.ranks)
        processes: list[EngineProcess] = []
        handshake_socket = None
        try:
            parts, watched = handshake_parts(self._sockets, engines)
            join = self._join = HandshakeRun(parts)
            handshake_socket = self._sockets.handshake_socket()
            addresses = self._sockets.bind_handshakes(handshake_socket, engines.layouts)

            def on_exit(process: EngineProcess) -> None:
                if not join.process_exited(process):
                    self._on_process_exit(process)

            try:
                await start_engines(
                    join,
                    engines,
                    handshake_socket,
                    addresses,
                    processes=processes,
                    task_group=self._task_group,
                    on_exit=on_exit,
                    input_socket=None,
                    ready_timeout=timeout,
                )
            except EngineStartupError:
                self._check_alive()  # the client died meanwhile: say that instead
                raise
            assert join.complete is not None
            version = join.complete.vllm_version
            if version != self._wire.vllm_version:
                raise EngineStartupError(
                    f"the new engines report vLLM {version}, the client's engines "
                    f"{self._wire.vllm_version}"
                )
        except BaseException:
            self._session.join_failed(engines.ranks, "its join failed")
            await stop_processes(processes, self._shutdown_grace)
            raise
        finally:
            self._join = None
            if handshake_socket is not None:
                handshake_socket.close()
        # Commit (no checkpoint since the handshake completed).
        for rank, response in join.complete.ready_responses.items():
            self._ready_responses[rank] = dict(response)
        self._session.join_complete(engines.ranks)
        self._wire.set_limits(self._ready_responses)
        self._processes.extend(processes)
        for bound_input, ranks in watched:
            self._sockets.watch(bound_input, ranks)
        logger.info("engine ranks %s joined", engines.ranks)
        return engines.ranks

    # ------------------------------------------------------------------ receiving

    def _handle_frames(self, frames: Sequence[bytes | zmq.Frame]) -> None:
        """Route one output-socket message; raises ProtocolError on bad input."""
        self._apply(self._session.receive(self._wire.decode_outputs(frames)))

    async def _receive_loop(self) -> None:
        """Receive task for the output socket; ends on close or death, never raises."""
        socket = self._sockets.output
        session = self._session
        self._receiving = True
        try:
            while not session.dead:
                batch: list[list[bytes | zmq.Frame]] = []
                with anyio.CancelScope() as scope:
                    self._receive_scope = scope
                    if session.noticed:
                        scope.cancel()
                    # Cancelled while waiting: nothing was dequeued (transport contract).
                    batch = await socket.receive_batch()
                self._receive_scope = None
                for frames in batch:
                    self._handle_frames(frames)
                    if self.dead:
                        return
                if session.noticed:
                    await self._drain_after_exit(socket)
                    self._apply(session.declare_noticed())
        except anyio.ClosedResourceError:
            if not self._closing:
                self._die("output socket closed")
        except ProtocolError as exc:
            self._die(f"protocol error on the output socket: {exc}", exc)
        except Exception as exc:  # cancellation is a BaseException: it passes through
            self._die(f"receive task failed: {exc!r}", exc)
        finally:
            self._receive_scope = None
            self._receiving = False

    async def _drain_after_exit(self, socket: AsyncSocket) -> None:
        """Handle what a dead engine sent before its death was noticed: read until the
        socket has been quiet for a few ms (ZeroMQ's I/O thread may still be moving the
        last messages from the kernel), at most ``_EXIT_DRAIN_S``."""
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

    async def _guard_input(self) -> None:
        """After startup an engine sends on the input socket only a join's ready
        response; late words of a retired, lost or failed-join rank are dropped;
        anything else is a protocol error that makes the client dead. With a monitor
        (engines whose process we cannot watch), a dropped engine connection is a
        death too. Ends on close or death, never raises."""
        monitor = self._sockets.monitor
        if monitor is None:
            await self._guard_input_messages()
            return
        async with anyio.create_task_group() as tg:

            async def guard_messages() -> None:
                await self._guard_input_messages()
                tg.cancel_scope.cancel()

            tg.start_soon(guard_messages)
            await self._watch_disconnects(monitor)
            tg.cancel_scope.cancel()

    async def _guard_input_messages(self) -> None:
        try:
            while not self.dead:
                for message in await self._input.receive_batch():
                    identity = _bytes(message[0]) if message else b""
                    try:
                        rank: int | None = rank_for_identity(identity)
                    except ProtocolError:
                        rank = None
                    verdict = self._session.input_message(rank)
                    join = self._join
                    if verdict == "join" and join is not None and len(message) == 2:
                        join.receive_input(identity, _bytes(message[1]))
                        continue
                    if verdict == "drop":
                        logger.debug("dropped a late message from rank %s", rank)
                        continue
                    what = "engine" if rank in self._session.ranks else "unexpected identity"
                    exc = ProtocolError(
                        f"message on the input socket from {what} {identity.hex() or '(none)'}"
                        f" (rank {rank}) after startup, {len(message)} frame(s); engines send "
                        "only their ready response there"
                    )
                    self._die(f"protocol error on the input socket: {exc}", exc)
                    return
        except anyio.ClosedResourceError:
            return
        except Exception as exc:  # cancellation is a BaseException: it passes through
            self._die(f"input socket failed: {exc!r}", exc)

    async def _watch_disconnects(self, monitor: AsyncSocket) -> None:
        endpoint_ranks = self._sockets.endpoint_ranks
        try:
            while not self.dead:
                for frames in await monitor.receive_batch():
                    event = parse_monitor_message([_bytes(f) for f in frames])
                    if event["event"] != zmq.EVENT_DISCONNECTED or self._closing:
                        continue
                    raw_endpoint: object = event["endpoint"]
                    endpoint = (
                        raw_endpoint.decode(errors="replace")
                        if isinstance(raw_endpoint, bytes)
                        else str(raw_endpoint)
                    )
                    if endpoint_ranks and endpoint not in endpoint_ranks:
                        continue  # an engine whose process exit is watched instead
                    behind = endpoint_ranks.get(endpoint, [])
                    ranks = [
                        r
                        for r in behind
                        if self._session.state(r) in (RankState.LIVE, RankState.RETIRING)
                    ]
                    if not ranks and behind:
                        continue  # a retired or already lost engine
                    message = (
                        f"lost the connection to an engine on the input socket "
                        f"({endpoint}): the engine process or its host is gone"
                    )
                    if self._session.on_engine_death == "continue" and ranks:
                        # Several engines of one source behind this endpoint: the
                        # connection does not say which left, and a headless vLLM
                        # launcher stops all its engines when one dies (§2.3), so the
                        # source is the unit that is lost.
                        for rank in ranks:
                            self._session.notice_rank(rank, message)
                    else:
                        self._session.notice_rank(ranks[0] if len(ranks) == 1 else None, message)
                    logger.info("%s", message)
                    self._wake_receiver()
        except anyio.ClosedResourceError:
            return
        except Exception as exc:  # cancellation is a BaseException: it passes through
            self._die(f"input socket monitor failed: {exc!r}", exc)


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
    timeout = default_ready_timeout() if ready_timeout is None else ready_timeout
    source_set = SourceSet(engines)
    session = ClientSession(source_set.ranks, on_engine_death=on_engine_death, waves=waves)
    sockets = Sockets(watch_disconnects=any(lay.watch_disconnects for lay in source_set.layouts))
    processes: list[EngineProcess] = []
    client: EngineCoreClient | None = None
    body_error: BaseException | None = None
    try:
        parts, watched = handshake_parts(sockets, source_set)
        for bound_input, ranks in watched:
            sockets.watch(bound_input, ranks)
        run = HandshakeRun(parts, on_progress)
        handshake_socket = sockets.handshake_socket()
        handshakes = sockets.bind_handshakes(handshake_socket, source_set.layouts)

        def on_exit(process: EngineProcess) -> None:
            if not run.process_exited(process) and client is not None:
                client._on_process_exit(process)

        async with anyio.create_task_group() as tg:
            try:
                await start_engines(
                    run,
                    source_set,
                    handshake_socket,
                    handshakes,
                    processes=processes,
                    task_group=tg,
                    on_exit=on_exit,
                    input_socket=sockets.input,
                    ready_timeout=timeout,
                )
                assert run.complete is not None
                handshake_socket.close()
                try:
                    wire = Wire.create(
                        profile=profile,
                        vllm_version=run.complete.vllm_version,
                        allow_insecure_serialization=allow_insecure_serialization,
                    )
                except ProtocolError as exc:
                    raise EngineStartupError(
                        f"cannot talk to {source_set.describe()}: {exc}. Pin a profile with "
                        "open_client(profile=...) only if you know the wire layout matches."
                    ) from exc
                wire.set_limits(run.complete.ready_responses)
                client = EngineCoreClient(
                    _Parts(
                        session=session,
                        sockets=sockets,
                        wire=wire,
                        ready_responses=run.complete.ready_responses,
                        processes=processes,
                        task_group=tg,
                        stream_buffer=stream_buffer,
                        shutdown_grace=shutdown_grace,
                        addresses=sockets.addresses(handshakes),
                    )
                )
                # An engine may have exited between READY and now.
                for process in processes:
                    if process.exited.is_set():
                        client._on_process_exit(process)
                tg.start_soon(client._receive_loop)
                tg.start_soon(client._guard_input)
                yield client
            except BaseException as exc:
                body_error = exc
            finally:
                if client is not None:
                    client._closing = True
                    client._apply(client._session.close())
                # The list also holds engines added by add_engines.
                await stop_processes(processes, shutdown_grace)
                tg.cancel_scope.cancel()
    finally:
        sockets.close()
    if body_error is not None:
        raise body_error
