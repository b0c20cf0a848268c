"""RequestStream buffering, coalescing and cancellation; request preparation helpers."""

from __future__ import annotations

import time

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from anyio import wait_all_tasks_blocked

from trio_vllm import EngineDeadError
from trio_vllm.client import make_request, new_request_id, prepare_sampling_params
from trio_vllm.client._mailbox import Mailbox
from trio_vllm.client._streams import ListenBudget, RequestStream, coalesce_outputs
from trio_vllm.protocol.structs import (
    EngineCoreEvent,
    EngineCoreOutput,
    FinishReason,
    LogprobsLists,
    SamplingParams,
)

pytestmark = pytest.mark.anyio


def _out(tokens: list[int], finish: int | None = None, **kw: object) -> EngineCoreOutput:
    return EngineCoreOutput("r", tokens, finish_reason=finish, **kw)  # type: ignore[arg-type]


def _lp(tokens: list[int]) -> LogprobsLists:
    n = len(tokens)
    ids = np.array([[t, 0] for t in tokens], dtype=np.int32)
    return LogprobsLists(ids, np.full((n, 2), -1.0, dtype=np.float32), np.ones(n, dtype=np.int64))


def test_coalesce_merges_deltas() -> None:
    a = _out([1, 2], new_logprobs=_lp([1, 2]), num_nans_in_logits=1,
             events=[EngineCoreEvent(1, 0.5)])  # fmt: skip
    b = _out([3], 1, new_logprobs=_lp([3]), num_nans_in_logits=2, stop_reason=None,
             events=[EngineCoreEvent(2, 0.7)])  # fmt: skip
    merged = coalesce_outputs(a, b)
    assert merged.new_token_ids == [1, 2, 3]
    assert merged.finish_reason == 1
    assert merged.num_nans_in_logits == 3
    assert [e.type for e in merged.events] == [1, 2]
    assert merged.new_logprobs.logprob_token_ids[:, 0].tolist() == [1, 2, 3]
    assert merged.new_logprobs.logprobs.shape == (3, 2)
    assert merged.new_logprobs.sampled_token_ranks.shape == (3,)


def test_coalesce_keeps_newest_ndarray_fields() -> None:
    """Fields holding arrays (routed_experts, pooling_output) are tested for nil by
    identity: an ndarray's ``== None`` is elementwise and has no truth value."""
    experts = np.arange(6, dtype=np.int32).reshape(2, 3)
    merged = coalesce_outputs(_out([1]), _out([2], 1, routed_experts=experts))
    assert merged.routed_experts is experts
    assert merged.new_token_ids == [1, 2]
    stream = RequestStream("r", 0, max_pending=1)
    stream.deliver(_out([1]))
    stream.deliver(_out([2], routed_experts=experts))  # merged in the receive task
    assert stream.coalesced == 1
    assert stream._pending[-1].routed_experts is experts


@pytest.mark.parametrize(
    "field",
    [
        {"routed_experts": np.array([0], dtype=np.int32)},  # == None: array([False])
        {"routed_experts": np.zeros((0,), dtype=np.int32)},  # == None: an empty array
        {"kv_transfer_params": {"k": 1}},
        {"trace_headers": {}},  # falsy, not nil: kept
    ],
)
def test_merge_keeps_every_non_nil_field_whatever_its_equality(field: dict[str, object]) -> None:
    """The all-nil test is one tuple comparison; any value that is not None, whatever
    its ``== None`` says (elementwise, empty, falsy), still reaches the merge."""
    ((name, value),) = field.items()
    merged = coalesce_outputs(_out([1], kv_transfer_params={"old": 0}), _out([2], **field))
    assert getattr(merged, name) is value
    assert merged.new_token_ids == [1, 2]
    plain = coalesce_outputs(_out([1], kv_transfer_params={"old": 0}), _out([2]))
    assert plain.kv_transfer_params == {"old": 0}  # nil fields of the newer keep the older


def test_deliver_merges_plain_and_rich_outputs_alike() -> None:
    """A lagging stream merges an output of token ids and a finish itself and any other
    through _merge_into; either way the newest buffered output ends as coalesce_outputs
    would make it (tokens in order, the newest finish and stop reason, fields kept)."""
    outputs = [
        _out([1]),
        _out([2], kv_transfer_params={"k": 1}),  # not plain: _merge_into
        _out([3]),  # plain, after a rich one
        _out([4], stop_reason="x"),
        _out([5], 1, stop_reason=7),  # the final output, plain
    ]
    expected = outputs[0]
    for output in outputs[1:]:
        expected = coalesce_outputs(expected, output)  # leaves its arguments unchanged
    stream = RequestStream("r", 0, max_pending=1)
    for output in outputs:
        stream.deliver(output)  # merges into outputs[0], in place
    (merged,) = stream._pending
    assert merged == expected
    assert merged.new_token_ids == [1, 2, 3, 4, 5]
    assert (merged.finish_reason, merged.stop_reason) == (1, 7)
    assert merged.kv_transfer_params == {"k": 1}
    assert stream.coalesced == 4
    assert stream.finished


async def test_stream_bounded_and_lossless() -> None:
    stream = RequestStream("r", 0, max_pending=3)
    for i in range(100):
        stream.deliver(_out([i], 1 if i == 99 else None))
    assert len(stream._pending) == 3
    assert stream.coalesced == 97
    assert stream.finished
    assert await stream.collect() == list(range(100))
    assert stream.finish_reason == 1
    stream.deliver(_out([1000]))  # late output after finish: ignored
    with pytest.raises(anyio.EndOfStream):
        await stream.receive()


async def test_cancelled_receive_consumes_nothing() -> None:
    stream = RequestStream("r", 0)
    stream.deliver(_out([7]))
    with anyio.CancelScope() as scope:
        scope.cancel()
        await stream.receive()
    assert scope.cancelled_caught
    assert (await stream.receive()).new_token_ids == [7]


async def test_cancelled_receive_consumes_nothing_between_yields() -> None:
    """Between its scheduler passes (at most one per YIELD_INTERVAL while outputs are
    buffered) a receive still checks for cancellation, and consumes nothing then."""
    stream = RequestStream("r", 0)
    stream.deliver(_out([7]))
    stream.deliver(_out([8]))
    assert (await stream.receive()).new_token_ids == [7]
    stream._yield_due = time.monotonic() + 60  # inside the no-yield window, for sure
    with anyio.CancelScope() as scope:
        scope.cancel()
        await stream.receive()
    assert scope.cancelled_caught
    assert (await stream.receive()).new_token_ids == [8]


async def test_buffered_iteration_ends_at_the_final_output_with_merges_finished() -> None:
    """The buffered fast path of ``__anext__`` (inside the no-yield window) hands out
    the outputs in order, finishes a pending merge on the last one, and stops after the
    final output with ``finish_reason`` set, as the general path does."""
    stream = RequestStream("r", 0, max_pending=2)
    stream.deliver(_out([1]))
    assert (await stream.receive()).new_token_ids == [1]  # binds the check, opens the window
    stream._yield_due = time.monotonic() + 60
    stream.deliver(_out([2], new_logprobs=_lp([2])))
    stream.deliver(_out([3], new_logprobs=_lp([3])))
    stream.deliver(_out([4], new_logprobs=_lp([4])))  # merged into [3]: rows pending
    stream.deliver(_out([5], finish=int(FinishReason.LENGTH)))  # merged too, final
    seen = [(o.new_token_ids, o.new_logprobs) async for o in stream]
    assert [ids for ids, _ in seen] == [[2], [3, 4, 5]]
    merged = seen[1][1]
    assert merged is not None
    assert merged.logprob_token_ids[:, 0].tolist() == [3, 4]
    assert stream.finish_reason == FinishReason.LENGTH
    assert stream.coalesced == 2


async def test_draining_a_backlog_yields_to_other_tasks() -> None:
    """A consumer that always finds outputs buffered still lets other tasks run (at
    least once per YIELD_INTERVAL), and loses nothing."""
    n = 200_000
    stream = RequestStream("r", 0, max_pending=n)
    for i in range(n):
        stream.deliver(_out([i], 1 if i == n - 1 else None))
    ticks = 0
    ticks_during: list[int] = []

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.lowlevel.checkpoint()
        start = ticks
        received = 0
        async for out in stream:
            assert out.new_token_ids == [received]
            received += 1
            if received == n // 2:
                ticks_during.append(ticks - start)
        tg.cancel_scope.cancel()
    assert received == n
    assert ticks_during[0] > 0, "the drain never yielded"


async def test_error_after_buffered_outputs() -> None:
    stream = RequestStream("r", 0)
    stream.deliver(_out([1]))
    stream.fail(lambda: EngineDeadError("gone"))
    assert (await stream.receive()).new_token_ids == [1]
    with pytest.raises(EngineDeadError, match="gone"):
        await stream.receive()


def test_receive_nowait() -> None:
    """Takes what is buffered, in order, with coalesced rows finished; WouldBlock while
    nothing is, EndOfStream after the final output (and after a local abort), and the
    engine's death only behind the outputs that arrived before it."""
    stream = RequestStream("r", 0, max_pending=2)
    with pytest.raises(anyio.WouldBlock):
        stream.receive_nowait()
    for i in range(5):  # 0, 1 buffered; 2-4 merged into 1 with their logprob rows
        stream.deliver(_out([i], new_logprobs=_lp([i])))
    assert stream.receive_nowait().new_token_ids == [0]
    merged = stream.receive_nowait()
    assert merged.new_token_ids == [1, 2, 3, 4]
    assert merged.new_logprobs.logprob_token_ids[:, 0].tolist() == [1, 2, 3, 4]
    with pytest.raises(anyio.WouldBlock):
        stream.receive_nowait()
    stream.deliver(_out([5], 1))
    assert stream.finish_reason is None
    assert stream.receive_nowait().new_token_ids == [5]
    assert stream.finish_reason == 1
    with pytest.raises(anyio.EndOfStream):
        stream.receive_nowait()

    dying = RequestStream("d", 0)
    dying.deliver(_out([1]))
    dying.fail(lambda: EngineDeadError("gone"))
    assert dying.receive_nowait().new_token_ids == [1]
    for _ in range(2):  # raised again on every call
        with pytest.raises(EngineDeadError, match="gone"):
            dying.receive_nowait()

    aborted = RequestStream("a", 0)
    aborted.deliver(_out([1]))
    aborted.abort_locally()
    with pytest.raises(anyio.EndOfStream):
        aborted.receive_nowait()


async def test_waiting_consumer_is_woken_by_failure() -> None:
    stream = RequestStream("r", 0)

    async def fail_later() -> None:
        await anyio.sleep(0.05)
        stream.fail(lambda: EngineDeadError("x"))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(fail_later)
            with pytest.raises(EngineDeadError):
                await stream.receive()


async def test_local_abort_ends_iteration() -> None:
    stream = RequestStream("r", 0)
    stream.deliver(_out([1]))
    stream.abort_locally()
    assert [o async for o in stream] == []
    assert stream.aborted


def test_make_request_defaults() -> None:
    req = make_request([5, 6], eos_token_id=2, stop_token_ids=[9])
    assert req.request_id.startswith("req-")
    assert req.arrival_time > 1.7e9
    sp = req.sampling_params
    assert sp is not None
    assert sp.max_tokens == 16
    assert sp.temperature == 0.0
    assert sp._eos_token_id == 2
    assert sp._all_stop_token_ids == {2, 9}
    assert sp.stop_token_ids == [9]
    assert sp.n == 1


def test_make_request_ignore_eos_and_extra_eos() -> None:
    req = make_request([5], eos_token_id=2, extra_eos_token_ids=[3], ignore_eos=True)
    sp = req.sampling_params
    assert sp is not None
    assert sp._eos_token_id is None
    assert sp._all_stop_token_ids == {3}
    assert sp.stop_token_ids == []
    req = make_request([5], eos_token_id=2, extra_eos_token_ids=[3])
    assert req.sampling_params is not None
    assert req.sampling_params.stop_token_ids == [3]
    assert req.sampling_params._all_stop_token_ids == {2, 3}


def test_max_tokens_default_from_context() -> None:
    req = make_request([1, 2, 3], max_tokens=None, max_model_len=10)
    assert req.sampling_params is not None
    assert req.sampling_params.max_tokens == 7
    with pytest.raises(ValueError, match="max_tokens is None"):
        make_request([1], max_tokens=None)
    with pytest.raises(ValueError, match="maximum model length of 10"):
        make_request([1] * 10, max_model_len=10)
    with pytest.raises(ValueError, match="empty"):
        make_request([])
    with pytest.raises(ValueError, match="n must be 1"):
        prepare_sampling_params(SamplingParams(n=2, max_tokens=3))


def test_request_ids_are_unique() -> None:
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert new_request_id("x").startswith("x-")


async def test_lagging_stream_coalesces_logprobs_rows_in_order() -> None:
    stream = RequestStream("r", 0, max_pending=2)
    for i in range(50):
        stream.deliver(_out([i, i + 1000], 1 if i == 49 else None, new_logprobs=_lp([i, i + 1000])))
    outputs = [out async for out in stream]
    assert len(outputs) == 2
    tokens = [t for out in outputs for t in out.new_token_ids]
    rows = [r for out in outputs for r in out.new_logprobs.logprob_token_ids[:, 0].tolist()]
    assert tokens == rows == [t for i in range(50) for t in (i, i + 1000)]
    assert outputs[-1].new_logprobs.sampled_token_ranks.shape == (98,)


async def test_interleaved_consumption_with_coalescing() -> None:
    stream = RequestStream("r", 0, max_pending=2)
    seen: list[int] = []
    for i in range(30):
        stream.deliver(_out([i], 1 if i == 29 else None, new_logprobs=_lp([i])))
        if i % 7 == 0:
            out = await stream.receive()
            seen.extend(out.new_token_ids)
            assert out.new_logprobs.logprob_token_ids[:, 0].tolist() == out.new_token_ids
    async for out in stream:
        seen.extend(out.new_token_ids)
        assert out.new_logprobs.logprob_token_ids[:, 0].tolist() == out.new_token_ids
    assert seen == list(range(30))


async def test_parked_consumers_each_get_an_item() -> None:
    """A mailbox has one consumer as a rule, but two parked at once are both woken
    (the trio wake-up keeps one parked task in a slot and more in a list)."""
    box: Mailbox[int] = Mailbox()
    got: list[int] = []

    async def consume() -> None:
        got.append(await box.receive())

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()
            assert box._waiting
            box.put_nowait(1)
            box.put_nowait(2)
    assert sorted(got) == [1, 2]


async def test_cancelled_parked_consumer_leaves_the_item_for_the_next() -> None:
    """Cancelled while parked: nothing consumed, nothing left parked; a later put wakes
    the next receive."""
    stream = RequestStream("r", 0)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(stream.receive)
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
        assert not stream._waiting
        stream.deliver(_out([5]))
        assert (await stream.receive()).new_token_ids == [5]

        async def deliver_when_parked() -> None:
            await anyio.wait_all_tasks_blocked()
            stream.deliver(_out([6]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(deliver_when_parked)
            assert (await stream.receive()).new_token_ids == [6]


async def test_cancelled_parked_consumer_does_not_strand_the_others() -> None:
    """Consumers parked at once, one cancelled: the others are still woken by the next
    puts (a single "someone waits" flag, cleared by the cancelled one, left them parked
    with no put ever waking them)."""
    box: Mailbox[int] = Mailbox()
    got: list[int] = []

    async def consume() -> None:
        got.append(await box.receive())

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            tg.start_soon(consume)
            async with anyio.create_task_group() as doomed:
                doomed.start_soon(box.receive)
                await anyio.wait_all_tasks_blocked()
                doomed.cancel_scope.cancel()
            box.put_nowait(1)
            box.put_nowait(2)
    assert sorted(got) == [1, 2]


async def test_receive_batch_takes_every_buffered_output_in_order() -> None:
    stream = RequestStream("r", 0, max_pending=4)
    for i in range(10):  # 4 buffered, the last holding 7 merged outputs
        stream.deliver(_out([i], 1 if i == 9 else None, new_logprobs=_lp([i])))
    batch = await stream.receive_batch()
    assert [out.new_token_ids for out in batch] == [[0], [1], [2], list(range(3, 10))]
    assert batch[-1].new_logprobs.logprob_token_ids[:, 0].tolist() == list(range(3, 10))
    assert stream.finish_reason == 1
    assert not stream._pending
    with pytest.raises(anyio.EndOfStream):
        await stream.receive_batch()
    with pytest.raises(anyio.EndOfStream):
        await stream.receive()


async def test_receive_batch_mixed_with_iteration_loses_nothing() -> None:
    stream = RequestStream("r", 0, max_pending=3)
    seen: list[int] = []
    for i in range(40):
        stream.deliver(_out([i], 1 if i == 39 else None, new_logprobs=_lp([i])))
        if i % 5 == 0:
            for out in await stream.receive_batch():
                assert out.new_logprobs.logprob_token_ids[:, 0].tolist() == out.new_token_ids
                seen.extend(out.new_token_ids)
        elif i % 7 == 0:
            seen.extend((await stream.receive()).new_token_ids)
    async for out in stream:
        seen.extend(out.new_token_ids)
    assert seen == list(range(40))


async def test_receive_batch_waits_for_the_first_output() -> None:
    """Parked with nothing buffered, woken by the next delivery, it returns what is
    buffered when it runs (the wake-up is sent once, by the first delivery)."""
    stream = RequestStream("r", 0)
    got: list[list[int]] = []

    async def consume() -> None:
        got.extend(out.new_token_ids for out in await stream.receive_batch())

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()
            assert stream._waiting
            stream.deliver(_out([1]))
            stream.deliver(_out([2]))
    assert got == [[1], [2]]


async def test_cancelled_receive_batch_consumes_nothing() -> None:
    stream = RequestStream("r", 0)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:  # cancelled while parked
            tg.start_soon(stream.receive_batch)
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
    assert not stream._waiting
    stream.deliver(_out([7]))
    stream.deliver(_out([8], 1))
    with anyio.CancelScope() as scope:  # cancelled with outputs buffered
        scope.cancel()
        await stream.receive_batch()
    assert scope.cancelled_caught
    assert [out.new_token_ids for out in await stream.receive_batch()] == [[7], [8]]


async def test_receive_batch_raises_the_error_after_buffered_outputs() -> None:
    stream = RequestStream("r", 0)
    stream.deliver(_out([1]))
    stream.deliver(_out([2]))
    stream.fail(lambda: EngineDeadError("gone"))
    assert [out.new_token_ids for out in await stream.receive_batch()] == [[1], [2]]
    with pytest.raises(EngineDeadError):
        await stream.receive_batch()


async def test_put_many_queues_in_order_and_wakes_the_parked_consumer() -> None:
    """The receive loop's queueing of a run of raw messages: one call, the items in
    order after what was queued, a parked consumer woken; nothing once ended."""
    box: Mailbox[int] = Mailbox()
    got: list[int] = []

    async def consume() -> None:
        got.extend(await box.receive_batch())

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()
            box.put_many([1, 2])
    assert got == [1, 2]
    box.put_nowait(3)
    box.put_many([4, 5])
    box.end()
    box.put_many([6])
    assert await box.receive_batch() == [3, 4, 5]


async def test_mailbox_receive_batch_and_end() -> None:
    box: Mailbox[int] = Mailbox()
    for i in range(3):
        box.put_nowait(i)
    box.end()
    assert await box.receive_batch() == [0, 1, 2]
    with pytest.raises(anyio.EndOfStream):
        await box.receive_batch()


@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("deliver_first", [False, True])
async def test_cancel_racing_the_wake_up_loses_nothing(batch: bool, deliver_first: bool) -> None:
    """A parked consumer woken and cancelled in the same step, in either order: it
    returns the output or consumes nothing (on trio the abort runs only while still
    parked), it is no longer counted as waiting, and the next call gets the rest."""
    stream = RequestStream("r", 0)
    got: list[int] = []

    async def consume() -> None:
        if batch:
            got.extend(t for out in await stream.receive_batch() for t in out.new_token_ids)
        else:
            got.extend((await stream.receive()).new_token_ids)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()
            assert stream._waiting == 1
            if deliver_first:
                stream.deliver(_out([1]))
                tg.cancel_scope.cancel()
            else:
                tg.cancel_scope.cancel()
                stream.deliver(_out([1]))
            stream.deliver(_out([2], 1))
        assert stream._waiting == 0
        async for out in stream:
            got.extend(out.new_token_ids)
    assert got == [1, 2]
    assert stream.finish_reason == 1


async def test_receive_batch_parked_when_the_engine_dies() -> None:
    """Parked, then an output and the death in one step: the batch first, then the
    error; after a final output, the end of the stream and not the error."""
    stream = RequestStream("r", 0)
    got: list[list[int]] = []
    errors: list[BaseException] = []

    async def consume() -> None:
        got.append([t for out in await stream.receive_batch() for t in out.new_token_ids])
        try:
            await stream.receive_batch()
        except EngineDeadError as exc:
            errors.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()
            stream.deliver(_out([1]))
            stream.deliver(_out([2]))
            stream.fail(lambda: EngineDeadError("gone"))
        assert got == [[1, 2]]
        assert len(errors) == 1
        assert not stream._waiting

        empty = RequestStream("r", 0)
        errors.clear()

        async def consume_empty() -> None:
            try:
                await empty.receive_batch()
            except EngineDeadError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume_empty)
            await anyio.wait_all_tasks_blocked()
            empty.fail(lambda: EngineDeadError("gone"))  # woken by the error alone
        assert len(errors) == 1
        assert not empty._waiting

        final = RequestStream("r", 0)
        final.deliver(_out([3]))
        final.deliver(_out([4], 1))
        final.fail(lambda: EngineDeadError("gone"))
        assert [out.new_token_ids for out in await final.receive_batch()] == [[3], [4]]
        with pytest.raises(anyio.EndOfStream):
            await final.receive_batch()


# -- set_listener: outputs taken in the producer's call, while the consumer is parked ----


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_listener_takes_outputs_only_while_the_consumer_is_parked(
    anyio_backend: str,
) -> None:
    budget = ListenBudget(float("inf"))
    stream = RequestStream("r", 0, budget=budget)
    taken: list[list[int]] = []
    stream.set_listener(lambda out: taken.append(out.new_token_ids) or True)
    stream.deliver(_out([1]))  # nobody parked yet: queued
    got: list[list[int]] = []

    async def consume() -> None:
        async for out in stream:
            got.append(out.new_token_ids)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await wait_all_tasks_blocked()  # the consumer took [1] and parked
        stream.deliver(_out([2]))
        stream.deliver(_out([3]))
        assert taken == [[2], [3]]
        budget.until = 0.0  # the receive task's time for listeners is up: queued
        stream.deliver(_out([4]))
        stream.deliver(_out([5]))  # the consumer was woken: not parked now
        await wait_all_tasks_blocked()
        budget.until = float("inf")
        stream.deliver(_out([6]))  # parked again
        stream.deliver(_out([7], FinishReason.LENGTH))  # never the final output
    assert taken == [[2], [3], [6]]
    assert got == [[1], [4], [5], [7]]
    assert stream.finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_listener_that_declines_leaves_the_output_queued(anyio_backend: str) -> None:
    stream = RequestStream("r", 0)
    stream.set_listener(lambda out: False)
    got: list[list[int]] = []

    async def consume() -> None:
        async for out in stream:
            got.append(out.new_token_ids)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await wait_all_tasks_blocked()
        stream.deliver(_out([1]))
        await wait_all_tasks_blocked()
        stream.set_listener(None)
        stream.deliver(_out([2], FinishReason.STOP))
    assert got == [[1], [2]]


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_cancelled_consumer_is_not_parked(anyio_backend: str) -> None:
    stream = RequestStream("r", 0)
    taken: list[list[int]] = []
    stream.set_listener(lambda out: taken.append(out.new_token_ids) or True)
    async with anyio.create_task_group() as tg:
        tg.start_soon(stream.receive)
        await wait_all_tasks_blocked()
        tg.cancel_scope.cancel()  # the consumer is rescheduled with Cancelled...
        stream.deliver(_out([1]))  # ...so this waits for the next receive
    assert taken == []
    assert stream.receive_nowait().new_token_ids == [1]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_on_asyncio_a_listener_is_never_called(anyio_backend: str) -> None:
    stream = RequestStream("r", 0)
    stream.set_listener(lambda out: pytest.fail("called") or True)
    got: list[list[int]] = []

    async def consume() -> None:
        got.append((await stream.receive()).new_token_ids)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await wait_all_tasks_blocked()
        stream.deliver(_out([1]))
    assert got == [[1]]
