"""The client session, driven message by message: no sockets, no processes, no loop.

Each test plays the engines' side by hand (decoded EngineCoreOutputs in, actions out),
the way h11's tests drive two connections against each other.
"""

from __future__ import annotations

from typing import Any

import pytest

from trio_vllm import EngineDeadError, ProtocolError
from trio_vllm.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    SchedulerStats,
    UtilityOutput,
    UtilityResult,
)
from trio_vllm.protocol import session as s
from trio_vllm.protocol.session import ClientSession, RankState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def out(rid: str, *tokens: int, final: bool = False) -> EngineCoreOutput:
    return EngineCoreOutput(rid, list(tokens), finish_reason=FinishReason.LENGTH if final else None)


def batch(rank: int, *outputs: EngineCoreOutput, **fields: Any) -> EngineCoreOutputs:
    return EngineCoreOutputs(engine_index=rank, outputs=list(outputs), **fields)


def reply(rank: int, call_id: int, result: Any = None, failure: str | None = None) -> Any:
    return batch(rank, utility_output=UtilityOutput(call_id, failure, UtilityResult(None, result)))


def kinds(actions: list[s.Action]) -> list[str]:
    return ["Deliver" if type(a) is tuple else type(a).__name__ for a in actions]


def delivered(actions: list[s.Action]) -> list[tuple[object, list[int]]]:
    return [(a[0], a[1].new_token_ids) for a in actions if type(a) is tuple]


def died(actions: list[s.Action]) -> s.DeathRecord:
    deaths = [a.record for a in actions if isinstance(a, s.Died)]
    assert len(deaths) == 1, kinds(actions)
    return deaths[0]


def started(
    session: ClientSession, rid: str, handle: object | None = None, rank: int | None = None
) -> int:
    target = session.choose_rank(rank)
    session.start_request(rid, target, handle)
    session.request_sent(target)
    return target


# ---------------------------------------------------------------------- routing


def test_stream_outputs_are_delivered_and_counted_out_once() -> None:
    session = ClientSession([0])
    stream = object()
    started(session, "a", stream)
    assert session.in_flight(0) == 1
    assert delivered(session.receive(batch(0, out("a", 1)))) == [(stream, [1])]
    assert delivered(session.receive(batch(0, out("a", 2, final=True)))) == [(stream, [2])]
    assert session.in_flight(0) == 0
    # Still registered until the generate block is left, but gets nothing more.
    assert session.live_requests == ["a"]
    assert session.receive(batch(0, out("a", 3))) == []
    session.end_request("a")
    session.end_request("a")  # idempotent
    assert session.in_flight(0) == 0
    assert session.live_requests == []


def test_raw_outputs_are_queued_without_the_streams_outputs() -> None:
    session = ClientSession([0])
    started(session, "stream", object())
    started(session, "raw")
    actions = session.receive(batch(0, out("stream", 1), out("raw", 2), out("gone", 3)))
    assert kinds(actions) == ["Deliver", "QueueRaw"]
    queued = actions[1]
    assert isinstance(queued, s.QueueRaw)
    assert [o.request_id for o in queued.outputs.outputs] == ["raw"]
    session.receive(batch(0, out("raw", 4, final=True)))
    assert session.live_requests == ["stream"]
    assert session.in_flight(0) == 1


def test_receive_whole_takes_exactly_the_plain_raw_messages() -> None:
    """The raw fast path says yes only where receive would return one QueueRaw of the
    whole message, does the same bookkeeping, and changes nothing when it says no."""
    session = ClientSession([0, 1], waves=True)
    started(session, "r1", rank=0)
    started(session, "r2", rank=0)
    stats = SchedulerStats(num_running_reqs=2, num_waiting_reqs=5)
    plain = batch(0, out("r1", 1), out("r2", 2), scheduler_stats=stats)
    assert session.receive_whole(plain)
    assert session.heard(0) == 1  # counted as receive counts it
    refused = [
        batch(0, out("r1", 1, final=True)),  # a finish: the request leaves the registry
        batch(0, out("r1", 1), out("gone", 2)),  # a late output of another request
        batch(0),  # nothing for get_output (stats-only batches depend on raw interest)
        reply(0, 7),  # a utility reply
        batch(0, out("r1", 1), wave_complete=3),  # wave fields
        batch(5, out("r1", 1)),  # an engine this client never knew: receive raises
    ]
    for outputs in refused:
        assert not session.receive_whole(outputs)
    assert session.heard(0) == 1  # the refusals changed nothing
    assert session.live_requests == ["r1", "r2"]
    # With a stream registered, the raw fast path is off; receive routes as before.
    started(session, "s", object(), rank=0)
    assert not session.receive_whole(batch(0, out("r1", 1)))
    assert kinds(session.receive(batch(0, out("r1", 1)))) == ["QueueRaw"]
    # receive's answer for a plain message is the fast path's, as one action.
    session.end_request("s")
    actions = session.receive(plain)
    assert kinds(actions) == ["QueueRaw"]
    queued = actions[0]
    assert isinstance(queued, s.QueueRaw)
    assert queued.outputs is plain
    assert session.heard(0) == 3


def test_receive_whole_refuses_after_death_and_for_a_lost_rank() -> None:
    session = ClientSession([0, 1], on_engine_death="continue")
    started(session, "r", rank=1)
    session.rank_died(1, "gone", None)
    assert not session.receive_whole(batch(1, out("r", 1)))
    assert session.receive(batch(1, out("r", 1))) == []  # a lost rank's late words
    session.close()
    assert not session.receive_whole(batch(0, out("r", 1)))


def test_receive_wholes_takes_the_leading_run_and_stops_where_receive_must_route() -> None:
    """The run form of receive_whole: how many messages from ``start`` it takes (the
    bookkeeping of each done, ranks checked per rank), stopping at the first one
    receive must see (ENGINE_CORE_DEAD, a finish, a lost rank), which stays untouched."""
    from trio_vllm.protocol.structs import EngineCoreDead

    session = ClientSession([0, 1], on_engine_death="continue")
    started(session, "r0", rank=0)
    started(session, "r1", rank=1)
    stats = SchedulerStats(num_running_reqs=1, num_waiting_reqs=3)
    messages: list[Any] = [
        batch(0, out("r0", 1)),
        batch(1, out("r1", 2), scheduler_stats=stats),
        batch(0, out("r0", 3)),
        batch(0, out("r0", 4, final=True)),  # a finish: receive's
        batch(1, out("r1", 5)),
        EngineCoreDead(),
        batch(1, out("r1", 6)),
    ]
    assert session.receive_wholes(messages) == 3
    assert (session.heard(0), session.heard(1)) == (2, 1)
    assert session.receive_wholes(messages, 3) == 0  # nothing counted for the finish
    assert session.heard(0) == 2
    assert kinds(session.receive(messages[3])) == ["QueueRaw"]
    assert session.receive_wholes(messages, 4) == 1  # up to ENGINE_CORE_DEAD
    assert session.receive_wholes(messages, 5) == 0
    assert session.receive_wholes(messages, 6) == 1
    assert session.receive_wholes(messages, 7) == 0  # past the end
    session.rank_died(1, "gone", None)
    assert session.receive_wholes([batch(1, out("r1", 7))]) == 0  # a lost rank
    assert session.heard(1) == 3


def test_late_outputs_after_an_abort_are_dropped() -> None:
    session = ClientSession([0, 1])
    stream = object()
    started(session, "s", stream, rank=1)
    started(session, "r", rank=1)
    aborted = session.abort(["s", "r", "unknown"])
    by_rank, handles = aborted.by_rank, aborted.streams
    assert by_rank == {1: ["s", "r", "unknown"], 0: ["unknown"]}
    assert handles == [stream]
    assert session.in_flight(1) == 0
    assert session.receive(batch(1, out("s", 1), out("r", 2, final=True))) == []
    assert session.live_requests == ["s"]  # the stream until its block is left
    # A second abort of the now-finished ids goes to every live rank (idempotent).
    assert session.abort(["r"]).by_rank == {0: ["r"], 1: ["r"]}


def test_abort_refuses_a_bad_rank_before_forgetting_anything() -> None:
    session = ClientSession([0])
    started(session, "live", object())
    with pytest.raises(ValueError, match="rank 7"):
        session.abort(["live", "x"], rank=7)
    assert session.is_counted("live")
    assert session.in_flight(0) == 1


def test_duplicate_live_id_is_refused() -> None:
    session = ClientSession([0])
    started(session, "a")
    with pytest.raises(ValueError, match="already live"):
        session.check_new("a")
    with pytest.raises(ValueError, match="already live"):
        session.start_request("a", 0)
    assert session.in_flight(0) == 1


def test_unknown_engine_index_is_a_protocol_error() -> None:
    session = ClientSession([0, 1])
    with pytest.raises(ProtocolError, match="unexpected engine_index 5"):
        session.receive(batch(5))
    assert not session.dead  # the shell decides: it makes this the client's death


def test_least_loaded_rank_and_stats() -> None:
    session = ClientSession([0, 1])
    assert started(session, "a") == 0
    assert started(session, "b") == 1
    assert started(session, "c") == 0
    # Rank 1 reports a long queue of ours: the next goes to rank 0.
    session.receive(batch(1, scheduler_stats=SchedulerStats(num_waiting_reqs=9)))
    assert session.choose_rank() == 0
    with pytest.raises(ValueError, match="no engine with rank 4"):
        session.choose_rank(4)


# ---------------------------------------------------------------------- raw interest


def test_stats_batches_are_queued_only_while_the_raw_api_is_in_use() -> None:
    clock = Clock()
    session = ClientSession([0], clock=clock)
    stats = SchedulerStats(num_running_reqs=1)
    # Nobody used the raw API: stats-only batches are not queued.
    assert session.receive(batch(0, scheduler_stats=stats)) == []
    session.raw_api_used()  # a get_output call
    assert kinds(session.receive(batch(0, scheduler_stats=stats))) == ["QueueRaw"]
    clock.now += s.RAW_INTEREST_S + 1
    assert session.receive(batch(0, scheduler_stats=stats)) == []  # interest lapsed
    session.raw_waiters += 1  # a get_output waiting now
    assert kinds(session.receive(batch(0, scheduler_stats=stats))) == ["QueueRaw"]
    session.raw_waiters -= 1
    started(session, "r")  # a live raw request holds the interest however long
    clock.now += 10 * s.RAW_INTEREST_S
    assert kinds(session.receive(batch(0, scheduler_stats=stats))) == ["QueueRaw"]
    session.receive(batch(0, out("r", 1, final=True)))
    # The window after the last call is timed from the next stats-only batch.
    assert kinds(session.receive(batch(0, scheduler_stats=stats))) == ["QueueRaw"]
    clock.now += s.RAW_INTEREST_S + 1
    # Streams only from now on: their batches carry stats, and none is queued.
    started(session, "s", object())
    actions = session.receive(batch(0, out("s", 2), scheduler_stats=stats))
    assert kinds(actions) == ["Deliver"]


# ---------------------------------------------------------------------- utility calls


def test_utility_replies_resolve_their_call_and_reserved_ids_are_events() -> None:
    session = ClientSession([0, 1])
    handle = object()
    call_id = session.start_call("get_weight_version", 1, handle)
    assert call_id not in s.RESERVED_CALL_IDS
    # An engine-initiated notice with a reserved id is never matched to a call.
    for reserved, kind in ((-1, "elastic_ep"), (-2, "fault_tolerance")):
        (event,) = session.receive(reply(1, reserved, ["RECONFIGURE_FINISHED", 1]))
        assert isinstance(event, s.EmitEvent)
        assert (event.event.kind, event.event.rank) == (kind, 1)
    assert session.pending_calls == 1
    (resolved,) = session.receive(reply(1, call_id, "v7"))
    assert isinstance(resolved, s.ResolveCall)
    assert (resolved.handle, resolved.result, resolved.failure) == (handle, "v7", None)
    assert session.pending_calls == 0
    assert session.receive(reply(1, call_id, "again")) == []  # late duplicate: dropped


def test_cancelled_call_reply_is_dropped() -> None:
    session = ClientSession([0])
    call_id = session.start_call("sleep", 0, object())
    session.end_call(call_id)
    assert session.receive(reply(0, call_id, None, failure="late")) == []
    with pytest.raises(ValueError, match="method"):
        session.start_call("", 0, object())


# ---------------------------------------------------------------------- death


@pytest.mark.parametrize("ranks", [[0], [0, 1, 2, 3]])
@pytest.mark.parametrize("first_request", [False, True])
def test_engine_core_dead_fails_everything_once(ranks: list[int], first_request: bool) -> None:
    session = ClientSession(ranks)
    stream, call = object(), object()
    if first_request:
        started(session, "a", stream)
        session.start_call("is_sleeping", ranks[-1], call)
    actions = session.receive(None)
    record = died(actions)
    assert "ENGINE_CORE_DEAD" in record.message
    assert record.rank == (0 if len(ranks) == 1 else None)
    if first_request:
        assert kinds(actions) == ["FailCall", "FailRequest", "Died"]
    assert session.dead
    assert session.receive(None) == []  # the first death wins
    assert session.rank_died(0, "again") == []
    with pytest.raises(EngineDeadError, match="ENGINE_CORE_DEAD"):
        session.choose_rank()
    with pytest.raises(EngineDeadError):
        session.start_call("x", 0, object())
    error = session.dead_error()
    assert error is not session.dead_error()  # fresh instances


@pytest.mark.parametrize("ranks", [[0], [0, 1, 2, 3]])
def test_send_failure_is_declared_only_after_the_drain(ranks: list[int]) -> None:
    """16.2: a send that finds no peer only notices the death; the outputs the engine
    sent before dying (read by the shell's drain) are still routed, then it is declared."""
    session = ClientSession(ranks)
    stream = object()
    started(session, "a", stream, rank=0)
    record = session.notice_rank(0, "engine 0 is no longer connected")
    assert record.rank == 0
    assert session.noticed
    assert not session.dead
    drained = session.receive(batch(0, *(out("a", i) for i in range(49))))
    assert len(delivered(drained)) == 49
    actions = session.declare_noticed()
    assert died(actions).message == "engine 0 is no longer connected"
    assert kinds(actions) == ["FailRequest", "Died"]
    assert not session.noticed


@pytest.mark.parametrize("ranks", [(0,), (0, 1, 2, 3)])
def test_process_exit_of_every_mode(ranks: tuple[int, ...]) -> None:
    session = ClientSession(ranks)
    assert session.notice_exit(ranks, "exit code 1")
    actions = session.declare_noticed()
    record = died(actions)
    assert record.message == "engine process died: exit code 1"
    assert record.rank == (0 if len(ranks) == 1 else None)
    assert not session.notice_exit(ranks, "again")  # dead: nothing to declare


def test_continue_mode_loses_one_rank_of_four() -> None:
    session = ClientSession([0, 1, 2, 3], on_engine_death="continue")
    on_two, elsewhere, call = object(), object(), object()
    started(session, "two", on_two, rank=2)
    started(session, "raw2", rank=2)
    started(session, "zero", elsewhere, rank=0)
    session.start_call("sleep", 2, call)
    # ENGINE_CORE_DEAD names no rank with several live: the exit that follows does.
    assert session.receive(None) == []
    assert session.unattributed_deaths == 1
    assert session.notice_exit((2,), "exit code 1")
    actions = session.declare_noticed()
    assert kinds(actions) == ["FailCall", "FailRequest", "EmitEvent"]
    fail = actions[1]
    assert isinstance(fail, s.FailRequest)
    assert fail.handle is on_two
    assert fail.record.rank == 2
    assert "engine rank 2 died" in fail.record.message
    event = actions[2]
    assert isinstance(event, s.EmitEvent)
    assert event.event.kind == "rank_lost"
    assert event.event.payload == {
        "message": "engine process died: exit code 1",
        "requests": ["two", "raw2"],
    }
    assert session.live_ranks == [0, 1, 3]
    assert session.lost_ranks == {2: "engine process died: exit code 1"}
    assert session.in_flight(2) == 0
    assert session.live_requests == ["two", "zero"]
    # The lost rank's late words are dropped; others keep going.
    assert session.receive(batch(2, out("two", 1))) == []
    assert delivered(session.receive(batch(0, out("zero", 5)))) == [(elsewhere, [5])]
    with pytest.raises(ValueError, match="no longer serves"):
        session.choose_rank(2)
    # The last ranks going makes the client dead.
    for rank in (0, 1):
        session.rank_died(rank, "gone")
    record = died(session.rank_died(3, "gone"))
    assert record.message == "every engine is gone; the last: gone"


def test_continue_mode_with_one_rank_dies() -> None:
    session = ClientSession([0], on_engine_death="continue")
    assert "ENGINE_CORE_DEAD" in died(session.receive(None)).message


def test_fail_mode_death_names_the_rank() -> None:
    session = ClientSession([0, 1, 2, 3])
    started(session, "a", object(), rank=3)
    record = died(session.rank_died(3, "lost the connection"))
    assert (record.rank, record.message) == (3, "lost the connection")


# ---------------------------------------------------------------------- ranks


def test_retire_while_draining() -> None:
    session = ClientSession([0, 1])
    stream, call = object(), object()
    started(session, "a", stream, rank=1)
    session.start_call("collective_rpc", 1, call)  # a stalled rank's call
    assert session.begin_retire(1) == ["a"]
    assert session.state(1) is RankState.RETIRING
    assert session.live_ranks == [0]
    assert started(session, "b") == 0  # new requests go elsewhere
    with pytest.raises(ValueError, match="not a live engine"):
        session.begin_retire(1)
    with pytest.raises(ValueError, match="last live engine"):
        session.begin_retire(0)
    # The retiring rank's request finishes: drained.
    actions = session.receive(batch(1, out("a", 1, final=True)))
    assert kinds(actions) == ["Deliver", "RankDrained"]
    # 16.4: the call still pending there fails when the retirement completes.
    actions = session.finish_retire(1)
    assert kinds(actions) == ["FailCall", "EmitEvent"]
    failed = actions[0]
    assert isinstance(failed, s.FailCall)
    assert failed.handle is call
    assert failed.record.rank == 1
    assert "retired" in failed.record.message
    assert session.pending_calls == 0
    assert session.exit_expected((1,))
    assert session.ranks == [0, 1]
    # A retired rank's late words (output or input socket) are dropped quietly.
    assert session.input_message(1) == "drop"
    assert session.notice_exit((1,), "exit code 0") is False


def test_retiring_rank_that_dies_wakes_retire() -> None:
    session = ClientSession([0, 1], on_engine_death="continue")
    started(session, "a", object(), rank=1)
    session.begin_retire(1)
    actions = session.rank_died(1, "exit")
    assert "RankDrained" in kinds(actions)
    assert session.state(1) is RankState.LOST


def test_late_answer_of_a_failed_join_is_dropped() -> None:
    """16.1: a ready response that arrives after the join gave up is not a protocol error."""
    session = ClientSession([0])
    session.begin_join([1])
    assert session.input_message(1) == "join"
    session.join_failed([1], "timed out")
    assert session.input_message(1) == "drop"
    assert session.receive(batch(1, out("x", 1))) == []
    assert session.exit_expected((1,))
    assert session.ranks == [0]
    with pytest.raises(ValueError, match="already known"):
        session.begin_join([1])
    assert session.input_message(0) == "error"  # a live engine must not talk there
    assert session.input_message(None) == "error"
    assert session.input_message(9) == "error"


def test_join_complete_adds_live_ranks() -> None:
    session = ClientSession([0], waves=True)
    session.begin_join([1, 2])
    session.join_complete([1, 2])
    assert session.live_ranks == [0, 1, 2]
    actions = [a for a in session.request_sent(0) if isinstance(a, s.SendWave)]
    assert [a.start.ranks for a in actions] == [(1, 2)]


# ---------------------------------------------------------------------- waves (§7.4)


def wave_sends(actions: list[s.Action]) -> list[tuple[int, int | None, tuple[int, ...]]]:
    return [
        (a.start.wave, a.start.exclude, a.start.ranks) for a in actions if isinstance(a, s.SendWave)
    ]


def test_request_to_idle_engines_wakes_the_others() -> None:
    session = ClientSession([0, 1, 2], waves=True)
    session.start_request("a", 1)
    assert wave_sends(session.request_sent(1)) == [(0, 1, (0, 2))]
    session.start_request("b", 0)
    assert wave_sends(session.request_sent(0)) == []  # running: no new wave
    assert session.waves_started == 1


def test_wave_race_restarts_a_wave_for_a_request_sent_late() -> None:
    """§7.4: a request sent while the client believed wave 0 running may reach its
    engine after every rank agreed that wave 0 is over: start wave 1 on every rank."""
    session = ClientSession([0, 1], waves=True)
    session.start_request("a", 0)
    session.request_sent(0)
    session.start_request("b", 1)
    session.request_sent(1)  # sent while running
    actions = session.receive(batch(0, wave_complete=0))
    assert wave_sends(actions) == [(1, None, (0, 1))]
    assert session.current_wave == 1
    assert wave_sends(session.receive(batch(1, wave_complete=0))) == []  # the other report


def test_wave_complete_without_late_requests_starts_nothing() -> None:
    session = ClientSession([0, 1], waves=True)
    session.start_request("a", 0)
    session.request_sent(0)
    assert wave_sends(session.receive(batch(0, wave_complete=0))) == []
    # An engine that starts a wave on its own: the client wakes the others.
    assert wave_sends(session.receive(batch(1, start_wave=1))) == [(1, 1, (0,))]


def test_wave_frames_skip_lost_ranks() -> None:
    session = ClientSession([0, 1, 2], on_engine_death="continue", waves=True)
    session.rank_died(2, "gone")
    session.start_request("a", 0)
    assert wave_sends(session.request_sent(0)) == [(0, 0, (1,))]


def test_on_engine_death_is_checked() -> None:
    with pytest.raises(ValueError, match="on_engine_death"):
        ClientSession([0], on_engine_death="later")  # type: ignore[arg-type]


def test_abort_of_a_retiring_ranks_last_request_drains_it() -> None:
    session = ClientSession([0, 1])
    stream = object()
    started(session, "a", stream, rank=1)
    assert session.begin_retire(1) == ["a"]
    aborted = session.abort(["a"])
    by_rank, handles, actions = aborted.by_rank, aborted.streams, aborted.actions
    assert by_rank == {1: ["a"]}
    assert handles == [stream]
    assert kinds(actions) == ["RankDrained"]
    assert session.in_flight(1) == 0


def test_close_fails_pending_work_and_later_calls() -> None:
    session = ClientSession([0])
    stream, call = object(), object()
    started(session, "a", stream)
    session.start_call("sleep", 0, call)
    actions = session.close()
    assert kinds(actions) == ["FailCall", "FailRequest", "Died"]
    assert died(actions).message == "the client is closed (open_client exited)"
    assert session.close() == []
    assert session.pending_calls == 0
    with pytest.raises(EngineDeadError, match="closed"):
        session.begin_join([1])


def test_noticed_ranks_name_whose_backlog_the_shell_drains() -> None:
    """Until declared, the noticed deaths say whose outputs the drain waits for: the
    ranks named (a send failure, a process exit), or None when a notice named none."""
    session = ClientSession([0, 1, 2, 3], on_engine_death="continue")
    assert session.noticed_ranks == frozenset()
    session.notice_rank(1, "no connected peer")
    assert session.notice_exit((2, 3), "exit code 1")
    assert session.noticed_ranks == {1, 2, 3}
    session.declare_noticed()
    assert session.noticed_ranks == frozenset()
    session = ClientSession([0, 1])
    session.notice_rank(None, "a connection behind several ranks dropped")
    assert session.noticed_ranks is None
    session.declare_noticed()
    assert session.noticed_ranks == frozenset()


# ---------------------------------------------------------------------- issue 23.4


def _lost_requests(actions: list[s.Action]) -> list[str]:
    (event,) = [a for a in actions if isinstance(a, s.EmitEvent)]
    assert event.event.kind == "rank_lost"
    payload = event.event.payload
    assert isinstance(payload, dict)
    return list(payload["requests"])


def test_rank_lost_lists_requests_whose_send_failed_before_the_verdict() -> None:
    """Issue 23.4, message by message: rank 2 dies; its death is noticed by one send
    and declared only after the drain. Requests routed to rank 2 in between (the
    balancer still had it) whose ADD found no peer fail with rank 2's death, so the
    rank_lost event lists them with the ones rank 2 had."""
    session = ClientSession([0, 1, 2, 3], on_engine_death="continue")
    old_stream = object()
    started(session, "old", old_stream, rank=2)
    started(session, "old-raw", rank=2)
    started(session, "zero", object(), rank=0)
    # A new stream routed to 2: its ADD finds no peer (the first notice).
    started(session, "new", object(), rank=2)
    record = session.notice_rank(2, "engine 2 is no longer connected", request_id="new")
    assert (record.rank, "engine rank 2 died" in record.message) == (2, True)
    assert session.end_request("new") == []  # the shell's cleanup: already out
    assert "new" not in session.live_requests  # the id is free again
    # Not declared yet: another one is routed there, and a raw one; both sends fail.
    assert session.choose_rank(2) == 2
    started(session, "new2", object(), rank=2)
    session.notice_rank(2, "engine 2 is no longer connected", request_id="new2")
    session.end_request("new2")
    started(session, "new-raw", rank=2)
    session.notice_rank(2, "engine 2 is no longer connected", request_id="new-raw")
    session.end_request("new-raw")
    assert not session.dead
    actions = session.declare_noticed()
    assert sorted(_lost_requests(actions)) == ["new", "new-raw", "new2", "old", "old-raw"]
    # The ones still registered fail now; the send-failed ones failed at their send.
    failed = [a.handle for a in actions if isinstance(a, s.FailRequest)]
    assert failed == [old_stream]
    assert session.in_flight(2) == 0
    assert session.live_requests == ["old", "zero"]  # the stream until its block is left
    assert [session.in_flight(r) for r in (0, 1, 3)] == [1, 0, 0]


def test_a_send_failure_after_the_verdict_is_listed_once() -> None:
    """A request started before the verdict whose send fails after it: the verdict
    already failed and listed it; its late send failure adds nothing."""
    session = ClientSession([0, 1], on_engine_death="continue")
    stream = object()
    started(session, "a", stream, rank=1)
    session.notice_exit((1,), "exit code -9")
    assert _lost_requests(session.declare_noticed()) == ["a"]
    session.notice_rank(1, "engine 1 is no longer connected", request_id="a")
    session.end_request("a")
    assert session.declare_noticed() == []  # rank 1 is lost already: no second event
    assert session.in_flight(1) == 0
    assert session.live_requests == []


def test_send_failures_in_fail_mode_kill_the_client() -> None:
    session = ClientSession([0, 1])
    stream = object()
    started(session, "a", stream, rank=0)
    started(session, "b", object(), rank=1)
    record = session.notice_rank(1, "engine 1 is no longer connected", request_id="b")
    assert record.rank == 1
    session.end_request("b")
    actions = session.declare_noticed()
    assert died(actions).rank == 1
    assert [a.handle for a in actions if isinstance(a, s.FailRequest)] == [stream]
