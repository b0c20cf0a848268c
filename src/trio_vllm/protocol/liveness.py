"""Hung-engine detection, sans-I/O: the heartbeat timing and the stall watch.

Two kinds of hang, two detectors (docs/reliability.md, "A hung engine"):

* an engine that answers nothing at all (process stopped or frozen, host gone, network
  cut, half-open TCP): ZMTP heartbeats on the client's input socket, answered by the
  engine's libzmq I/O thread whatever its Python loop does. `heartbeat_timing` turns
  ``hang_timeout`` into the two socket options; the transport does the rest and the
  client hears of it as a dropped connection.
* an engine whose sockets answer but whose loop makes no progress with work in flight
  (a deadlock): `StallWatch` decides, from what the client heard of each rank, when
  to send a probe utility call (one every engine answers between steps) and when a
  probe left unanswered is the rank's death.

Nothing here awaits, reads a clock or a socket: the shell passes ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = [
    "DEFAULT_HANG_TIMEOUT",
    "STALL_PROBE",
    "HeartbeatTiming",
    "StallVerdicts",
    "StallWatch",
    "hang_message",
    "heartbeat_timing",
    "stall_message",
]

DEFAULT_HANG_TIMEOUT: Final = 30.0
"""``hang_timeout``'s default, in seconds: long against a loaded host's scheduling
delays (libzmq's I/O thread, not the engine's step, answers), short against a user
waiting on a stream."""

STALL_PROBE: Final = "is_sleeping"
"""The probe: a utility every vLLM release and the reference engine answer between
steps, cheap, with no effect on the engine."""

# A heartbeat goes out every ivl; the peer has timeout to send anything back. A peer
# that stops just after answering is caught at the next ping plus timeout: at most ivl
# + timeout = hang_timeout after its last word.
_IVL_SHARE: Final = 0.25


@dataclass(frozen=True, slots=True)
class HeartbeatTiming:
    """ZMTP heartbeat options for ``hang_timeout`` (milliseconds, as libzmq takes them)."""

    interval_ms: int  # ZMQ_HEARTBEAT_IVL: send a PING this often
    timeout_ms: int  # ZMQ_HEARTBEAT_TIMEOUT: no traffic this long after a PING: drop


def heartbeat_timing(hang_timeout: float) -> HeartbeatTiming:
    """The heartbeat options that drop a silent peer's connection at most
    ``hang_timeout`` seconds after its last traffic (`ValueError` for <= 0)."""
    if not hang_timeout > 0:
        raise ValueError(f"hang_timeout must be > 0, got {hang_timeout!r}")
    total = max(4, round(hang_timeout * 1000))
    interval = max(1, round(total * _IVL_SHARE))
    return HeartbeatTiming(interval, total - interval)


def _ranks_text(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"engine rank {ranks[0]}"
    return f"engine ranks {ranks} (one process or host behind one connection)"


def hang_message(ranks: Iterable[int], hang_timeout: float) -> str:
    """The death's cause for a dropped connection whose engine process is still up."""
    return (
        f"{_ranks_text(ranks)} did not answer heartbeats for {hang_timeout:g} s "
        "(process stopped or frozen, host gone or network cut): declared dead "
        "(hang_timeout)"
    )


def stall_message(rank: int, stall_timeout: float) -> str:
    """The death's cause for a rank whose loop stopped with work in flight."""
    return (
        f"engine rank {rank} made no progress for {stall_timeout:g} s with requests in "
        f"flight and did not answer a {STALL_PROBE!r} probe within {stall_timeout:g} s: "
        "its loop is stuck, declared dead (stall_timeout)"
    )


@dataclass(slots=True)
class _Rank:
    heard: int
    since: float  # last progress (or the moment work started)
    probe_since: float | None = None  # a probe is out since then


@dataclass(frozen=True, slots=True)
class StallVerdicts:
    """What `StallWatch.tick` asks of the shell."""

    probe: list[int] = field(default_factory=list)  # send one probe to each
    dead: list[int] = field(default_factory=list)  # declare each dead (stall_message)


class StallWatch:
    """Per rank: with requests in flight and nothing heard for ``timeout`` seconds, a
    probe; the probe unanswered (nothing at all heard) for ``timeout`` more, a death.

    Progress is anything heard from the rank (outputs, stats, any utility reply,
    the probe's own): the engine sends only from its loop, between steps. A rank with
    nothing in flight is not watched (an idle engine sends nothing). So a loop is
    declared stuck only after ``2 * timeout`` of silence with work in flight, one of
    them with a probe waiting: ``timeout`` must exceed the longest step.
    """

    def __init__(self, timeout: float) -> None:
        if not timeout > 0:
            raise ValueError(f"stall_timeout must be > 0, got {timeout!r}")
        self.timeout = timeout
        self._ranks: dict[int, _Rank] = {}
        self._done: set[int] = set()  # declared dead: never again

    @property
    def period(self) -> float:
        """How often the shell should call `tick` (a quarter of the timeout)."""
        return self.timeout / 4

    def probing(self, rank: int) -> bool:
        """A probe is out to ``rank``."""
        watch = self._ranks.get(rank)
        return watch is not None and watch.probe_since is not None

    def tick(self, now: float, ranks: Iterable[tuple[int, int, int]]) -> StallVerdicts:
        """``ranks``: (rank, requests in flight, messages heard) for every live rank.
        Returns the probes to send and the ranks to declare dead (each once)."""
        verdicts = StallVerdicts()
        seen: set[int] = set()
        for rank, in_flight, heard in ranks:
            seen.add(rank)
            if rank in self._done:
                continue
            watch = self._ranks.get(rank)
            if in_flight <= 0:
                self._ranks.pop(rank, None)  # idle: nothing to make progress on
                continue
            if watch is None or heard != watch.heard:
                self._ranks[rank] = _Rank(heard, now)  # work started, or progress
                continue
            if watch.probe_since is not None:
                if now - watch.probe_since >= self.timeout:
                    self._done.add(rank)
                    del self._ranks[rank]
                    verdicts.dead.append(rank)
            elif now - watch.since >= self.timeout:
                watch.probe_since = now
                verdicts.probe.append(rank)
        for rank in set(self._ranks) - seen:
            del self._ranks[rank]  # gone (lost, retired)
        return verdicts
