"""Virtual time next to real engine processes.

trio's `MockClock` makes a test's own timers (back-off sleeps,
deadlines) deterministic, but engine processes live in real time. The kit therefore
switches a mock clock to real time (``rate=1``, no autojump) for the moments it waits on
an engine itself: startup, shutdown, control commands and settle polls. Outside those
moments the clock is the test's. On asyncio (or with trio's default clock) everything
here is a no-op.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

import trio
import trio.testing

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["engine_mock_clock", "real_time"]

# clock id -> (nesting depth, saved rate, saved autojump threshold)
_phases: dict[int, tuple[int, float, float]] = {}


def _current_mock_clock() -> trio.testing.MockClock | None:
    try:
        clock = trio.lowlevel.current_clock()
    except RuntimeError:  # not inside trio.run (e.g. on asyncio)
        return None
    return clock if isinstance(clock, trio.testing.MockClock) else None


@contextlib.contextmanager
def real_time() -> Iterator[None]:
    """Run the enclosed block in real time even under a trio ``MockClock``.

    While any such block is active, the mock clock advances with the wall clock
    (``rate = 1``) and never autojumps, so deadlines in the block mean real seconds and
    an engine that takes a moment to answer does not make virtual time leap. Every task
    sees this while it lasts; keep the block short. Nests; synchronous (no checkpoint).
    """
    clock = _current_mock_clock()
    if clock is None:
        yield
        return
    key = id(clock)
    depth, rate, threshold = _phases.get(key, (0, clock.rate, clock.autojump_threshold))
    if depth == 0:
        clock.autojump_threshold = math.inf
        clock.rate = 1.0
    _phases[key] = (depth + 1, rate, threshold)
    try:
        yield
    finally:
        depth, rate, threshold = _phases[key]
        if depth == 1:
            del _phases[key]
            clock.rate = rate
            clock.autojump_threshold = threshold
        else:
            _phases[key] = (depth - 1, rate, threshold)


def engine_mock_clock(autojump_threshold: float = 0.25) -> trio.testing.MockClock:
    """A trio ``MockClock`` suited to tests that talk to real engine processes.

    Virtual time stands still (``rate=0``) and jumps to the next deadline once every
    task has been blocked for ``autojump_threshold`` *real* seconds. Pick a threshold
    well above the engine's response time (a few ms on an idle machine): a wait on the
    engine that lasts longer than the threshold lets virtual time leap to the next
    pending deadline, which can fire a timeout early. Each virtual sleep costs that
    many real seconds. The kit's own waits run in real time (see `real_time`).

    Pass it to ``trio.run(..., clock=...)``, return it from a fixture (pytest-trio uses
    any fixture whose value is a clock), or from ``anyio_backend`` as
    ``("trio", {"clock": engine_mock_clock()})`` with anyio's plugin.
    """
    return trio.testing.MockClock(rate=0.0, autojump_threshold=autojump_threshold)
