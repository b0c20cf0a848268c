"""Scaling a running client: `add_engines` (a join) and `retire_rank`.

A join runs the startup path (``_startup.connect_engines``) against the running
client: the new engines get a handshake socket of their own, their ready responses
come through the input guard, and nothing of the client changes until the handshake
completed (then the commit has no checkpoint). A retirement takes the rank out of
routing at once, waits for (or aborts) its requests and stops a process that served
that rank alone. The session holds the rules of both; this is their I/O.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import anyio
import anyio.abc

from .._exceptions import EngineStartupError
from ..protocol.session import RankState
from . import _args
from ._engines import check_add_engines
from ._startup import SourceSet, connect_engines, stop_processes

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ..protocol.session import DeathRecord
    from ._engines import EngineSource
    from ._process import EngineProcess
    from ._startup import HandshakeRun, Sockets
    from ._types import Session, ShellAction
    from ._wire import Wire

__all__ = ["Scaling"]

logger = logging.getLogger("trio_vllm.client")


class Scaling:
    """The join in progress (at most one) and the waiters of draining retirements."""

    def __init__(
        self,
        *,
        session: Session,
        sockets: Sockets,
        wire: Wire,
        processes: list[EngineProcess],
        ready_responses: dict[int, dict[str, object]],
        task_group: anyio.abc.TaskGroup,
        shutdown_grace: float,
        check_alive: Callable[[], None],
        apply: Callable[[list[ShellAction]], None],
        abort_requests: Callable[[list[str]], Awaitable[None]],
        on_process_exit: Callable[[EngineProcess], None],
    ) -> None:
        self._session = session
        self._sockets = sockets
        self._wire = wire
        self._processes = processes  # the client's list: joined processes are added
        self._ready_responses = ready_responses  # the client's map, updated on a join
        self._task_group = task_group
        self._shutdown_grace = shutdown_grace
        self._check_alive = check_alive
        self._apply = apply
        self._abort_requests = abort_requests
        self._on_process_exit = on_process_exit
        self.join: HandshakeRun | None = None  # the input guard feeds it ready responses
        self._drained: dict[int, anyio.Event] = {}  # retire_rank waiters

    def rank_drained(self, rank: int) -> None:
        """The session's `RankDrained`: wake the retirement waiting on ``rank``."""
        drained = self._drained.get(rank)
        if drained is not None:
            drained.set()

    def client_died(self, record: DeathRecord) -> None:
        """Wake every retirement (they re-check) and fail the join with the death."""
        for drained in self._drained.values():
            drained.set()
        if self.join is not None:
            self.join.fail(record.error())

    async def retire(self, rank: int, drain: bool) -> None:
        """`EngineCoreClient.retire_rank`, after the owner check."""
        _args.check_rank(rank)
        self._check_alive()
        session = self._session
        ids = session.begin_retire(rank)
        logger.info("retiring engine rank %d (drain=%s)", rank, drain)
        if not drain and ids:
            await self._abort_requests(ids)
        if session.in_flight(rank) > 0:
            drained = self._drained.setdefault(rank, anyio.Event())
            await drained.wait()
            self._check_alive()
            if session.state(rank) is RankState.LOST:
                raise session.rank_record(rank).error()  # it died while draining
        self._drained.pop(rank, None)
        actions = session.finish_retire(rank)  # its exit is expected from now on
        for process in self._processes:
            if process.ranks == (rank,):
                await process.stop(self._shutdown_grace)
        self._apply(actions)

    def _set_join(self, run: HandshakeRun) -> None:
        self.join = run

    async def add(self, source: EngineSource, ready_timeout: float | None) -> list[int]:
        """`EngineCoreClient.add_engines`, after the owner check."""
        check_add_engines(source, ready_timeout)
        self._check_alive()
        if self.join is not None:
            raise RuntimeError("another add_engines call is in progress")
        engines = SourceSet(source)
        if engines.layouts[0].watch_disconnects and self._sockets.monitor is None:
            raise ValueError(
                "external engines can join only a client that started with an external "
                "source (its input socket has no connection monitor)"
            )
        timeout = _args.ready_timeout(ready_timeout)
        self._session.begin_join(engines.ranks)
        processes: list[EngineProcess] = []
        try:
            try:
                connected = await connect_engines(
                    self._sockets,
                    engines,
                    processes=processes,
                    task_group=self._task_group,
                    on_exit=self._on_process_exit,
                    input_socket=None,  # the input guard feeds the join
                    ready_timeout=timeout,
                    on_run=self._set_join,
                )
            except EngineStartupError:
                self._check_alive()  # the client died meanwhile: say that instead
                raise
            version = connected.complete.vllm_version
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
            self.join = None
        # Commit (no checkpoint since the handshake completed).
        for rank, response in connected.complete.ready_responses.items():
            self._ready_responses[rank] = dict(response)
        self._session.join_complete(engines.ranks)
        self._wire.set_limits(self._ready_responses)
        self._processes.extend(processes)
        for bound_input, ranks in connected.watched:
            self._sockets.watch(bound_input, ranks)
        logger.info("engine ranks %s joined", engines.ranks)
        return engines.ranks
