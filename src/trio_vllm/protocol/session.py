"""The client's rules, sans-I/O: ranks, requests, utility calls, death, waves, routing.

`ClientSession` is what `EngineCoreClient` decides, with the
deciding separated from the doing, in h11's manner: the I/O shell feeds it what
happened (a decoded output message, a send that found no peer, a process exit, a
call or request the user started) and gets back a list of *actions* to carry out
(`Deliver` an output to a stream, `QueueRaw` a batch for
``get_output``, `ResolveCall`, `FailCall`, `FailRequest`,
`EmitEvent`, `SendWave`, `RankDrained`, `Died`). Nothing
here awaits, reads a socket or imports trio, anyio or zmq; the tests drive it message
by message.

The rules it holds, each in one place:

* one rank table: every rank is JOINING, LIVE, RETIRING, RETIRED or LOST (with the
  reason). A rank that failed to join is RETIRED without ever having served: late
  words from a RETIRED or LOST rank are dropped quietly, never a protocol error;
* one request registry: each stream or raw request is counted into the load balancer
  once when started and out once (final output, abort, its rank's loss);
* the utility-call table: reserved call ids (-1, -2; docs/protocol.md §6.4) become engine
  events and are never matched; calls pending on a rank that is retired or lost fail;
* one frozen `DeathRecord`: the first death wins, every waiter (streams,
  calls, a join in progress) fails with an error built from it, and
  ``on_engine_death`` ("fail" or "continue") decides whether one rank's loss is the
  client's death;
* death noticed outside the output stream (a send that found no peer, a dropped
  connection, a process exit) is only *noticed* first (`ClientSession.notice_rank`,
  `ClientSession.notice_exit`): the shell drains the output socket and then calls
  `ClientSession.declare_noticed`, so outputs that arrived before a death are
  delivered before its error, whichever path noticed it;
* DP waves (`WaveTracker`) and raw interest: a batch
  with only stats or wave fields is queued for ``get_output`` only while someone uses
  the raw API (raw requests live, a ``get_output`` waiting, or one in the last
  `RAW_INTEREST_S` seconds).
"""

from __future__ import annotations

import enum
import itertools
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Generic, Literal, TypeAlias, TypeVar

import msgspec

from .._exceptions import EngineDeadError, ProtocolError
from .routing import LoadBalancer, StartWave, WaveTracker
from .structs import EngineCoreDead

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from .structs import EngineCoreOutput, EngineCoreOutputs

__all__ = [
    "RAW_INTEREST_S",
    "RESERVED_CALL_IDS",
    "Aborted",
    "Action",
    "ClientSession",
    "DeathRecord",
    "Deliver",
    "Died",
    "EmitEvent",
    "EngineEvent",
    "FailCall",
    "FailRequest",
    "QueueRaw",
    "RankDrained",
    "RankState",
    "ResolveCall",
    "SendWave",
]

#: The shell's handle of a stream (what `Deliver` and `FailRequest` name), opaque here.
S = TypeVar("S")
#: The shell's handle of a utility call (what `ResolveCall` and `FailCall` name).
C = TypeVar("C")

# Reserved engine-initiated call ids (docs/protocol.md §6.4): never matched to calls.
RESERVED_CALL_IDS: Final = frozenset({-1, -2})
# How long after the last get_output call stats-only batches are still queued when no
# raw request is live: long enough for a consumer that handles each batch slowly, short
# enough that a program that once read get_output and then only streams stops queueing.
RAW_INTEREST_S: Final = 2.0
_ENGINE_CORE_DEAD_MESSAGE: Final = (
    "engine core sent ENGINE_CORE_DEAD (a fatal error in the engine; see its log)"
)


class RankState(enum.Enum):
    """Where a data-parallel rank stands in the client."""

    JOINING = "joining"  # add_engines handshake in progress
    LIVE = "live"  # gets new requests
    RETIRING = "retiring"  # retire_rank: no new requests, draining
    RETIRED = "retired"  # drained and stopped, or its join failed: exits are expected
    LOST = "lost"  # died while the client kept running (on_engine_death="continue")


_LOST: Final = RankState.LOST
_DEAD: Final = EngineCoreDead()  # what the codec returns for ENGINE_CORE_DEAD (a singleton)


@dataclass(frozen=True, slots=True)
class EngineEvent:
    """Something an engine told the client unasked, or a rank's loss; see
    `EngineCoreClient.engine_events`.

    ``kind``: ``"elastic_ep"`` (call id -1: ``payload`` is ``[type, dp_rank]``, e.g.
    ``["RECONFIGURE_FINISHED", 2]``), ``"fault_tolerance"`` (call id -2: ``payload``
    is the status map), or ``"rank_lost"`` (``on_engine_death="continue"``: the rank
    died; ``payload`` is ``{"message": str, "requests": [ids failed]}``) and
    ``"rank_retired"`` (`EngineCoreClient.retire_rank` finished).
    """

    kind: str
    rank: int | None
    payload: object


@dataclass(frozen=True, slots=True)
class DeathRecord:
    """Why something is gone; `error` builds the exception waiters raise."""

    message: str
    rank: int | None = None
    cause: BaseException | None = None

    def error(self) -> EngineDeadError:
        """A fresh `EngineDeadError` (one shared instance would collect tracebacks)."""
        error = EngineDeadError(self.message, rank=self.rank)
        error.__cause__ = self.cause
        return error


# ---------------------------------------------------------------------- actions
# Plain slotted classes (not frozen dataclasses), made at most once per message.


class Deliver(tuple[S, "EngineCoreOutput"]):
    """``(handle, output)``: hand ``output`` to the stream ``handle`` (the shell's
    object, opaque here). The hot path, one per output: `ClientSession.receive`
    appends plain 2-tuples of this shape (far cheaper to make than an object), which
    the shell tells from the other actions by ``type(action) is tuple``; this class
    only names the shape (``Deliver(handle, output)`` builds one for tests)."""

    __slots__ = ()

    def __new__(cls, handle: S, output: EngineCoreOutput) -> Deliver[S]:
        return super().__new__(cls, (handle, output))


class QueueRaw:
    """Queue ``outputs`` (only the raw requests' outputs left in it) for get_output."""

    __slots__ = ("outputs",)

    def __init__(self, outputs: EngineCoreOutputs) -> None:
        self.outputs = outputs


class ResolveCall(Generic[C]):
    """A utility reply for the call ``handle``: ``failure`` is the engine's message."""

    __slots__ = ("failure", "handle", "result")

    def __init__(self, handle: C, failure: str | None, result: object) -> None:
        self.handle = handle
        self.failure = failure
        self.result = result


class FailCall(Generic[C]):
    """The call ``handle`` fails with ``record.error()``."""

    __slots__ = ("handle", "record")

    def __init__(self, handle: C, record: DeathRecord) -> None:
        self.handle = handle
        self.record = record


class FailRequest(Generic[S]):
    """The stream ``handle`` fails with ``record.error()`` once its outputs are read."""

    __slots__ = ("handle", "record")

    def __init__(self, handle: S, record: DeathRecord) -> None:
        self.handle = handle
        self.record = record


class EmitEvent:
    """Queue ``event`` on the client's engine events."""

    __slots__ = ("event",)

    def __init__(self, event: EngineEvent) -> None:
        self.event = event


class SendWave:
    """Send START_DP_WAVE ``(start.wave, start.exclude)`` to each rank of ``start.ranks``
    (lost ranks already left out), without waiting."""

    __slots__ = ("start",)

    def __init__(self, start: StartWave) -> None:
        self.start = start


class RankDrained:
    """The retiring ``rank`` has nothing in flight any more (or is gone): wake retire."""

    __slots__ = ("rank",)

    def __init__(self, rank: int) -> None:
        self.rank = rank


class Died:
    """The client is dead: wake every waiter (the streams and calls got their own
    actions just before); ``record`` says why."""

    __slots__ = ("record",)

    def __init__(self, record: DeathRecord) -> None:
        self.record = record


#: One action, generic in the shell's stream (``S``) and call (``C``) handles:
#: ``Action[RequestStream, Call]`` is what the client's ``apply`` carries out. A
#: `Deliver` travels as a plain 2-tuple (see there).
Action: TypeAlias = (
    tuple[S, "EngineCoreOutput"] | QueueRaw | ResolveCall[C] | FailCall[C] | FailRequest[S]
    | EmitEvent | SendWave | RankDrained | Died
)  # fmt: skip


class Aborted(Generic[S, C]):
    """What `ClientSession.abort` decided: ``by_rank`` (rank -> ids to send ABORT to),
    ``streams`` (the handles to stop locally) and ``actions`` (a retiring rank drained)."""

    __slots__ = ("actions", "by_rank", "streams")

    def __init__(
        self, by_rank: dict[int, list[str]], streams: list[S], actions: list[Action[S, C]]
    ) -> None:
        self.by_rank = by_rank
        self.streams = streams
        self.actions = actions


class _Rank:
    __slots__ = ("heard", "reason", "served", "state")

    def __init__(self, state: RankState, *, served: bool) -> None:
        self.state = state
        self.served = served  # finished startup or a join (failed joins never did)
        self.reason: str | None = None
        self.heard = 0  # output messages received from it (the stall watch's progress)


class _Request(Generic[S]):
    __slots__ = ("counted", "handle", "rank")

    def __init__(self, rank: int, handle: S | None) -> None:
        self.rank = rank
        self.handle = handle  # the stream; None for a raw request
        self.counted = True  # still in the balancer's in-flight count


class _Call(Generic[C]):
    __slots__ = ("handle", "method", "rank")

    def __init__(self, method: str, rank: int, handle: C) -> None:
        self.method = method
        self.rank = rank
        self.handle = handle


class _OutputRouting(Generic[S, C]):
    """The half of `ClientSession` that routes decoded output messages (`receive`,
    `receive_whole`). Its state is the session's, declared here and set by
    `ClientSession.__init__`; the session's other rules it uses are declared below."""

    death: DeathRecord | None
    on_engine_death: Literal["fail", "continue"]
    unattributed_deaths: int
    raw_called: bool
    raw_waiters: int
    _ranks: dict[int, _Rank]
    _balancer: LoadBalancer
    _waves: WaveTracker | None
    _requests: dict[str, _Request[S]]
    _raw_live: int
    _calls: dict[int, _Call[C]]
    _clock: Callable[[], float]
    _raw_interest_until: float

    if TYPE_CHECKING:

        @property
        def ranks(self) -> list[int]: ...

        def _die(
            self, message: str, rank: int | None, cause: BaseException | None
        ) -> list[Action[S, C]]: ...

        def _release(self, req: _Request[S]) -> list[Action[S, C]]: ...

        def _wave(self, start: StartWave | None) -> list[Action[S, C]]: ...

    def _raw_interest(self) -> bool:
        if self._raw_live > 0 or self.raw_waiters > 0:
            return True
        now = self._clock()
        if self.raw_called:
            self.raw_called = False
            self._raw_interest_until = now + RAW_INTEREST_S
        return now < self._raw_interest_until

    def receive_whole(self, outputs: EngineCoreOutputs) -> bool:
        """The raw API's fast path for one decoded message: True when `receive` would
        return exactly ``[QueueRaw(outputs)]`` (every output a live raw request's, none
        final, nothing else in the message for the client), with its bookkeeping done;
        the shell then queues ``outputs`` itself. False: nothing was changed, call
        `receive`. Never raises. `receive_wholes` is the same for a run of messages.

        Anything unusual (a death, an unknown or lost rank, a utility reply, wave
        fields, a finish, an output of another request) is left to `receive`.
        """
        return self.receive_wholes((outputs,)) == 1

    def receive_wholes(self, messages: Sequence[object], start: int = 0) -> int:
        """`receive_whole` over ``messages[start:]`` (decoded messages, the codec's
        `EngineCoreDead` among them): how many of them, from the first, it takes, with
        their bookkeeping done (the rank's message count, the scheduler stats). The
        shell queues those as they are; the message after them, if any, goes to
        `receive`. Never raises.

        One call per receive batch instead of `receive`'s action list and `QueueRaw` per
        message (allocations that stay alive in the shell's queue), and the checks that
        only `receive` can change (a death, the raw count, the rank's state) once per
        run (docs/performance.md, issue 25).
        """
        requests = self._requests
        if self.death is not None or len(requests) != self._raw_live:
            return 0
        waves = self._waves is not None
        ranks = self._ranks
        balancer = self._balancer
        index: int | None = None
        info: _Rank | None = None
        n = start
        end = len(messages)
        while n < end:
            outputs: Any = messages[n]  # EngineCoreOutputs, or the codec's EngineCoreDead
            if outputs is _DEAD or outputs.utility_output is not None:
                break
            outs = outputs.outputs
            if not outs:
                break
            if waves and (outputs.wave_complete is not None or outputs.start_wave is not None):
                break
            if outputs.engine_index != index or info is None:
                # Only receive changes a rank's state: checked once per rank and run.
                index = outputs.engine_index
                info = ranks.get(index)
                if info is None or not info.served or info.state is _LOST:
                    break
            # Raw requests only (each counted while registered): every output theirs
            # and none final (finishes, once per request, take receive's loop).
            for output in outs:
                if output.finish_reason is not None or output.request_id not in requests:
                    return n - start
            info.heard += 1
            stats = outputs.scheduler_stats
            if stats is not None:
                balancer.update_stats(
                    outputs.engine_index, stats.num_waiting_reqs, stats.num_running_reqs
                )
            n += 1
        return n - start

    def receive(self, outputs: EngineCoreOutputs | None) -> list[Action[S, C]]:
        """Route one decoded output message (``None``: ENGINE_CORE_DEAD).

        Raises `ProtocolError` for an ``engine_index`` this client never knew
        (the shell makes that the client's death). The shell may offer each message
        to `receive_whole` first (the same result, without the action list).
        """
        # receive_wholes' first test inline: with a stream registered (the stream
        # path's every message) it is no call at all.
        if (
            outputs is not None
            and len(self._requests) == self._raw_live
            and self.receive_wholes((outputs,))
        ):
            return [QueueRaw(outputs)]
        if self.death is not None:
            return []
        if outputs is None:
            live = self._balancer.live_ranks
            if self.on_engine_death == "continue" and len(live) > 1:
                self.unattributed_deaths += 1
                return []
            return self._die(_ENGINE_CORE_DEAD_MESSAGE, live[0] if len(live) == 1 else None, None)
        index = outputs.engine_index
        info = self._ranks.get(index)
        if info is None:
            raise ProtocolError(
                f"output from unexpected engine_index {index!r} (expected one of {self.ranks})"
            )
        if not info.served or info.state is RankState.LOST:
            return []  # a failed join's or a lost rank's late words
        info.heard += 1
        actions: list[Action[S, C]] = []
        stats = outputs.scheduler_stats
        if stats is not None:
            self._balancer.update_stats(index, stats.num_waiting_reqs, stats.num_running_reqs)
        waves = self._waves
        if waves is not None:
            if outputs.wave_complete is not None:
                busy = any(self._balancer.in_flight(r) for r in self._balancer.live_ranks)
                start = waves.on_wave_complete(outputs.wave_complete, requests_in_flight=busy)
                actions.extend(self._wave(start))
            if outputs.start_wave is not None:
                actions.extend(self._wave(waves.on_start_wave(outputs.start_wave, index)))
        utility = outputs.utility_output
        if utility is not None:
            call_id = utility.call_id
            value = None if utility.result is None else utility.result.result
            if call_id in RESERVED_CALL_IDS:
                kind = "elastic_ep" if call_id == -1 else "fault_tolerance"
                actions.append(EmitEvent(EngineEvent(kind, index, value)))
            else:
                call = self._calls.pop(call_id, None)
                if call is not None:
                    actions.append(ResolveCall(call.handle, utility.failure_message, value))
            if not outputs.outputs:
                return actions
        requests = self._requests
        outs = outputs.outputs
        raw: list[EngineCoreOutput] | None = None  # made for a raw output only
        for output in outs:
            # A subscript, not get(): the per-output step of every stream (a late output,
            # the exception, is rare; get() is a method call, ~10-20 ns more per output).
            try:
                req = requests[output.request_id]
            except KeyError:
                continue  # a late output of an aborted or finished request (§3.4)
            if not req.counted:
                continue  # finished or aborted, registered until its block is left
            final = output.finish_reason is not None
            if req.handle is not None:
                actions.append((req.handle, output))  # Deliver
                if final:
                    actions.extend(self._release(req))
            else:
                if raw is None:
                    raw = []
                raw.append(output)
                if final:
                    del requests[output.request_id]
                    self._raw_live -= 1
                    actions.extend(self._release(req))
        if raw or (
            (
                stats is not None
                or outputs.wave_complete is not None
                or outputs.start_wave is not None
            )
            and self._raw_interest()
        ):
            if raw is None:
                raw = []
            if len(raw) != len(outputs.outputs):
                outputs = msgspec.structs.replace(outputs, outputs=raw)
            actions.append(QueueRaw(outputs))
        return actions


class ClientSession(_OutputRouting[S, C]):
    """The state of one client over its engines; see the module documentation.

    Generic in the shell's handles, opaque here: ``S`` for a stream (given to
    `start_request`, named by `Deliver` and `FailRequest`), ``C`` for a utility call
    (given to `start_call`, named by `ResolveCall` and `FailCall`); mypy checks that
    the shell gets back the kind it handed in.

    Methods that change state return the actions to carry out, in order. Methods that
    refuse raise ``ValueError`` (a caller's mistake) or `EngineDeadError` (no
    engine to serve it) before changing anything.
    """

    def __init__(
        self,
        ranks: Iterable[int],
        *,
        on_engine_death: Literal["fail", "continue"] = "fail",
        waves: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if on_engine_death not in ("fail", "continue"):
            raise ValueError(
                f"on_engine_death must be 'fail' or 'continue', got {on_engine_death!r}"
            )
        initial = sorted(set(ranks))
        self._ranks: dict[int, _Rank] = {r: _Rank(RankState.LIVE, served=True) for r in initial}
        self._balancer = LoadBalancer(initial)
        self._waves = WaveTracker(initial) if waves else None
        self.on_engine_death: Literal["fail", "continue"] = on_engine_death
        self._requests: dict[str, _Request[S]] = {}
        self._raw_live = 0
        self._calls: dict[int, _Call[C]] = {}
        # vLLM uses uuid1().int >> 64; any int but -1/-2 works. Random start, then count.
        self._call_ids = itertools.count(random.getrandbits(62) + 1)
        self._clock = clock
        self._raw_interest_until = -1.0
        self.raw_called = False  # get_output / add_request since the last check
        self.raw_waiters = 0  # get_output calls waiting now (the shell counts them)
        self.death: DeathRecord | None = None
        self._noticed: list[tuple[tuple[int, ...] | None, str, BaseException | None]] = []
        # Whose outputs the shell drains before declaring (None: a notice named no rank).
        self._noticed_from: set[int] | None = set()
        # ENGINE_CORE_DEAD carries no rank: with several live ranks in "continue" mode
        # the process exit or dropped connection that follows names the rank (§8.3).
        self.unattributed_deaths = 0
        # Requests whose ADD found their rank gone (the send raised) before the rank's
        # death was declared: rank -> (id, request), still counted in the balancer.
        # They failed with that rank's death, so its rank_lost event lists them.
        self._send_failed: dict[int, list[tuple[str, _Request[S]]]] = {}

    # ------------------------------------------------------------------ ranks

    @property
    def ranks(self) -> list[int]:
        """Every rank that served (live, retiring, retired or lost), ascending."""
        return sorted(r for r, info in self._ranks.items() if info.served)

    @property
    def live_ranks(self) -> list[int]:
        """Ranks new requests may go to."""
        return self._balancer.live_ranks

    @property
    def lost_ranks(self) -> dict[int, str]:
        """Rank -> why it is gone, for ranks lost while the client kept running."""
        return {
            r: info.reason or ""
            for r, info in sorted(self._ranks.items())
            if info.state is RankState.LOST
        }

    def state(self, rank: int) -> RankState | None:
        """The rank's state (``None`` for a rank this client never knew)."""
        info = self._ranks.get(rank)
        return None if info is None else info.state

    def in_flight(self, rank: int) -> int:
        return self._balancer.in_flight(rank)

    def heard(self, rank: int) -> int:
        """How many output messages (outputs, stats, utility replies) came from
        ``rank`` since it served: each one is a step of its loop (the stall watch)."""
        info = self._ranks.get(rank)
        return 0 if info is None else info.heard

    @property
    def current_wave(self) -> int | None:
        return None if self._waves is None else self._waves.current_wave

    @property
    def waves_started(self) -> int:
        return 0 if self._waves is None else self._waves.waves_started

    def _ranks_changed(self) -> None:
        if self._waves is not None:
            self._waves.set_ranks(self._balancer.live_ranks)

    def input_message(self, rank: int | None) -> Literal["join", "drop", "error"]:
        """What to do with a message on the input socket after startup from ``rank``
        (``None``: not a rank identity): a joining rank's ready response goes to its
        join; a retired or lost rank's late words are dropped; anything else is a
        protocol error (engines send only their ready response there)."""
        info = None if rank is None else self._ranks.get(rank)
        if info is None or info.state is RankState.LIVE or info.state is RankState.RETIRING:
            return "error"
        return "join" if info.state is RankState.JOINING else "drop"

    def begin_join(self, ranks: Iterable[int]) -> None:
        """add_engines starts: ``ValueError`` if any rank is known (even a failed join's)."""
        self._check_alive()
        new = sorted(set(ranks))
        overlap = [r for r in new if r in self._ranks]
        if overlap:
            raise ValueError(f"rank(s) {overlap} are already known to this client")
        for rank in new:
            self._ranks[rank] = _Rank(RankState.JOINING, served=False)

    def join_failed(self, ranks: Iterable[int], reason: str) -> None:
        """The join gave up (error, timeout, cancellation): its ranks become RETIRED
        without having served, so their late answers and exits are expected."""
        for rank in ranks:
            info = self._ranks.get(rank)
            if info is not None and info.state is RankState.JOINING:
                info.state = RankState.RETIRED
                info.reason = reason

    def join_complete(self, ranks: Iterable[int]) -> None:
        """The join's handshake completed: its ranks get requests from now on."""
        for rank in ranks:
            info = self._ranks[rank]
            if info.state is RankState.JOINING:
                info.state = RankState.LIVE
                info.served = True
                self._balancer.add(rank)
        self._ranks_changed()

    def begin_retire(self, rank: int) -> list[str]:
        """retire_rank starts: stop routing to ``rank``; returns its live request ids
        (for an abort without drain). ``ValueError`` for an unknown, gone or last rank."""
        self._check_alive()
        info = self._ranks.get(rank)
        if info is None or info.state is not RankState.LIVE:
            raise ValueError(f"rank {rank} is not a live engine of this client")
        if self._balancer.live_ranks == [rank]:
            raise ValueError(f"rank {rank} is the last live engine; close the client instead")
        info.state = RankState.RETIRING
        self._balancer.remove(rank)
        self._ranks_changed()
        return [rid for rid, req in self._requests.items() if req.rank == rank and req.counted]

    def finish_retire(self, rank: int) -> list[Action[S, C]]:
        """The rank drained and is being stopped: calls still pending there fail (its
        process is gone, no reply will come) and a ``rank_retired`` event follows."""
        info = self._ranks[rank]
        if info.state is not RankState.RETIRING:
            raise ValueError(f"rank {rank} is not retiring")
        info.state = RankState.RETIRED
        info.reason = "retired"
        record = DeathRecord(
            f"engine rank {rank} was retired (retire_rank) while the call was pending", rank
        )
        actions: list[Action[S, C]] = [
            FailCall(call.handle, record) for call in self._take_calls(rank)
        ]
        actions.append(EmitEvent(EngineEvent("rank_retired", rank, None)))
        return actions

    def exit_expected(self, ranks: Iterable[int]) -> bool:
        """Whether a process serving ``ranks`` may exit without it being a death."""
        return all(
            (info := self._ranks.get(r)) is not None and info.state is RankState.RETIRED
            for r in ranks
        )

    # ------------------------------------------------------------------ death

    @property
    def dead(self) -> bool:
        return self.death is not None

    def dead_error(self) -> EngineDeadError:
        """The error every call raises once dead."""
        record = self.death or DeathRecord("engine core is dead")
        return record.error()

    def _check_alive(self) -> None:
        if self.death is not None:
            raise self.death.error()

    def rank_record(self, rank: int) -> DeathRecord:
        """Why work of ``rank`` can no longer be served (the client's death first)."""
        if self.death is not None:
            return self.death
        info = self._ranks.get(rank)
        if info is not None and info.state is RankState.LOST:
            return DeathRecord(f"engine rank {rank} died: {info.reason}", rank)
        return DeathRecord("engine core is dead")

    def close(
        self, message: str = "the client is closed (open_client exited)"
    ) -> list[Action[S, C]]:
        """The client is closing: it is dead from now on (if not already)."""
        return self._die(message, None, None)

    def _die(
        self, message: str, rank: int | None, cause: BaseException | None
    ) -> list[Action[S, C]]:
        if self.death is not None:
            return []
        record = self.death = DeathRecord(message, rank, cause)
        actions: list[Action[S, C]] = [FailCall(c.handle, record) for c in self._calls.values()]
        self._calls.clear()
        actions.extend(
            FailRequest(req.handle, record)
            for req in self._requests.values()
            if req.handle is not None
        )
        actions.append(Died(record))
        return actions

    def rank_died(
        self, rank: int | None, message: str, cause: BaseException | None = None
    ) -> list[Action[S, C]]:
        """One rank is gone (``None``: unknown which): the client dies (``"fail"``, as
        vLLM does), or with ``"continue"`` only that rank's requests and calls fail and
        a ``rank_lost`` event is queued; the client dies with its last rank."""
        if self.death is not None:
            return []
        info = None if rank is None else self._ranks.get(rank)
        send_failed = [] if rank is None else self._send_failed.pop(rank, [])
        if info is not None and info.state in (RankState.LOST, RankState.RETIRED):
            # Already gone, or gone as expected: nothing more to declare (a request
            # whose send failed after the verdict was counted in that verdict).
            actions: list[Action[S, C]] = []
            for _, req in send_failed:
                actions.extend(self._release(req))
            return actions
        if self.on_engine_death != "continue" or rank is None or info is None or not info.served:
            return self._die(message, rank, cause)
        was_retiring = info.state is RankState.RETIRING
        info.state = RankState.LOST
        info.reason = message
        self._balancer.remove(rank)
        self._ranks_changed()
        if not self._balancer.live_ranks:
            return self._die(f"every engine is gone; the last: {message}", rank, cause)
        record = DeathRecord(f"engine rank {rank} died: {message}", rank, cause)
        actions = [FailCall(c.handle, record) for c in self._take_calls(rank)]
        # First the requests routed here in the moment before the death was noticed,
        # whose send failed (their callers got this rank's EngineDeadError already).
        failed: list[str] = []
        for request_id, req in send_failed:
            failed.append(request_id)
            self._release(req)
        for request_id, req in list(self._requests.items()):
            if req.rank != rank or not req.counted:
                continue
            failed.append(request_id)
            self._release(req)
            if req.handle is None:
                del self._requests[request_id]
                self._raw_live -= 1
            else:
                actions.append(FailRequest(req.handle, record))
        if was_retiring:
            actions.append(RankDrained(rank))
        actions.append(
            EmitEvent(EngineEvent("rank_lost", rank, {"message": message, "requests": failed}))
        )
        return actions

    # Deaths noticed outside the output stream: drain first, then declare.

    def notice_rank(
        self,
        rank: int | None,
        message: str,
        cause: BaseException | None = None,
        *,
        request_id: str | None = None,
    ) -> DeathRecord:
        """A send found no peer for ``rank`` or its connection dropped. Nothing else
        changes until `declare_noticed` (after the shell drained the output socket).
        Returns the record the caller that noticed it raises now.

        ``request_id``: the send that failed was that request's ADD. The request fails
        now, with this rank's death (the caller raises the record), and leaves the
        registry (its id is free again); it stays counted on the rank until the
        verdict, whose ``rank_lost`` event lists it with the rank's other requests.
        """
        if self.death is not None:
            return self.death
        if request_id is not None and rank is not None:
            req = self._requests.get(request_id)
            # Not counted: the rank's verdict came first and failed (and listed) it.
            if req is not None and req.counted and req.rank == rank:
                del self._requests[request_id]
                if req.handle is None:
                    self._raw_live -= 1
                self._send_failed.setdefault(rank, []).append((request_id, req))
        self._noticed.append((None if rank is None else (rank,), message, cause))
        self._note_from(None if rank is None else (rank,))
        if rank is not None and self.on_engine_death == "continue":
            return DeathRecord(f"engine rank {rank} died: {message}", rank, cause)
        return DeathRecord(message, rank, cause)

    def notice_exit(self, ranks: tuple[int, ...], description: str) -> bool:
        """An engine process serving ``ranks`` exited; False if that was expected
        (retired, failed join) or the client is dead already, so nothing to declare."""
        if self.death is not None or self.exit_expected(ranks):
            return False
        message = f"engine process died: {description}"
        self._note_from(ranks)
        if self.on_engine_death == "continue":
            for rank in ranks:
                self._noticed.append(((rank,), message, None))
        else:
            self._noticed.append((ranks if len(ranks) == 1 else None, message, None))
        return True

    def _note_from(self, ranks: tuple[int, ...] | None) -> None:
        if ranks is None:
            self._noticed_from = None
        elif self._noticed_from is not None:
            self._noticed_from.update(ranks)

    @property
    def noticed(self) -> bool:
        """Deaths noticed and not declared yet (the shell drains, then declares)."""
        return bool(self._noticed)

    @property
    def noticed_ranks(self) -> frozenset[int] | None:
        """The ranks of the deaths noticed and not declared yet, whose last outputs the
        shell drains; ``None`` when a notice could not say which (every rank's count)."""
        return None if self._noticed_from is None else frozenset(self._noticed_from)

    def declare_noticed(self) -> list[Action[S, C]]:
        """Declare every noticed death, in the order noticed."""
        noticed, self._noticed = self._noticed, []
        self._noticed_from = set()
        actions: list[Action[S, C]] = []
        for ranks, message, cause in noticed:
            rank = None if ranks is None or len(ranks) != 1 else ranks[0]
            actions.extend(self.rank_died(rank, message, cause))
        return actions

    # ------------------------------------------------------------------ requests

    def choose_rank(self, pinned: int | None = None) -> int:
        """The one place that picks an engine: ``pinned``, else the least loaded live
        rank. ``ValueError`` for an unknown or gone pinned rank, `EngineDeadError`
        when none is live."""
        self._check_alive()
        try:
            return self._balancer.choose(pinned)
        except LookupError:
            raise self.dead_error() from None

    def check_new(self, request_id: str) -> None:
        """``ValueError`` if ``request_id`` is live on this client (a duplicate live id
        would kill the engine, docs/protocol.md §3.7)."""
        if request_id in self._requests:
            raise ValueError(
                f"request id {request_id!r} is already live on this client; a duplicate "
                "live id would kill the engine (docs/protocol.md §3.7)"
            )

    def start_request(self, request_id: str, rank: int, handle: S | None = None) -> None:
        """Register a request about to be sent to ``rank`` (a stream if ``handle`` is
        given, else raw) and count it in the rank's load."""
        self._check_alive()
        self.check_new(request_id)
        self._requests[request_id] = _Request(rank, handle)
        if handle is None:
            self._raw_live += 1
            self.raw_api_used()
        self._balancer.started(rank)

    def request_sent(self, rank: int) -> list[Action[S, C]]:
        """The ADD went out: wake idle ranks for a DP wave if needed (§7.4)."""
        if self._waves is None:
            return []
        return self._wave(self._waves.on_add(rank))

    def end_request(self, request_id: str) -> list[Action[S, C]]:
        """Forget a request (send failed, stream block left): counted out if it was not
        already. Idempotent."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return []
        if req.handle is None:
            self._raw_live -= 1
        return self._release(req)

    def abort(self, request_ids: Iterable[str], rank: int | None = None) -> Aborted[S, C]:
        """Finish requests locally; return what to do (`Aborted`: rank -> ids to send
        ABORT to, the stream handles to stop, a retiring rank drained). Ids not running here
                (unknown, finished) go to ``rank`` or to every live rank (aborting is
        idempotent). Streams stay registered until their block is left but get no more
        outputs.

        Refuses before changing anything: ``ValueError`` for an unknown or gone
        ``rank`` (when it is needed), `EngineDeadError` once dead.
        """
        self._check_alive()
        ids = list(request_ids)
        requests = self._requests
        targets: list[int] = []
        if any(not self.is_counted(i) for i in ids):
            targets = self.live_ranks if rank is None else [self.choose_rank(rank)]
        by_rank: dict[int, list[str]] = {}
        handles: list[S] = []
        actions: list[Action[S, C]] = []
        for request_id in ids:
            req = requests.get(request_id)
            if req is None or not req.counted:
                for target in targets:
                    by_rank.setdefault(target, []).append(request_id)
                continue
            if req.handle is None:
                del requests[request_id]
                self._raw_live -= 1
            else:
                handles.append(req.handle)
            actions.extend(self._release(req))
            by_rank.setdefault(req.rank, []).append(request_id)
        return Aborted(by_rank, handles, actions)

    def is_counted(self, request_id: str) -> bool:
        """Whether the request still waits for outputs (not finished, aborted or failed)."""
        req = self._requests.get(request_id)
        return req is not None and req.counted

    @property
    def live_requests(self) -> list[str]:
        """Every registered request id (streams until their block is left, raw ones
        until finished or aborted)."""
        return list(self._requests)

    def _release(self, req: _Request[S]) -> list[Action[S, C]]:
        # Each request leaves the in-flight count exactly once.
        if not req.counted:
            return []
        req.counted = False
        rank = req.rank
        self._balancer.ended(rank)
        info = self._ranks.get(rank)
        if (
            info is not None
            and info.state is RankState.RETIRING
            and self._balancer.in_flight(rank) == 0
        ):
            return [RankDrained(rank)]
        return []

    # ------------------------------------------------------------------ raw interest

    def raw_api_used(self) -> None:
        """add_request / get_output was called: stats-only batches are queued a while.
        (Cheap: a flag; the window is timed from the next stats-only batch, so the
        call costs no clock read.)"""
        self.raw_called = True

    # ------------------------------------------------------------------ utility calls

    def start_call(self, method: str, rank: int, handle: C) -> int:
        """Register a utility call to ``rank``; returns its call id (never -1 or -2)."""
        self._check_alive()
        if not method:
            raise ValueError(f"method must be a non-empty string, got {method!r}")
        call_id = next(self._call_ids)
        self._calls[call_id] = _Call(method, rank, handle)
        return call_id

    def end_call(self, call_id: int) -> None:
        """Forget a call (replied, failed or cancelled); a late reply is dropped."""
        self._calls.pop(call_id, None)

    @property
    def pending_calls(self) -> int:
        return len(self._calls)

    def _take_calls(self, rank: int) -> list[_Call[C]]:
        taken = [cid for cid, call in self._calls.items() if call.rank == rank]
        return [self._calls.pop(cid) for cid in taken]

    # ------------------------------------------------------------------ routing

    def _wave(self, start: StartWave | None) -> list[Action[S, C]]:
        if start is None:
            return []
        lost = [r for r in start.ranks if self.state(r) is RankState.LOST]
        if lost:
            ranks = tuple(r for r in start.ranks if r not in lost)
            start = StartWave(start.wave, start.exclude, ranks)
        return [SendWave(start)]
