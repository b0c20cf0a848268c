"""The stall watch's I/O: one task that ticks the sans-I/O `StallWatch` and sends its
probes (``protocol/liveness.py`` holds the rules; docs/reliability.md the why).

The task and its probes run in the client's task group, end when the client dies or
closes, and never raise: a probe that fails (the rank died, the engine refused the
method) is simply no answer, and a dead verdict goes through the one death path
(`ClientSession.notice_rank`, then the receiver drains and declares).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import anyio

from .._exceptions import TrioVllmError
from ..protocol.liveness import StallWatch, stall_message

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._types import Session

__all__ = ["watch_stalls"]

logger = logging.getLogger("trio_vllm.client")


async def watch_stalls(
    session: Session,
    stall_timeout: float,
    call: Callable[[int], Awaitable[object]],
    wake: Callable[[], None],
) -> None:
    """Tick a `StallWatch` every quarter of ``stall_timeout`` until the client is dead;
    ``call(rank)`` sends one probe, ``wake`` makes the receiver declare a noticed death.
    Cancellation (the client closing) ends it and its probes."""
    watch = StallWatch(stall_timeout)

    async def probe(rank: int) -> None:
        try:
            await call(rank)
        except (TrioVllmError, ValueError) as exc:
            # A dead or gone rank, or the engine refused the method: either way the
            # answer (if any) already counted as heard; nothing to do here.
            logger.debug("stall probe to rank %d: %r", rank, exc)

    def dead() -> bool:  # a function: mypy would keep ``session.dead`` narrowed
        return session.dead

    async with anyio.create_task_group() as probes:
        while not dead():
            await anyio.sleep(watch.period)
            if dead():
                break
            now = anyio.current_time()
            verdicts = watch.tick(
                now, [(r, session.in_flight(r), session.heard(r)) for r in session.live_ranks]
            )
            for rank in verdicts.probe:
                logger.info("rank %d silent %g s with work in flight: probe", rank, stall_timeout)
                probes.start_soon(probe, rank)
            if verdicts.dead:
                for rank in verdicts.dead:
                    message = stall_message(rank, stall_timeout)
                    logger.warning("%s", message)
                    session.notice_rank(rank, message)
                    if session.on_engine_death == "fail":
                        break
                wake()
        probes.cancel_scope.cancel()
