"""Getting engines connected: binding, spawning and the handshake, for startup and joins.

`open_client` and `add_engines` run
the same code here: `Sockets` binds the input and output sockets for each
source's layout (once per distinct layout) and a handshake socket per run;
`start_engines` spawns the sources' processes, starts their watchers in the
client's task group and serves the handshake (`HandshakeRun`, over the
sans-I/O `ClientHandshake`) until every engine is
ready, one failed or the deadline passed. Nothing here decides what a death means;
that is the session's.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import anyio
import anyio.abc
import zmq

from .._exceptions import EngineStartupError, ProtocolError
from ..protocol.handshake import (
    ClientHandshake,
    HandshakeComplete,
    HandshakeEvent,
    SendInitMetadata,
    rank_for_identity,
)
from ..transport import AsyncSocket, PrivateIpcDir, tcp_endpoint
from ._args import DEFAULT_READY_TIMEOUT, ready_timeout

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from ..protocol.liveness import HeartbeatTiming
    from ._engines import EngineSource, SocketLayout
    from ._process import EngineProcess

__all__ = [
    "DEFAULT_READY_TIMEOUT",
    "DEFAULT_SHUTDOWN_GRACE",
    "HandshakeRun",
    "Sockets",
    "SourceSet",
    "StartupProgress",
    "connect_engines",
    "default_ready_timeout",
    "start_engines",
    "stop_processes",
]

DEFAULT_SHUTDOWN_GRACE: Final = 5.0
_UNBOUNDED: Final[dict[int, int | bytes | str]] = {zmq.RCVHWM: 0, zmq.SNDHWM: 0}

logger = logging.getLogger("trio_vllm.client")


def default_ready_timeout() -> float:
    """``VLLM_ENGINE_READY_TIMEOUT_S`` or 600 s (``ValueError`` for a bad variable)."""
    return ready_timeout(None)


@dataclass(frozen=True, slots=True)
class StartupProgress:
    """Where startup stands; passed to ``open_client(on_progress=...)`` on every change."""

    expected: tuple[int, ...]
    connected: tuple[int, ...]
    ready: tuple[int, ...]
    responded: tuple[int, ...]
    elapsed: float
    event: HandshakeEvent | None


class SourceSet:
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
        attached = [s for s in self.sources if s.client_count > 1 or s.client_index > 0]
        if attached and len(self.sources) > 1:
            raise ValueError(
                "AttachedEngines cannot be combined with other engine sources: a client "
                "attached to shared engines has exactly those engines"
            )
        self.layouts = [source.layout() for source in self.sources]

    def describe(self) -> str:
        return " + ".join(source.describe() for source in self.sources)

    def startup_hint(self) -> str:
        hints = dict.fromkeys(source.startup_hint() for source in self.sources)
        return " ".join(hints)


# ---------------------------------------------------------------------- sockets


class Sockets:
    """Every socket of one client, and where each source's engines reach them.

    One input ROUTER and one output PULL serve every engine (ROUTER routes by identity
    whatever endpoint a peer came through); each distinct layout gets endpoints bound
    where its engines can reach them. Watched (external) sources get endpoints of
    their own, so that a dropped connection names its ranks (``endpoint_ranks``).
    Construction raises (and leaves nothing open) if a socket cannot be made.
    """

    def __init__(
        self, *, watch_disconnects: bool, heartbeat: HeartbeatTiming | None = None
    ) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=2)
        self.ipc_dir = PrivateIpcDir()
        self.all: list[AsyncSocket] = []
        self.monitor: AsyncSocket | None = None
        self.endpoint_ranks: dict[str, list[int]] = {}
        # With heartbeats: the bound input of each spawned (process-watched) engine ->
        # its rank. Each such rank gets an endpoint of its own (handshake_parts), so
        # that a connection dropped for silence names it.
        self.heartbeat = heartbeat
        self.hang_ranks: dict[str, list[int]] = {}
        # layout key -> (bound input, advertised input, advertised output)
        self._data: dict[tuple[str | None, str | None, int], tuple[str, str, str]] = {}

        self._watched = itertools.count()
        self._handshakes = itertools.count()
        try:
            if watch_disconnects or heartbeat is not None:
                self.input = self._monitored_input()
            else:
                self.input = self._create(zmq.ROUTER)
            self.output = self._create(zmq.PULL)
        except BaseException:
            self.close()
            raise

    def _create(self, kind: int) -> AsyncSocket:
        socket = AsyncSocket.create(self.context, kind, options=_UNBOUNDED)
        self.all.append(socket)
        return socket

    def _monitored_input(self) -> AsyncSocket:
        # The monitor is attached before the socket is wrapped (and bound): the wrapper
        # must be the only user of the socket afterwards.
        raw = self.context.socket(zmq.ROUTER)
        try:
            raw.setsockopt(zmq.LINGER, 0)
            raw.setsockopt(zmq.ROUTER_MANDATORY, 1)
            for option in _UNBOUNDED:
                raw.setsockopt(option, 0)
            if self.heartbeat is not None:
                # Before any bind: a listener copies the socket's options when it is
                # made, and every connection it accepts gets them. libzmq then PINGs
                # each engine every interval and drops a connection that brought
                # nothing for timeout after a PING (ZMTP 3.1; the engine's libzmq I/O
                # thread answers, whatever its Python does).
                raw.setsockopt(zmq.HEARTBEAT_IVL, self.heartbeat.interval_ms)
                raw.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.heartbeat.timeout_ms)
            address = f"inproc://trio-vllm-monitor-{id(raw)}"
            raw.monitor(address, zmq.EVENT_DISCONNECTED)
            socket = AsyncSocket(raw)
        except BaseException:
            raw.close(linger=0)
            raise
        self.all.append(socket)
        self.monitor = AsyncSocket.create(self.context, zmq.PAIR)
        self.all.append(self.monitor)
        self.monitor.connect(address)
        return socket

    def bind_data(self, layout: SocketLayout, ranks: Sequence[int]) -> tuple[str, str, str]:
        """The (bound input, advertised input, advertised output) for a source."""
        hang_watched = self.heartbeat is not None and not layout.watch_disconnects
        own = next(self._watched) if layout.watch_disconnects or hang_watched else -1
        key = (layout.data_host, layout.data_bind_host, own)
        if layout.attach is not None:
            key = (*layout.attach, own)
        if key not in self._data:
            suffix = str(len(self._data) or "")
            if layout.attach is not None:
                bound_in = _bind(self.input, layout.attach[0], "input")
                bound_out = _bind(self.output, layout.attach[1], "output")
                self._data[key] = (bound_in, bound_in, bound_out)
            elif layout.data_host is None:
                bound_in = _bind(self.input, self.ipc_dir.endpoint(f"input{suffix}"), "input")
                bound_out = _bind(self.output, self.ipc_dir.endpoint(f"output{suffix}"), "output")
                self._data[key] = (bound_in, bound_in, bound_out)
            else:
                bind = tcp_endpoint(layout.data_bind_host or layout.data_host, 0)
                bound_in = _bind(self.input, bind, "input")
                self._data[key] = (
                    bound_in,
                    _advertised(bound_in, layout.data_host),
                    _advertised(_bind(self.output, bind, "output"), layout.data_host),
                )
        if hang_watched:
            self.hang_ranks.setdefault(self._data[key][0], []).extend(ranks)
        return self._data[key]

    def watch(self, bound_input: str, ranks: Sequence[int]) -> None:
        """A dropped connection on ``bound_input`` now means ``ranks`` are gone."""
        self.endpoint_ranks.setdefault(bound_input, []).extend(ranks)

    def handshake_socket(self) -> AsyncSocket:
        return self._create(zmq.ROUTER)

    def bind_handshakes(self, socket: AsyncSocket, layouts: Sequence[SocketLayout]) -> list[str]:
        """Bind ``socket`` for each layout (one ipc path, or each layout's address);
        returns the address each source's engines are given."""
        binds: dict[str, str] = {}
        addresses: list[str] = []
        for layout in layouts:
            if layout.attach is not None:
                addresses.append("")  # attached: the sharing process did the handshake
                continue
            wanted = layout.handshake_bind or "ipc"
            if wanted not in binds or wanted.endswith(":0"):
                if layout.handshake_bind is None:
                    name = f"handshake{next(self._handshakes) or ''}"
                    address = _bind(socket, self.ipc_dir.endpoint(name), "handshake")
                else:
                    address = _bind(socket, layout.handshake_bind, "handshake")
                    if layout.data_host is not None:
                        address = _advertised(address, layout.data_host)
                binds[wanted] = address
            addresses.append(binds[wanted])
        return addresses

    def addresses(self, handshakes: Sequence[str]) -> dict[str, str]:
        """The ``addresses`` property: ``input``, ``output``, ``handshake``, then numbered."""
        found: dict[str, str] = {}
        for i, (_bound, advertised_in, advertised_out) in enumerate(self._data.values()):
            found[f"input{i or ''}"] = advertised_in
            found[f"output{i or ''}"] = advertised_out
        for i, address in enumerate(a for a in handshakes if a):
            found[f"handshake{i or ''}"] = address
        return found

    def close(self) -> None:
        """Close every socket, the context and the ipc directory; never blocks."""
        for socket in self.all:
            socket.close(linger=0)
        self.context.destroy(linger=0)  # closes anything left open
        self.ipc_dir.cleanup()


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


# ---------------------------------------------------------------------- handshake


class _Handshakes:
    """One `ClientHandshake` per source (each advertises its own addresses),
    seen as one: messages are dispatched by the sender's rank."""

    def __init__(self, parts: Sequence[ClientHandshake]) -> None:
        self._parts = list(parts)
        self._by_rank = {rank: part for part in self._parts for rank in part.ranks}
        self._done: dict[int, HandshakeComplete] = {}
        self._complete = False

    @property
    def ranks(self) -> list[int]:
        return sorted(self._by_rank)

    def union(self, name: str) -> tuple[int, ...]:
        return tuple(sorted(r for p in self._parts for r in getattr(p, name)))

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
        responses: dict[int, Mapping[str, object]] = {}
        for done in self._done.values():
            responses.update(done.ready_responses)
        kept.append(HandshakeComplete(dict(sorted(responses.items())), versions.pop()))
        return kept


class HandshakeRun:
    """One startup or join in progress: fed from the handshake socket and (directly at
    startup, through the client's input guard for a join) from the input socket.

    Ends (``done``) complete, failed (``error``; ``exited`` if an engine exited) or
    not at all (the caller's deadline). Never raises into its feeders.
    """

    def __init__(
        self,
        parts: Sequence[ClientHandshake],
        on_progress: Callable[[StartupProgress], None] | None = None,
    ) -> None:
        self.handshake = _Handshakes(parts)
        self.ranks = frozenset(self.handshake.ranks)
        self.done = anyio.Event()
        self.started_at = time.monotonic()
        self.on_progress = on_progress
        self.error: BaseException | None = None
        self.complete: HandshakeComplete | None = None
        self.exited: EngineProcess | None = None

    def fail(self, error: BaseException, exited: EngineProcess | None = None) -> None:
        if self.error is None and self.complete is None:
            self.error = error
            self.exited = exited
        self.done.set()

    def process_exited(self, process: EngineProcess) -> bool:
        """An engine exited; True if that ended this run (it was still going)."""
        if self.done.is_set():
            return False
        self.fail(EngineStartupError(process.describe_exit()), exited=process)
        return True

    def report(self, event: HandshakeEvent | None) -> None:
        if event is not None:
            logger.debug("handshake: %s", type(event).__name__)
        if self.on_progress is None:
            return
        hs = self.handshake
        self.on_progress(
            StartupProgress(
                expected=tuple(hs.ranks),
                connected=hs.union("connected"),
                ready=hs.union("ready"),
                responded=hs.union("responded"),
                elapsed=time.monotonic() - self.started_at,
                event=event,
            )
        )

    def _feed(self, events: list[HandshakeEvent]) -> list[SendInitMetadata]:
        replies = []
        for event in events:
            if isinstance(event, SendInitMetadata):
                replies.append(event)
            elif isinstance(event, HandshakeComplete):
                self.complete = event
            self.report(event)
        if self.complete is not None:
            self.done.set()
        return replies

    def receive_input(self, identity: bytes, payload: bytes) -> None:
        """A ready response on the input socket."""
        try:
            self._feed(self.handshake.receive_input(identity, payload))
        except ProtocolError as exc:
            self.fail(exc)

    async def serve(self, socket: AsyncSocket) -> None:
        """The handshake-socket side; records errors, never raises them."""
        try:
            while not self.handshake.handshake_socket_done and self.complete is None:
                for message in await socket.receive_batch():
                    if len(message) != 2:
                        raise ProtocolError(
                            f"handshake message with {len(message)} frames (expected "
                            "[identity][payload])"
                        )
                    events = self.handshake.receive_handshake(
                        _bytes(message[0]), _bytes(message[1])
                    )
                    for reply in self._feed(events):
                        await socket.send([reply.identity, reply.payload])
        except (ProtocolError, anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            self.fail(exc)

    async def read_ready(self, socket: AsyncSocket) -> None:
        """The input-socket side at startup (the guard does it for a join)."""
        try:
            while self.complete is None:
                for message in await socket.receive_batch():
                    if len(message) != 2:
                        raise ProtocolError(
                            f"ready response with {len(message)} frames (expected "
                            "[identity][payload])"
                        )
                    self.receive_input(_bytes(message[0]), _bytes(message[1]))
        except (ProtocolError, anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            self.fail(exc)

    def failure(
        self,
        engines: SourceSet,
        processes: Sequence[EngineProcess],
        *,
        timed_out: float | None,
    ) -> EngineStartupError:
        """The error to raise for a run that did not complete."""
        waiting = self.handshake.describe_waiting()
        if self.exited is not None:
            return EngineStartupError(
                f"engine startup failed: {self.exited.describe_exit()}\n"
                f"(while {waiting}). Fix the engine's error shown above and try again."
            )
        if self.error is not None:
            error = EngineStartupError(
                f"engine startup failed for {engines.describe()}: {self.error}"
            )
            error.__cause__ = self.error
            return error
        lines = [
            f"engines did not become ready within {timed_out:g} s ({engines.describe()}): "
            f"{waiting}.",
            engines.startup_hint(),
        ]
        for process in processes:
            tail = process.output_tail(10)
            if tail:
                indented = "\n".join("    " + line for line in tail.splitlines())
                lines.append(f"last output of {process.name} (pid {process.pid}):\n{indented}")
        return EngineStartupError("\n".join(lines))


def _bytes(frame: object) -> bytes:
    return frame if isinstance(frame, bytes) else bytes(frame.bytes)  # type: ignore[attr-defined]


def handshake_parts(
    sockets: Sockets, engines: SourceSet
) -> tuple[list[ClientHandshake], list[tuple[str, list[int]]]]:
    """Bind the data sockets for each source; its handshake state machine and the
    (bound input, ranks) of the watched ones (to watch once they serve)."""
    parts: list[ClientHandshake] = []
    watched: list[tuple[str, list[int]]] = []
    for source, layout in zip(engines.sources, engines.layouts, strict=True):
        groups = [source.ranks]
        if sockets.heartbeat is not None and not layout.watch_disconnects:
            # Spawned engines, heartbeats on: an endpoint pair per rank (each engine is
            # told its own in the init metadata), so that a connection dropped for
            # silence names that rank alone, not every rank of the source.
            groups = [[rank] for rank in source.ranks]
        for ranks in groups:
            bound_in, source_input, source_output = sockets.bind_data(layout, ranks)
            if layout.watch_disconnects:
                watched.append((bound_in, ranks))
            parts.append(
                ClientHandshake(
                    ranks,
                    inputs=[source_input],
                    outputs=[source_output],
                    expect_local=layout.expect_local,
                    expect_headless=layout.expect_headless,
                    stage="both" if layout.attach is None else "input",
                )
            )
    return parts, watched


async def start_engines(
    run: HandshakeRun,
    engines: SourceSet,
    handshake_socket: AsyncSocket,
    addresses: Sequence[str],
    *,
    processes: list[EngineProcess],
    task_group: anyio.abc.TaskGroup,
    on_exit: Callable[[EngineProcess], None],
    input_socket: AsyncSocket | None,
    ready_timeout: float,
) -> None:
    """Spawn every source's engines (into ``processes``, the caller's list, so that it
    can stop them whatever happens), watch them from ``task_group`` and serve the
    handshake until ``run`` is done; raises `EngineStartupError` if it did not
    complete. ``input_socket``: read ready responses here (startup) rather than have
    the client's input guard feed them (a join)."""
    logger.info("starting %s (ranks %s)", engines.describe(), engines.ranks)
    with anyio.move_on_after(ready_timeout) as waited:
        for source, address in zip(engines.sources, addresses, strict=True):
            try:
                spawned = await source.spawn(address)
            except OSError as exc:
                raise EngineStartupError(
                    f"cannot start {source.describe()}: {exc}. Check the python "
                    "executable and the command line."
                ) from exc
            processes.extend(spawned)
            for process in spawned:  # _process.py logs each spawn
                task_group.start_soon(process.watch, on_exit)
        run.report(None)
        async with anyio.create_task_group() as tg:
            tg.start_soon(run.serve, handshake_socket)
            if input_socket is not None:
                tg.start_soon(run.read_ready, input_socket)
            await run.done.wait()
            tg.cancel_scope.cancel()
    if run.complete is None:
        error = run.failure(
            engines, processes, timed_out=ready_timeout if waited.cancelled_caught else None
        )
        logger.warning("%s", str(error).splitlines()[0])
        raise error
    logger.info(
        "engines ready: ranks %s, vLLM %s, %.2f s",
        sorted(run.complete.ready_responses),
        run.complete.vllm_version,
        time.monotonic() - run.started_at,
    )


async def stop_processes(processes: Sequence[EngineProcess], grace: float) -> None:
    """SIGTERM, ``grace``, SIGKILL and reap each, concurrently; shielded."""
    if not processes:
        return
    with anyio.CancelScope(shield=True):
        async with anyio.create_task_group() as tg:
            for process in processes:
                tg.start_soon(process.stop, grace)


@dataclass(frozen=True, slots=True)
class Connected:
    """A completed startup or join: what the engines said and where they were sent."""

    complete: HandshakeComplete
    handshakes: list[str]  # the handshake address each source was given
    watched: list[tuple[str, list[int]]]  # (bound input, ranks) to watch once they serve


async def connect_engines(
    sockets: Sockets,
    engines: SourceSet,
    *,
    processes: list[EngineProcess],
    task_group: anyio.abc.TaskGroup,
    on_exit: Callable[[EngineProcess], None],
    input_socket: AsyncSocket | None,
    ready_timeout: float,
    on_progress: Callable[[StartupProgress], None] | None = None,
    on_run: Callable[[HandshakeRun], None] | None = None,
) -> Connected:
    """The one path from engine sources to ready engines, for startup and for joins:
    bind the data sockets, bind a handshake socket (closed when done), spawn and
    watch, serve the handshake. An exit after the handshake went to ``on_exit``
    (before, it fails the run). ``on_run`` gets the run first (a join's ready
    responses arrive through the client's input guard). Raises
    `EngineStartupError`; spawned processes are in ``processes`` either way."""
    parts, watched = handshake_parts(sockets, engines)
    run = HandshakeRun(parts, on_progress)
    if on_run is not None:
        on_run(run)

    def exited(process: EngineProcess) -> None:
        if not run.process_exited(process):
            on_exit(process)

    handshake_socket = sockets.handshake_socket()
    try:
        addresses = sockets.bind_handshakes(handshake_socket, engines.layouts)
        await start_engines(
            run,
            engines,
            handshake_socket,
            addresses,
            processes=processes,
            task_group=task_group,
            on_exit=exited,
            input_socket=input_socket,
            ready_timeout=ready_timeout,
        )
    finally:
        handshake_socket.close()
    assert run.complete is not None
    return Connected(run.complete, addresses, watched)
