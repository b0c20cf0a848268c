"""Sans-I/O data-parallel bookkeeping: which engine gets a request, and DP waves.

`LoadBalancer` picks the engine for each request (docs/protocol.md §7.3): a pinned
rank if given, else the least loaded live rank, where load is
``max(own in-flight count, waiting + running from the engine's latest
scheduler_stats)``; ties go to the lowest rank (deterministic; vLLM rotates its
start index instead, which only matters for ties). `WaveTracker` is
the DP coordinator's wave role for MoE engines without a coordinator process
(§7.4/§7.5): it says when START_DP_WAVE must go to which ranks.

Nothing here does I/O or checkpoints; the client calls these methods under its own
invariants, so every decision can be tested byte for byte without sockets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["LoadBalancer", "StartWave", "WaveTracker"]


class LoadBalancer:
    """Request -> engine choice over a changing set of live ranks.

    ``started``/``ended`` keep the client's own in-flight count per rank (every start
    must be matched by exactly one end); ``update_stats`` records an engine's latest
    ``(waiting, running)``, which starts and ends then adjust until the next update.
    ``remove`` takes a rank out of routing (dead or retiring); its counts are kept.
    """

    def __init__(self, ranks: Iterable[int]) -> None:
        self._ranks: list[int] = sorted(set(ranks))
        self._live: set[int] = set(self._ranks)
        self._in_flight: dict[int, int] = dict.fromkeys(self._ranks, 0)
        self._stats: dict[int, int] = dict.fromkeys(self._ranks, 0)

    @property
    def live_ranks(self) -> list[int]:
        """Ranks new requests may go to, ascending."""
        return [r for r in self._ranks if r in self._live]

    def in_flight(self, rank: int) -> int:
        return self._in_flight[rank]

    def load(self, rank: int) -> int:
        """The score the choice minimises."""
        return max(self._in_flight[rank], self._stats[rank])

    def choose(self, pinned: int | None = None) -> int:
        """The rank for the next request; ``ValueError`` for an unknown or removed
        pinned rank, ``LookupError`` when no rank is live."""
        if pinned is not None:
            if pinned not in self._in_flight:
                raise ValueError(f"no engine with rank {pinned} (ranks: {self.live_ranks})")
            if pinned not in self._live:
                raise ValueError(
                    f"engine rank {pinned} no longer serves (dead or retired; live ranks: "
                    f"{self.live_ranks})"
                )
            return pinned
        live = self.live_ranks
        if not live:
            raise LookupError("no live engine")
        return min(live, key=lambda r: (self.load(r), r))

    def started(self, rank: int) -> None:
        self._in_flight[rank] += 1
        # Until the engine's next stats, count the request there too (as vLLM does).
        self._stats[rank] += 1

    def ended(self, rank: int) -> None:
        self._in_flight[rank] -= 1
        # An idle engine sends no stats: without this its last snapshot would stick.
        # This client is the engines' only frontend, so nothing of ours in flight
        # means nothing to wait for there.
        if self._in_flight[rank] <= 0:
            self._stats[rank] = 0
        else:
            self._stats[rank] = max(0, self._stats[rank] - 1)

    def update_stats(self, rank: int, waiting: int, running: int) -> None:
        # Stats of a rank with nothing of ours in flight describe requests this client
        # already gave up (aborted ones the engine is dropping): count it as idle.
        if self._in_flight.get(rank, 0) > 0:
            self._stats[rank] = waiting + running

    def add(self, rank: int) -> None:
        """Add (or re-admit) a rank."""
        if rank not in self._in_flight:
            self._ranks.append(rank)
            self._ranks.sort()
            self._in_flight[rank] = 0
            self._stats[rank] = 0
        self._live.add(rank)

    def remove(self, rank: int) -> None:
        """Stop routing new requests to ``rank``."""
        self._live.discard(rank)


@dataclass(frozen=True, slots=True)
class StartWave:
    """Send START_DP_WAVE ``(wave, exclude)`` to each rank of ``ranks``."""

    wave: int
    exclude: int | None
    ranks: tuple[int, ...]


class WaveTracker:
    """The coordinator's wave role, kept by the client (MoE DP without a coordinator).

    ``current_wave`` is the wave the engines run or will run next; ``running`` is
    whether the client believes they run. Race (docs/protocol.md §7.4): a request sent
    while the client believed wave ``w`` running (so no START_DP_WAVE went out) may
    reach its engine after every rank agreed that ``w`` is over; that engine would then
    step alone. So when ``wave_complete(w)`` arrives, requests were sent during ``w``
    and some are still in flight, a new wave is started on every rank at once (a
    spurious wave is harmless: it ends after one idle check). Requests sent while the
    engines were believed idle came with their own START_DP_WAVE and never restart a
    wave, so engines that end waves on their own cannot make the client loop.
    """

    def __init__(self, ranks: Iterable[int]) -> None:
        self._ranks: list[int] = sorted(set(ranks))
        self.current_wave = 0
        self.running = False
        self.waves_started = 0
        self._sent_while_running = 0

    def set_ranks(self, ranks: Iterable[int]) -> None:
        self._ranks = sorted(set(ranks))

    def on_add(self, target: int) -> StartWave | None:
        """A request is about to go to ``target``: wake the other ranks if idle."""
        if self.running:
            self._sent_while_running += 1
            return None
        self._sent_while_running = 0
        self.running = True
        self.waves_started += 1
        others = tuple(r for r in self._ranks if r != target)
        return StartWave(self.current_wave, target, others) if others else None

    def on_wave_complete(self, wave: int, *, requests_in_flight: bool) -> StartWave | None:
        """An engine reported ``wave_complete = wave``."""
        if wave < self.current_wave:
            return None  # another rank already reported it (every rank does, §7.5)
        self.current_wave = wave + 1
        self.running = False
        late, self._sent_while_running = self._sent_while_running, 0
        if not (late and requests_in_flight):
            return None
        self.running = True
        self.waves_started += 1
        return StartWave(self.current_wave, None, tuple(self._ranks))

    def on_start_wave(self, wave: int, sender: int) -> StartWave | None:
        """An engine reported ``start_wave = wave`` (it went from idle to running)."""
        if wave > self.current_wave or (wave == self.current_wave and not self.running):
            self.current_wave = wave
            self.running = True
            self.waves_started += 1
            self._sent_while_running = 0
            others = tuple(r for r in self._ranks if r != sender)
            return StartWave(wave, sender, others) if others else None
        return None
