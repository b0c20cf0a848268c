"""The client's receiving side: the receive task and the input-socket guard.

`Receiver` reads the output socket (one receive task) and guards the input
socket, handing everything to the session and its actions to the client's
``apply``. It also owns the *drain first* step of the one death path: a death noticed
outside the output stream (`Receiver.wake`) is declared only after the output
socket went quiet, so what the engine sent before reaches its streams first.
Its tasks end on close or death and never raise.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.lowlevel
import zmq
from zmq.utils.monitor import parse_monitor_message

from .._exceptions import ProtocolError
from ..protocol.handshake import rank_for_identity
from ..protocol.liveness import hang_message
from ..protocol.session import QueueRaw, RankState
from ..protocol.structs import EngineCoreDead
from ._startup import _bytes
from ._streams import LISTEN_INTERVAL, ListenBudget

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ..protocol.structs import EngineCoreOutputs
    from ..transport import AsyncSocket, InFrame
    from ._process import EngineProcess
    from ._startup import HandshakeRun, Sockets
    from ._types import Session, ShellAction
    from ._wire import Wire

__all__ = ["Receiver"]

# After a death noticed outside the output stream: drain the dead engine's last outputs
# until the socket is quiet this long, or until only other engines' outputs came for
# _EXIT_DRAIN_S, at least _EXIT_OTHERS of them (they share the socket and may never let
# it go quiet), then declare it. A notice that names no rank cannot tell the outputs
# apart: then at most _EXIT_DRAIN_MAX_S.
_EXIT_QUIET_S: Final = 0.004
_EXIT_DRAIN_S: Final = 0.03
_EXIT_OTHERS: Final = 32
_EXIT_DRAIN_MAX_S: Final = 1.0
# A spawned engine's connection dropped (with heartbeats on): wait this long for its
# process to exit before calling it a hang. An exit closes the connection too, and the
# process watcher, which names the exit code, may hear of it a moment later.
_EXIT_GRACE_S: Final = 1.0
# After a batch that queued raw outputs (get_output), the next receive batch ends after
# this many bytes of frames (the transport's default is 256 KiB): up to 256 small
# messages, but ~8 of 64 outputs each. Everything of a batch is decoded before the
# consumer runs, so a large batch of large messages keeps megabytes of fresh objects
# alive in the raw queue: the decode then writes cold memory and the collector runs over
# them (bench firehose at 64 outputs per message: docs/performance.md).
# Streams get a larger batch than the transport's default instead: there every output
# wakes its consumer unless more outputs of the same stream arrive in the same batch, so
# a batch of more messages means fewer task switches per output (A/B of the sizes in
# docs/performance.md). For the same reason a stream batch may hold 1,024 messages, not
# the transport's 256: small messages (1 output each, 67 bytes) then reach each of 256
# streams ~4 at a time instead of ~1, one wake-up for four (issue 25: d256 at 1 output
# per message 4.6-4.8 -> 3.2-3.5 us per message). At 64 outputs per message the byte
# limit ends the batch first (~386 messages). 4,096 was ~8 % cheaper still, but the
# first stream of a batch then waits ~10 ms for the whole batch to be routed.
_RAW_BATCH_BYTES: Final = 32 * 1024
_STREAM_BATCH_BYTES: Final = 1024 * 1024
_RAW_BATCH_MESSAGES: Final = 256
_STREAM_BATCH_MESSAGES: Final = 1024
_DEAD: Final = EngineCoreDead()  # what the codec decodes ENGINE_CORE_DEAD to (a singleton)

logger = logging.getLogger("trio_vllm.client")
_monotonic: Final = time.monotonic


class Receiver:
    """The receive task and the input guard of one client (see the module docs)."""

    def __init__(
        self,
        session: Session,
        sockets: Sockets,
        wire: Wire,
        apply: Callable[[list[ShellAction]], None],
        queue_raws: Callable[[list[EngineCoreOutputs]], None],
        join: Callable[[], HandshakeRun | None],
        *,
        processes: Sequence[EngineProcess] = (),
        hang_timeout: float | None = None,
    ) -> None:
        self._session = session
        self._processes = processes  # the client's list (add_engines extends it)
        self._hang_timeout = hang_timeout
        self._sockets = sockets
        self._input = sockets.input
        self._wire = wire
        # The receive loop's decode, bound once: EngineCoreOutputs or the codec's
        # EngineCoreDead singleton.
        self._decode = wire.decode_message
        self._apply = apply
        # What apply does for a QueueRaw, for a run of messages: the raw mailbox's put_many.
        self._queue_raws = queue_raws
        self._join = join
        self.closing = False  # open_client is closing: a closed socket is no death
        self._receiving = False
        self._scope: anyio.CancelScope | None = None
        self._raw_batch = False  # the last receive batch queued raw outputs
        self.budget = ListenBudget()  # the streams' listeners' time, per receive batch

    def die(self, message: str, cause: BaseException | None = None) -> None:
        self._apply(self._session.rank_died(None, message, cause))

    def wake(self) -> None:
        """A death was noticed: the receive task drains, then declares it; without a
        receive task running it is declared at once."""
        if not self._receiving:
            self._apply(self._session.declare_noticed())
        elif self._scope is not None:
            self._scope.cancel()

    async def receive_loop(self) -> None:
        """Receive task for the output socket; ends on close or death, never raises."""
        socket = self._sockets.output
        session = self._session
        budget = self.budget
        self._receiving = True
        try:
            while not session.dead:
                # One cancel scope per wake-up, not per batch: entering and leaving a
                # scope costs more than a short wait (the transport notes the same).
                # Only wake() cancels it, and only the await in receive_batch sees
                # that: a cancelled receive dequeued nothing (transport contract), and
                # the batch handling below is synchronous.
                with anyio.CancelScope() as scope:
                    self._scope = scope
                    if session.noticed:
                        scope.cancel()
                    while not session.noticed:
                        if self._raw_batch:
                            limit, count = _RAW_BATCH_BYTES, _RAW_BATCH_MESSAGES
                        else:
                            limit, count = _STREAM_BATCH_BYTES, _STREAM_BATCH_MESSAGES
                        batch = await socket.receive_batch(count, max_bytes=limit)
                        budget.until = _monotonic() + LISTEN_INTERVAL
                        if self._raw_batch:
                            raw_batch = self._handle_raw(batch)
                        else:
                            raw_batch = self._handle(batch)
                        if session.death is not None:
                            return
                        self._raw_batch = raw_batch
                self._scope = None
                if session.noticed:
                    await self.drain_after_exit(socket)
                    self._apply(session.declare_noticed())
        except anyio.ClosedResourceError:
            if not self.closing:
                self.die("output socket closed")
        except ProtocolError as exc:
            self.die(f"protocol error on the output socket: {exc}", exc)
        except Exception as exc:  # cancellation is a BaseException: it passes through
            self.die(f"receive task failed: {exc!r}", exc)
        finally:
            self._scope = None
            self._receiving = False

    def _handle(self, batch: list[list[InFrame]]) -> bool:
        """Decode and route a receive batch, one message after the other (each handled
        while its objects are fresh: at 64 outputs per message a stream batch is ~25,000
        outputs); True if raw outputs were queued. Returns early on a death."""
        decode = self._decode
        receive = self._session.receive
        apply = self._apply
        session = self._session
        raw_batch = False
        for frames in batch:
            decoded: Any = decode(frames)
            actions = receive(None if decoded is _DEAD else decoded)
            if actions:
                if type(actions[-1]) is QueueRaw:  # appended last
                    raw_batch = True
                apply(actions)
            if session.death is not None:
                break
        return raw_batch

    def _handle_raw(self, batch: list[list[InFrame]]) -> bool:
        """`_handle` after a batch that queued raw outputs (the raw API's receive batch,
        at most _RAW_BATCH_BYTES): the whole batch decoded first, then one
        `receive_wholes` call and one queueing per run of plain raw messages instead of
        two calls per message; the rest goes to `receive`. A message that fails to
        decode fails the client after those before it were handled."""
        decode = self._decode
        messages: list[Any] = []
        failure: Exception | None = None
        try:
            for frames in batch:
                messages.append(decode(frames))
        except Exception as exc:
            failure = exc
        session = self._session
        wholes = session.receive_wholes
        raw_batch = False
        n = len(messages)
        i = 0
        while i < n:
            taken = wholes(messages, i)
            if taken:
                # The raw API's messages, queued without an action list (receive_wholes
                # did their bookkeeping).
                raw_batch = True
                self._queue_raws(messages if taken == n else messages[i : i + taken])
                i += taken
                continue
            decoded = messages[i]
            i += 1
            actions = session.receive(None if decoded is _DEAD else decoded)
            if actions:
                if type(actions[-1]) is QueueRaw:  # appended last
                    raw_batch = True
                self._apply(actions)
            if session.death is not None:
                return raw_batch
        if failure is not None:
            raise failure
        return raw_batch

    async def drain_after_exit(self, socket: AsyncSocket) -> None:
        """Handle what a dead engine sent before its death was noticed: read until the
        socket has been quiet for a few ms (ZeroMQ's I/O thread may still be moving the
        last messages from the kernel), or until only other engines' outputs came for
        ``_EXIT_DRAIN_S`` (at least ``_EXIT_OTHERS`` of them).

        The dead engine's backlog is finite and is handled whole, however long that
        takes on a loaded machine: a wall-clock cap on the drain (30 ms in all, or since
        the dead rank's last output) cut 1,000 queued outputs at 172-873 when the
        process lost the CPU for tens of ms. Only other engines' traffic, which need not
        end, is cut off; ZeroMQ queues fairly, so while the dead rank's pipe holds
        messages, few others come between two of them.
        """
        session = self._session
        dead_ranks = session.noticed_ranks
        started = anyio.current_time()
        others_since: float | None = None  # first other output since the dead's last
        others = 0
        quiet_since: float | None = None
        drained = 0
        while not session.dead:
            # Checked on every message, not only when the socket is empty: with data
            # parallelism other engines share the socket, and one that keeps it full
            # would otherwise hold the death back until it goes quiet (10-13 s, seen).
            now = anyio.current_time()
            if (
                others_since is not None
                and others >= _EXIT_OTHERS
                and now - others_since >= _EXIT_DRAIN_S
            ) or (dead_ranks is None and now - started >= _EXIT_DRAIN_MAX_S):
                logger.debug("drain before a death: cut off after %d messages", drained)
                return
            try:
                frames = socket.receive_nowait()
            except anyio.WouldBlock:
                if quiet_since is None:
                    quiet_since = now
                if now - quiet_since >= _EXIT_QUIET_S:
                    logger.debug("drain before a death: quiet after %d messages", drained)
                    return
                await anyio.sleep(0.001)
                continue
            quiet_since = None
            drained += 1
            outputs = self._wire.decode_outputs(frames)
            if dead_ranks is None or outputs is None or outputs.engine_index in dead_ranks:
                others_since, others = None, 0
            else:
                if others_since is None:
                    others_since = now
                others += 1
            self._apply(session.receive(outputs))

    async def guard_input(self) -> None:
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
            while not self._session.dead:
                for message in await self._input.receive_batch():
                    identity = _bytes(message[0]) if message else b""
                    try:
                        rank: int | None = rank_for_identity(identity)
                    except ProtocolError:
                        rank = None
                    verdict = self._session.input_message(rank)
                    join = self._join()
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
                    self.die(f"protocol error on the input socket: {exc}", exc)
                    return
        except anyio.ClosedResourceError:
            return
        except Exception as exc:  # cancellation is a BaseException: it passes through
            self.die(f"input socket failed: {exc!r}", exc)

    async def _watch_disconnects(self, monitor: AsyncSocket) -> None:
        endpoint_ranks = self._sockets.endpoint_ranks
        try:
            while not self._session.dead:
                for frames in await monitor.receive_batch():
                    event = parse_monitor_message([_bytes(f) for f in frames])
                    if event["event"] != zmq.EVENT_DISCONNECTED or self.closing:
                        continue
                    raw_endpoint: object = event["endpoint"]
                    endpoint = (
                        raw_endpoint.decode(errors="replace")
                        if isinstance(raw_endpoint, bytes)
                        else str(raw_endpoint)
                    )
                    if endpoint in self._sockets.hang_ranks:
                        await self._hung_connection(endpoint)
                        continue
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
                    if self._hang_timeout is not None:
                        message += (
                            f", or it did not answer heartbeats for {self._hang_timeout:g} s"
                            " (hang_timeout)"
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
                    self.wake()
        except anyio.ClosedResourceError:
            return
        except Exception as exc:  # cancellation is a BaseException: it passes through
            self.die(f"input socket monitor failed: {exc!r}", exc)

    async def _hung_connection(self, endpoint: str) -> None:
        """A spawned engine's connection dropped: libzmq closes one that did not answer
        heartbeats for ``hang_timeout``. Unless its process exits within a grace (then
        the process watcher declares that, exit code and all), its ranks are noticed
        dead of a hang, through the one death path (drain, then declare)."""
        session = self._session
        hang_timeout = self._hang_timeout
        assert hang_timeout is not None  # hang_ranks is filled only with heartbeats on

        def live() -> list[int]:
            return [
                r
                for r in self._sockets.hang_ranks[endpoint]
                if session.state(r) in (RankState.LIVE, RankState.RETIRING)
            ]

        def over() -> bool:  # a function: mypy would keep ``session.dead`` narrowed
            return session.dead or self.closing

        ranks = live()
        if not ranks or over():
            return
        processes = [p for p in self._processes if set(p.ranks) & set(ranks)]
        deadline = anyio.current_time() + _EXIT_GRACE_S
        while anyio.current_time() < deadline:
            if any(p.exited.is_set() for p in processes) or over():
                return
            await anyio.sleep(0.02)
        ranks = live()
        if not ranks or over():
            return
        message = hang_message(ranks, hang_timeout)
        if session.on_engine_death == "continue":
            for rank in ranks:
                session.notice_rank(rank, message)
        else:
            session.notice_rank(ranks[0] if len(ranks) == 1 else None, message)
        logger.warning("%s", message)
        self.wake()
