"""The sans-I/O data-parallel decisions: engine choice and the client's wave role."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_vllm.protocol.routing import LoadBalancer, StartWave, WaveTracker


def test_least_loaded_with_lowest_rank_on_ties() -> None:
    lb = LoadBalancer([2, 0, 1])
    assert lb.live_ranks == [0, 1, 2]
    picks = []
    for _ in range(6):
        rank = lb.choose()
        lb.started(rank)
        picks.append(rank)
    assert picks == [0, 1, 2, 0, 1, 2]
    lb.ended(1)
    assert lb.choose() == 1


def test_scheduler_stats_raise_the_load_until_requests_end() -> None:
    lb = LoadBalancer([0, 1])
    lb.started(0)
    lb.started(1)
    lb.update_stats(0, waiting=5, running=3)  # busier than our own count says
    assert lb.load(0) == 8
    assert [lb.choose() for _ in range(2)] == [1, 1]
    lb.ended(0)  # nothing of ours left there: its stale snapshot is dropped
    assert lb.load(0) == 0
    assert lb.choose() == 0
    lb.update_stats(0, waiting=0, running=1)  # late stats of an aborted request
    assert lb.load(0) == 0


def test_pinned_removed_and_empty() -> None:
    lb = LoadBalancer([0, 1])
    assert lb.choose(1) == 1
    with pytest.raises(ValueError, match="no engine with rank 3"):
        lb.choose(3)
    lb.remove(1)
    with pytest.raises(ValueError, match="no longer serves"):
        lb.choose(1)
    assert lb.choose() == 0
    lb.remove(0)
    with pytest.raises(LookupError):
        lb.choose()
    lb.add(4)
    assert lb.choose() == 4


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=200))
def test_spread_stays_within_one_for_equal_engines(ops: list[tuple[bool, int]]) -> None:
    lb = LoadBalancer(range(4))
    live: list[int] = []
    for start, which in ops:
        if start or not live:
            rank = lb.choose()
            lb.started(rank)
            live.append(rank)
        else:
            lb.ended(live.pop(which % len(live)))
        loads = [lb.in_flight(r) for r in range(4)]
        # Ends can unbalance; a start always goes to a least loaded rank.
        if start:
            assert lb.in_flight(live[-1]) - 1 == min(loads[r] - (r == live[-1]) for r in range(4))


def test_waves_wake_the_other_ranks_once_per_wave() -> None:
    w = WaveTracker([0, 1, 2])
    assert w.on_add(1) == StartWave(0, 1, (0, 2))
    assert w.on_add(2) is None  # already running
    # Every rank reports the end (no coordinator); only the first counts. A request
    # was sent during the wave and is still in flight: the race -> new wave at once.
    assert w.on_wave_complete(0, requests_in_flight=True) == StartWave(1, None, (0, 1, 2))
    assert w.on_wave_complete(0, requests_in_flight=True) is None
    assert w.current_wave == 1
    assert w.on_wave_complete(1, requests_in_flight=False) is None
    assert (w.current_wave, w.running) == (2, False)
    assert w.on_add(0) == StartWave(2, 0, (1, 2))
    assert w.waves_started == 3


def test_wave_end_without_late_requests_does_not_restart() -> None:
    w = WaveTracker([0, 1])
    assert w.on_add(0) == StartWave(0, 0, (1,))
    # Rank 1 (woken, idle) ends the wave while rank 0 still works: the request came
    # with its own START_DP_WAVE, so no restart (no ping-pong with lone-ending ranks).
    assert w.on_wave_complete(0, requests_in_flight=True) is None
    assert not w.running


def test_engine_started_wave_is_broadcast_to_the_others() -> None:
    w = WaveTracker([0, 1, 2])
    assert w.on_start_wave(0, sender=2) == StartWave(0, 2, (0, 1))
    assert w.on_start_wave(0, sender=1) is None  # already running
    assert w.on_wave_complete(0, requests_in_flight=False) is None
    assert w.on_start_wave(0, sender=1) is None  # stale
    assert w.on_start_wave(3, sender=1) == StartWave(3, 1, (0, 2))
    w.set_ranks([1])
    assert w.on_wave_complete(3, requests_in_flight=False) is None
    assert w.on_add(1) is None  # nobody else to wake
