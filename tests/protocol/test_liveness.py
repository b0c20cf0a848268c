"""The hung-engine rules, sans-I/O (protocol/liveness.py): heartbeat timing and the
stall watch, driven tick by tick with a made-up clock."""

from __future__ import annotations

import pytest

from trio_vllm.protocol.liveness import (
    StallVerdicts,
    StallWatch,
    hang_message,
    heartbeat_timing,
    stall_message,
)


@pytest.mark.parametrize("seconds", [0.1, 1.0, 2.0, 5.0, 30.0, 86400.0])
def test_a_silent_peer_is_dropped_within_hang_timeout(seconds: float) -> None:
    timing = heartbeat_timing(seconds)
    # A peer silent from just after a PONG: caught at the next PING plus the timeout.
    assert timing.interval_ms + timing.timeout_ms <= round(seconds * 1000)
    assert 0 < timing.interval_ms < timing.timeout_ms


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_heartbeat_timing_refuses_nonsense(bad: float) -> None:
    with pytest.raises(ValueError, match="hang_timeout"):
        heartbeat_timing(bad)


def test_messages_name_the_rank_and_the_timeout() -> None:
    assert hang_message([2], 5.0).startswith("engine rank 2 did not answer heartbeats for 5 s")
    assert "engine ranks [0, 1]" in hang_message([1, 0], 5.0)
    assert stall_message(3, 60.0).startswith("engine rank 3 made no progress for 60 s")


def test_an_idle_rank_is_never_probed() -> None:
    watch = StallWatch(10.0)
    for now in range(0, 1000, 3):
        assert watch.tick(float(now), [(0, 0, 7)]).probe == []


def test_silence_with_work_probes_then_an_unanswered_probe_is_death() -> None:
    watch = StallWatch(10.0)
    assert watch.tick(0.0, [(0, 1, 5)]).probe == []  # work starts: the clock starts
    assert watch.tick(9.9, [(0, 1, 5)]).probe == []
    verdict = watch.tick(10.0, [(0, 1, 5)])
    assert verdict.probe == [0]
    assert verdict.dead == []
    assert watch.probing(0)
    assert watch.tick(15.0, [(0, 1, 5)]).probe == []  # one probe at a time
    assert watch.tick(19.9, [(0, 1, 5)]).dead == []
    assert watch.tick(20.0, [(0, 1, 5)]).dead == [0]
    # Declared once; a rank declared dead is never probed again.
    assert watch.tick(40.0, [(0, 1, 5)]) == StallVerdicts()
    assert watch.tick(80.0, [(0, 1, 5)]) == StallVerdicts()


def test_anything_heard_is_progress_and_restarts_the_clock() -> None:
    watch = StallWatch(10.0)
    watch.tick(0.0, [(0, 1, 5)])
    assert watch.tick(10.0, [(0, 1, 5)]).probe == [0]
    # The probe's answer (or any output) arrives: the rank is alive.
    assert watch.tick(12.0, [(0, 1, 6)]) == StallVerdicts()
    assert not watch.probing(0)
    assert watch.tick(21.9, [(0, 1, 6)]).probe == []
    assert watch.tick(22.0, [(0, 1, 6)]).probe == [0]
    # Steady outputs: never a probe.
    heard = 6
    for now in range(23, 500, 5):
        heard += 1
        verdict = watch.tick(float(now), [(0, 1, heard)])
        assert verdict.probe == []
        assert verdict.dead == []


def test_ranks_are_watched_apart_and_a_rank_gone_is_forgotten() -> None:
    watch = StallWatch(1.0)
    watch.tick(0.0, [(0, 1, 0), (1, 1, 0)])
    verdict = watch.tick(1.0, [(0, 1, 1), (1, 1, 0)])  # rank 0 progressed
    assert verdict.probe == [1]
    assert watch.tick(2.0, [(0, 1, 2), (1, 1, 0)]).dead == [1]
    watch.tick(2.0, [(0, 1, 2)])
    assert watch.tick(3.5, [(0, 1, 2)]).probe == [0]
    watch.tick(3.6, [])  # rank 0 left (lost, retired): forgotten
    assert not watch.probing(0)


def test_work_ending_forgets_a_probe() -> None:
    watch = StallWatch(1.0)
    watch.tick(0.0, [(0, 1, 0)])
    assert watch.tick(1.0, [(0, 1, 0)]).probe == [0]
    watch.tick(1.5, [(0, 0, 0)])  # nothing in flight any more
    assert watch.tick(3.0, [(0, 0, 0)]).dead == []
    assert not watch.probing(0)


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_stall_watch_refuses_nonsense(bad: float) -> None:
    with pytest.raises(ValueError, match="stall_timeout"):
        StallWatch(bad)
