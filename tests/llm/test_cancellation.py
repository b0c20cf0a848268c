"""Cancellation at every checkpoint of the text frontend's operations.

Each scenario runs under :func:`~trio_vllm.testing.check_cancellation`: once uncancelled
(counting its checkpoints), then cancelled at each one. After every run the kit checks
that the client holds no request and no utility call of the run, that the engine
(asked through its control socket) holds no request the client forgot, and that no task
is left; the checks here add that the LLM and its output processor forgot the request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import pytest

import trio_vllm as tv
from trio_vllm.llm import LLM
from trio_vllm.protocol import RequestOutputKind
from trio_vllm.reference_engine import MODEL_DIR
from trio_vllm.testing import CheckpointRun, check_cancellation

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from trio_vllm.testing import CancellationReport, ReferenceEngineSet

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

LONG = 900_000
ENGINES: dict[str, Any] = {"model": "echo", "extra_args": ("--max-model-len", "1000000")}


def _nothing_left(llm: LLM) -> Callable[[CheckpointRun], None]:
    def check(run: CheckpointRun) -> None:
        assert llm.num_requests == 0, f"the LLM still tracks {llm.live_request_ids}"
        left = llm._outputs.get_num_unfinished_requests()
        assert left == 0, f"the output processor still tracks {left} request(s)"

    return check


async def _sweep(
    scenario: Callable[[], Awaitable[object]],
    llm: LLM,
    engines: ReferenceEngineSet,
    *,
    min_checkpoints: int = 1,
    checks: tuple[Callable[[CheckpointRun], object], ...] = (),
) -> CancellationReport:
    """Cancel at every checkpoint k = 1, 2, ... until a run completes uncancelled."""
    options: dict[str, Any] = {
        "engines": engines,
        "checks": [_nothing_left(llm), *checks],
        # Polled: returns once clean; a loaded machine can need seconds to get there.
        "settle": 10.0,
    }
    report = await check_cancellation(scenario, **options)
    report.assert_ok()
    assert report.checkpoints >= min_checkpoints, report
    assert any(r.outcome == "cancelled" for r in report.runs[1:]), report
    k = report.checkpoints
    while report.runs[-1].cancel_requested:
        k += 1
        assert k <= report.checkpoints + 20, f"no uncancelled run up to checkpoint {k}"
        more = await check_cancellation(scenario, checkpoints=[k], **options)
        more.assert_ok()
        report.runs.append(more.runs[-1])
    return report


def _greedy(**kwargs: Any) -> tv.SamplingParams:
    return tv.SamplingParams(temperature=0.0, **kwargs)


@pytest.mark.reference_engines(**ENGINES)
async def test_generate_to_the_end(reference_engines: ReferenceEngineSet) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    texts: list[str] = []

    async def scenario() -> None:
        params = _greedy(max_tokens=6, output_kind=RequestOutputKind.DELTA)
        text = ""
        async with llm.generate("abc", params) as stream:
            async for out in stream:
                text += out.outputs[0].text
        texts.append(text)

    def complete_when_returned(run: CheckpointRun) -> None:
        if run.outcome == "returned":
            assert texts.pop() == "abcabc"

    await _sweep(
        scenario, llm, reference_engines, min_checkpoints=2, checks=(complete_when_returned,)
    )


@pytest.mark.reference_engines(**ENGINES)
async def test_long_generate_left_early(reference_engines: ReferenceEngineSet) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)

    async def scenario() -> None:
        async with llm.generate("ab", _greedy(max_tokens=LONG)) as stream:
            for _ in range(4):
                await stream.__anext__()

    await _sweep(scenario, llm, reference_engines, min_checkpoints=2)


@pytest.mark.reference_engines(**ENGINES)
async def test_stop_string(reference_engines: ReferenceEngineSet) -> None:
    """The stop-string ABORT and the final output are one step: cancelled anywhere, the
    engine holds nothing (the kit asks it) and the frontend forgot the request."""
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    finals: list[tv.RequestOutput] = []

    async def scenario() -> None:
        out = await llm.generate_final("abcd", _greedy(max_tokens=LONG, stop=["da"]))
        finals.append(out)

    def stopped_when_returned(run: CheckpointRun) -> None:
        if run.outcome == "returned":
            c = finals.pop().outputs[0]
            assert (c.text, c.finish_reason, c.stop_reason) == ("abc", "stop", "da")

    await _sweep(scenario, llm, reference_engines, checks=(stopped_when_returned,))


@pytest.mark.reference_engines(**ENGINES)
async def test_parallel_sampling(reference_engines: ReferenceEngineSet) -> None:
    """n > 1: every child is registered and sent in one step, and each is aborted on the
    way out; the per-request task group leaves no task behind."""
    llm = LLM(reference_engines.client, model=MODEL_DIR)

    async def scenario() -> None:
        params = tv.SamplingParams(max_tokens=LONG, n=3, temperature=1.0, seed=1)
        async with llm.generate("xy", params) as stream:
            seen: set[int] = set()
            async for out in stream:
                seen.update(c.index for c in out.outputs)
                if len(seen) == 3:
                    break

    await _sweep(scenario, llm, reference_engines, min_checkpoints=3)


@pytest.mark.reference_engines(**ENGINES)
async def test_parallel_sampling_to_the_end(reference_engines: ReferenceEngineSet) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    finals: list[tv.RequestOutput] = []

    async def scenario() -> None:
        params = tv.SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=1)
        finals.append(await llm.generate_final("xy", params))

    def complete_when_returned(run: CheckpointRun) -> None:
        if run.outcome == "returned":
            assert [c.text for c in finals.pop().outputs] == ["xyxy", "xyxy"]

    await _sweep(
        scenario, llm, reference_engines, min_checkpoints=2, checks=(complete_when_returned,)
    )


@pytest.mark.reference_engines(**ENGINES)
async def test_chat(reference_engines: ReferenceEngineSet) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)

    async def scenario() -> None:
        async with llm.chat([{"role": "user", "content": "hi"}], _greedy(max_tokens=LONG)) as s:
            await s.__anext__()
            await s.__anext__()

    await _sweep(scenario, llm, reference_engines, min_checkpoints=2)


@pytest.mark.reference_engines(**ENGINES)
async def test_abort(reference_engines: ReferenceEngineSet) -> None:
    """``llm.abort`` cancelled at its checkpoint changed nothing (the request still runs
    and the stream goes on); completed, the stream ends with an abort output."""
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    ends: list[str | None] = []

    async def scenario() -> None:
        async with llm.generate("ab", _greedy(max_tokens=LONG), request_id="a") as stream:
            await stream.__anext__()
            try:
                await llm.abort("a")
            except anyio.get_cancelled_exc_class():
                with anyio.CancelScope(shield=True):
                    # Not aborted: the request still streams.
                    assert not stream.finished
                    out = await stream.__anext__()
                    assert out.outputs[0].finish_reason is None
                raise
            last = await stream.collect()
            ends.append(last.outputs[0].finish_reason if last is not None else None)

    def aborted_when_returned(run: CheckpointRun) -> None:
        if run.outcome == "returned":
            assert ends.pop() == "abort"

    await _sweep(scenario, llm, reference_engines, checks=(aborted_when_returned,))
