"""Cancellation at every checkpoint of every public async operation.

Each scenario runs under the testing kit's :func:`~trio_vllm.testing.check_cancellation`:
once uncancelled (counting its checkpoints), then once cancelled at each checkpoint
``k`` for every ``k`` it saw. After every run the kit checks that no task the run
started still runs, no utility call is pending, no stream or raw request the run made is
still live on the client, the engines (asked through their control sockets) hold no
request the client does not know of, and the client is still alive; the scenario's own
checks are added per test.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from trio_vllm import EngineCoreOutputs, LoRARequest, ReferenceEngines, make_request, open_client
from trio_vllm.testing import CheckpointRun, check_cancellation

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from trio_vllm import EngineCoreClient
    from trio_vllm.testing import CancellationReport, ReferenceEngineSet

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

# Long enough that a request is still running when a cancellation lands, and still
# running on the engine when the kit asks (the echo model takes about 10 us a step).
LONG = 900_000
ENGINES: dict[str, Any] = {"model": "echo", "extra_args": ("--max-model-len", "1000000")}


def _child_pids() -> set[int]:
    pids: set[int] = set()
    me = os.getpid()
    for task in os.listdir(f"/proc/{me}/task"):
        try:
            text = Path(f"/proc/{me}/task/{task}/children").read_text()
        except OSError:
            continue
        pids.update(int(p) for p in text.split())
    return pids


async def _sweep(
    scenario: Callable[[], Awaitable[object]], *, min_checkpoints: int = 1, **options: Any
) -> CancellationReport:
    """Cancel ``scenario`` at every checkpoint k = 1, 2, ... until a run completes
    uncancelled, and assert every run kept the invariants.

    ``check_cancellation`` covers the checkpoints its first, uncancelled run counted;
    timing can give later runs more, so the sweep goes on past that count until a run
    ends before its k-th checkpoint.
    """
    # The kit polls until the engines and tasks are clean and returns at once then;
    # ``settle`` only bounds that wait, and a loaded machine can need seconds.
    options.setdefault("settle", 10.0)
    report = await check_cancellation(scenario, **options)
    report.assert_ok()
    assert report.checkpoints >= min_checkpoints, report
    # Every checkpoint the first run saw got its own cancelled run.
    assert [r.checkpoint for r in report.runs] == [None, *range(1, report.checkpoints + 1)]
    assert any(r.outcome == "cancelled" for r in report.runs[1:]), report
    k = report.checkpoints
    while report.runs[-1].cancel_requested:
        k += 1
        assert k <= report.checkpoints + 20, f"no uncancelled run up to checkpoint {k}"
        more = await check_cancellation(scenario, checkpoints=[k], **options)
        more.assert_ok()
        report.runs.append(more.runs[-1])
    return report


# ---------------------------------------------------------------------- open_client


@pytest.mark.parametrize("count", [1, 2], ids=["1-engine", "dp2"])
async def test_open_client_cancelled_at_every_checkpoint(count: int) -> None:
    """Cancelling ``open_client`` anywhere (startup, body, exit) leaves no task, no engine
    process (reaped, no zombie) and no ipc file; the client it yielded, if any, is
    closed (dead)."""
    clients: list[EngineCoreClient] = []
    children_before = _child_pids()

    async def scenario() -> None:
        async with open_client(
            ReferenceEngines(count, model="echo"), ready_timeout=30, shutdown_grace=2
        ) as client:
            clients.append(client)
            assert len(await client.call_utility_all("get_supported_tasks")) == count

    def nothing_left(run: CheckpointRun) -> None:
        left = _child_pids() - children_before
        assert not left, f"engine process(es) {left} left behind"
        if clients:
            client = clients.pop()
            assert client.dead, "the client is still alive after open_client exited"
            for address in client.addresses.values():
                path = address.removeprefix("ipc://")
                assert not Path(path).exists(), f"ipc socket file {path} left behind"

    report = await _sweep(scenario, checks=[nothing_left], min_checkpoints=3)
    print(f"open_client: {report.checkpoints} checkpoints, swept k = 1..{len(report.runs) - 1}")


# ---------------------------------------------------------------------- requests


@pytest.mark.reference_engines(**ENGINES)
async def test_generate_and_iteration(reference_engines: ReferenceEngineSet) -> None:
    client = reference_engines.client
    tokens: list[list[int]] = []

    async def scenario() -> None:
        got: list[int] = []
        async with client.generate(make_request([3, 4, 5], max_tokens=6)) as stream:
            async for out in stream:
                got.extend(out.new_token_ids)
        tokens.append(got)

    def complete_when_returned(run: CheckpointRun) -> None:
        if run.outcome == "returned":
            assert tokens.pop() == [3, 4, 5, 3, 4, 5]

    # At least the ADD's send, the first receive and the one that ends the iteration:
    # receives that find outputs buffered within 1 ms of the last yield do not yield
    # (on a loaded machine all six outputs can be buffered before the first receive).
    report = await _sweep(
        scenario, engines=reference_engines, checks=[complete_when_returned], min_checkpoints=3
    )
    print(f"generate: {report.checkpoints} checkpoints, swept k = 1..{len(report.runs) - 1}")


@pytest.mark.reference_engines(**ENGINES)
async def test_generate_and_receive_batch(reference_engines: ReferenceEngineSet) -> None:
    client = reference_engines.client
    tokens: list[list[int]] = []

    async def scenario() -> None:
        got: list[int] = []
        async with client.generate(make_request([3, 4, 5], max_tokens=6)) as stream:
            try:
                while True:
                    for out in await stream.receive_batch():
                        got.extend(out.new_token_ids)
            except anyio.EndOfStream:
                pass
        tokens.append(got)

    def complete_when_returned(run: CheckpointRun) -> None:
        if run.outcome == "returned":
            assert tokens.pop() == [3, 4, 5, 3, 4, 5]

    # At least the ADD's send and the receive that ends the stream.
    await _sweep(
        scenario, engines=reference_engines, checks=[complete_when_returned], min_checkpoints=2
    )


@pytest.mark.reference_engines(**ENGINES)
async def test_generate_long_request_is_aborted_on_the_engine(
    reference_engines: ReferenceEngineSet,
) -> None:
    """A request that is still running when its consumer is cancelled is aborted on
    the engine (the kit asks the engine what it holds after every run)."""
    client = reference_engines.client

    async def scenario() -> None:
        async with client.generate(make_request([7], max_tokens=LONG)) as stream:
            for _ in range(5):
                await stream.receive()

    # At least the ADD's send and the first receive: a receive that finds an output
    # buffered within 1 ms of its previous yield only checks for cancellation, and the
    # abort on the way out is queued without a checkpoint (a loaded run saw exactly 2).
    await _sweep(scenario, engines=reference_engines, min_checkpoints=2)


@pytest.mark.reference_engines(**ENGINES)
async def test_add_request_and_get_output(reference_engines: ReferenceEngineSet) -> None:
    """The raw API used the way vLLM's frontends do: add, consume batches, abort on the
    way out (shielded). Cancelled anywhere, nothing is left on client or engine and no
    batch is lost for the requests that stay."""
    client = reference_engines.client

    async def scenario() -> None:
        request = make_request([1, 2], max_tokens=5)
        rid = request.request_id
        try:
            await client.add_request(request)
            tokens: list[int] = []
            finished = False
            while not finished:
                batch: EngineCoreOutputs = await client.get_output()
                for out in batch.outputs:
                    if out.request_id == rid:
                        tokens.extend(out.new_token_ids)
                        finished = out.finish_reason is not None
            assert tokens == [1, 2, 1, 2, 1]
        finally:
            if rid in client.live_requests:
                with anyio.CancelScope(shield=True):
                    await client.abort_requests([rid])

    # At least the ADD's send and the first get_output: later calls that find batches
    # queued within 1 ms of the last yield do not yield.
    await _sweep(scenario, engines=reference_engines, min_checkpoints=2)
    _drain(client)


@pytest.mark.reference_engines(**ENGINES)
async def test_abort_requests(reference_engines: ReferenceEngineSet) -> None:
    """``abort_requests`` cancelled at any checkpoint changed nothing: the request is still
    live on the client (and running on the engine); completed, it is gone from both."""
    client = reference_engines.client
    cancelled_while_live: list[bool] = []

    async def scenario() -> None:
        request = make_request([5], max_tokens=LONG)
        rid = request.request_id
        await client.add_request(request)
        try:
            await client.abort_requests([rid])
        except BaseException:
            cancelled_while_live.append(rid in client.live_requests)
            with anyio.CancelScope(shield=True):
                await client.abort_requests([rid])
            raise
        assert rid not in client.live_requests

    await _sweep(scenario, engines=reference_engines, min_checkpoints=2)
    # At least the run cancelled inside abort_requests found the request still live.
    assert cancelled_while_live, "no run was cancelled inside abort_requests"
    assert all(cancelled_while_live), cancelled_while_live
    _drain(client)


@pytest.mark.reference_engines(**ENGINES)
async def test_stream_aborted_from_another_call(reference_engines: ReferenceEngineSet) -> None:
    """A stream whose request is aborted through ``abort_requests`` ends as aborted, and
    the engine drops the request, wherever a cancellation lands."""
    client = reference_engines.client

    async def scenario() -> None:
        request = make_request([5, 6], max_tokens=LONG)
        async with client.generate(request) as stream:
            await stream.receive()
            await client.abort_requests([request.request_id])
            async for _ in stream:
                pass
            assert stream.aborted

    await _sweep(scenario, engines=reference_engines, min_checkpoints=3)
    _drain(client)


def _drain(client: EngineCoreClient) -> None:
    """Drop batches left queued for aborted raw requests (stats, late outputs)."""
    while True:
        try:
            client.get_output_nowait()
        except anyio.WouldBlock:
            return


@pytest.mark.reference_engines(**ENGINES)
async def test_get_output_cancelled_consumes_nothing(
    reference_engines: ReferenceEngineSet,
) -> None:
    """A batch queued before a cancelled ``get_output`` is still there afterwards."""
    client = reference_engines.client
    marker: list[str] = []

    async def queue_marker() -> None:
        request = make_request([8], max_tokens=1)
        marker[:] = [request.request_id]
        await client.add_request(request)
        # Its one batch is queued once the request is no longer live (both happen as
        # the receive task handles it); a fixed 0.2 s could end first on a loaded
        # machine, and a cancelled run then looked as if it had taken the batch.
        with anyio.fail_after(30):
            while request.request_id in client.live_requests:  # noqa: ASYNC110
                await anyio.sleep(0.005)

    def is_marker(batch: EngineCoreOutputs) -> bool:
        return [o.request_id for o in batch.outputs] == marker

    async def scenario() -> None:
        while not is_marker(await client.get_output()):  # skip stats-only batches
            pass

    async def still_queued_if_cancelled(run: CheckpointRun) -> None:
        if run.outcome == "cancelled":
            try:
                while not is_marker(client.get_output_nowait()):
                    pass
            except anyio.WouldBlock:
                raise AssertionError("a cancelled get_output took the batch") from None
        await queue_marker()  # for the next run

    await queue_marker()
    await _sweep(scenario, engines=reference_engines, checks=[still_queued_if_cancelled])
    _drain(client)


@pytest.mark.reference_engines(**ENGINES)
async def test_get_output_cancelled_waiter_leaves_the_other_woken(
    reference_engines: ReferenceEngineSet,
) -> None:
    """Two tasks wait in ``get_output``, one is cancelled: the other still gets the next
    batch (no sweep: the two waits are parked before the cancellation, by construction)."""
    client = reference_engines.client
    _drain(client)
    got: list[EngineCoreOutputs] = []

    async def wait_one() -> None:
        got.append(await client.get_output())

    request = make_request([8], max_tokens=1)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_one)
            async with anyio.create_task_group() as doomed:
                doomed.start_soon(client.get_output)
                await anyio.wait_all_tasks_blocked()
                doomed.cancel_scope.cancel()
            await client.add_request(request)
        while request.request_id in client.live_requests:  # noqa: ASYNC110
            await anyio.sleep(0.005)
    assert len(got) == 1
    _drain(client)


# ---------------------------------------------------------------------- utilities


@pytest.mark.reference_engines(**ENGINES)
async def test_call_utility(reference_engines: ReferenceEngineSet) -> None:
    client = reference_engines.client

    async def scenario() -> None:
        assert "generate" in await client.call_utility("get_supported_tasks")

    await _sweep(scenario, engines=reference_engines, min_checkpoints=2)
    # Late replies of cancelled calls were dropped; the client still matches replies.
    assert await client.call_utility("collective_rpc", "echo", None, ["after"], None) == [["after"]]


@pytest.mark.reference_engines(**ENGINES)
async def test_slow_utility_cancelled_while_waiting(
    reference_engines: ReferenceEngineSet,
) -> None:
    """Cancelled while the reply is held back 50 ms: the entry goes at once, and the
    late reply is dropped quietly."""
    client = reference_engines.client
    await reference_engines.control().delay_outputs(50)

    async def scenario() -> None:
        assert "generate" in await client.call_utility("get_supported_tasks")

    await _sweep(scenario, engines=reference_engines, min_checkpoints=2)
    await reference_engines.control().delay_outputs(0)
    await anyio.sleep(0.1)
    assert client.pending_utility_calls == 0
    assert await client.call_utility("collective_rpc", "echo", None, ["after"], None) == [["after"]]


LORA = LoRARequest("adapter", 1, "/nonexistent/adapter")

# (name, call, cleanup after the whole check) for every named utility.
NAMED: list[tuple[str, Callable[[EngineCoreClient], Awaitable[Any]]]] = [
    ("get_supported_tasks", lambda c: c.get_supported_tasks()),
    ("is_sleeping", lambda c: c.is_sleeping()),
    ("sleep", lambda c: c.sleep(1)),
    ("wake_up", lambda c: c.wake_up()),
    ("reset_prefix_cache", lambda c: c.reset_prefix_cache()),
    ("reset_mm_cache", lambda c: c.reset_mm_cache()),
    ("reset_encoder_cache", lambda c: c.reset_encoder_cache()),
    ("add_lora", lambda c: c.add_lora(LORA)),
    ("list_loras", lambda c: c.list_loras()),
    ("pin_lora", lambda c: c.pin_lora(1)),
    ("remove_lora", lambda c: c.remove_lora(1)),
    ("pause_scheduler", lambda c: c.pause_scheduler()),
    ("is_scheduler_paused", lambda c: c.is_scheduler_paused()),
    ("resume_scheduler", lambda c: c.resume_scheduler()),
    ("collective_rpc", lambda c: c.collective_rpc("echo")),
    ("execute_dummy_batch", lambda c: c.execute_dummy_batch()),
    ("get_weight_version", lambda c: c.get_weight_version()),
    ("set_weight_version", lambda c: c.set_weight_version("v2")),
    ("compute_weight_checksums", lambda c: c.compute_weight_checksums()),
    ("save_sharded_state", lambda c: c.save_sharded_state("/tmp/unused")),
    ("profile", lambda c: c.profile(True)),
]


@pytest.mark.parametrize("count", [1, 2], ids=["1-engine", "dp2"])
async def test_every_named_utility(count: int) -> None:
    """Every named utility, on one engine and on two (data-parallel fan-out)."""
    from trio_vllm import UtilityCallError
    from trio_vllm.testing import open_reference_engines

    async with open_reference_engines(
        count=count, model="echo", extra_args=("--max-loras", "2")
    ) as engines:
        client = engines.client
        problems: list[str] = []
        refused: set[str] = set()
        for name, call in NAMED:

            async def scenario(call: Any = call, name: str = name) -> None:
                try:
                    await call(client)
                except UtilityCallError:
                    refused.add(name)  # the engine refused it: still a complete call

            try:
                await _sweep(scenario, engines=engines)
            except AssertionError as exc:
                problems.append(f"{name}:\n{exc}")
            # Restore the engines' state for the next utility.
            await client.wake_up()
            await client.resume_scheduler()
        assert not problems, "\n".join(problems)
        # The reference engine implements every one of them: each call really ran.
        assert refused == set(), refused
        assert client.pending_utility_calls == 0
        assert await client.get_supported_tasks()


# ---------------------------------------------------------------------- data parallel


@pytest.mark.reference_engines(**ENGINES, count=2)
async def test_dp_generate_on_each_rank(reference_engines: ReferenceEngineSet) -> None:
    client = reference_engines.client

    async def scenario() -> None:
        async with anyio.create_task_group() as tg:
            for rank in (0, 1):

                async def one(rank: int = rank) -> None:
                    request = make_request([rank + 1], max_tokens=LONG)
                    async with client.generate(request, rank=rank) as stream:
                        for _ in range(3):
                            await stream.receive()

                tg.start_soon(one)

    await _sweep(scenario, engines=reference_engines)


@pytest.mark.reference_engines(**ENGINES, count=2)
async def test_dp_call_utility_all_and_routing(reference_engines: ReferenceEngineSet) -> None:
    client = reference_engines.client

    async def scenario() -> None:
        assert await client.collective_rpc("echo", args=["x"]) == [["x"], ["x"]]
        request = make_request([2], max_tokens=3)
        async with client.generate(request) as stream:
            assert await stream.collect() == [2, 2, 2]

    await _sweep(scenario, engines=reference_engines, min_checkpoints=3)
    # The load counts used for routing came back to zero: requests alternate ranks.
    ranks = []
    for _ in range(4):
        async with client.generate(make_request([1], max_tokens=LONG)) as stream:
            ranks.append(stream.rank)
    assert ranks == [0, 0, 0, 0]  # nothing in flight: always the least busy, rank 0
    async with (
        client.generate(make_request([1], max_tokens=LONG)) as first,
        client.generate(make_request([1], max_tokens=LONG)) as second,
    ):
        assert {first.rank, second.rank} == {0, 1}
