"""`RequestOutputStream.set_direct`: outputs handed over in the receive task.

Against real reference engines (echo model, byte-level tokenizer: token id = byte). With
a step interval the caller is parked between engine steps, so the handler takes every
step's outputs but the last, which the caller's wait returns, as do a stop string's
end and a handler's exception.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import pytest

import trio_vllm as tv
from trio_vllm.llm import LLM
from trio_vllm.protocol import RequestOutputKind
from trio_vllm.reference_engine import MODEL_DIR

if TYPE_CHECKING:
    from trio_vllm.testing import ReferenceEngineSet
    from trio_vllm.text import RequestOutput

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

LONG = 900_000  # only an abort (here: a stop string's) ends it within the test
STEPPED = {"model": "echo", "extra_args": ("--step-interval-ms", "5", "--max-model-len", "1000000")}


def delta(**kwargs: object) -> tv.SamplingParams:
    return tv.SamplingParams(temperature=0.0, output_kind=RequestOutputKind.DELTA, **kwargs)  # type: ignore[arg-type]


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.outputs[0].token_ids]


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.reference_engines(**STEPPED)
async def test_the_handler_takes_every_step_but_the_last(
    reference_engines: ReferenceEngineSet, anyio_backend: str
) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    seen: list[tuple[str, RequestOutput]] = []  # who took each output, in order
    n = 40
    async with llm.generate("abcdefgh", delta(max_tokens=n)) as stream:
        assert stream.set_direct(lambda outs: seen.extend(("handler", o) for o in outs))
        while batch := await stream.next_batch():
            seen.extend(("caller", o) for o in batch)
    assert tokens([o for _, o in seen]) == list(b"abcdefgh" * 5)
    by_handler = [o for who, o in seen if who == "handler"]
    assert not any(o.finished for o in by_handler)
    assert seen[-1][0] == "caller"
    assert seen[-1][1].finished
    # The first step may come before the caller parks; all but a few go directly.
    assert len(by_handler) >= n // 2, [who for who, _ in seen]
    assert llm.num_requests == 0


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.reference_engines(**STEPPED)
async def test_a_stop_string_ends_the_stream_through_the_caller(
    reference_engines: ReferenceEngineSet, anyio_backend: str
) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    taken: list[RequestOutput] = []
    async with llm.generate("abcdef" * 3 + "xyz", delta(max_tokens=LONG, stop=["xyza"])) as stream:
        assert stream.set_direct(taken.extend)
        rest = [o async for o in stream]
    assert taken
    text = "".join(o.outputs[0].text for o in [*taken, *rest])
    assert text == "abcdef" * 3
    final = rest[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", "xyza")
    # The engine knows no stop strings: without the caller's ABORT it would run on.
    assert (await reference_engines.controls[0].wait_idle(within=15.0)).requests == 0
    assert llm.num_requests == 0


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.reference_engines(**STEPPED)
async def test_a_handlers_exception_is_raised_from_the_wait(
    reference_engines: ReferenceEngineSet, anyio_backend: str
) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    calls = 0

    def handler(outs: list[RequestOutput]) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise ValueError("the handler's own bug")

    async def consume() -> None:
        async with llm.generate("ab", delta(max_tokens=LONG)) as stream:
            assert stream.set_direct(handler)
            while await stream.next_batch():
                pass

    with pytest.raises(ValueError, match="the handler's own bug"):
        await consume()
    assert calls == 3
    # The client's receive task lived on, and leaving the block aborted the request.
    assert not reference_engines.client.dead
    assert (await reference_engines.controls[0].wait_idle(within=15.0)).requests == 0
    assert llm.num_requests == 0
    out = await llm.generate_final("ok", delta(max_tokens=4))
    assert out.outputs[0].text == "okok"


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.reference_engines(**STEPPED)
async def test_the_handler_cancelling_the_wait_loses_nothing(
    reference_engines: ReferenceEngineSet, anyio_backend: str
) -> None:
    """What trio-vllm serve does when a socket is full: the handler cancels the
    caller's wait to get its attention; the wait consumed nothing."""
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    seen: list[RequestOutput] = []
    scope: anyio.CancelScope | None = None
    woken = 0

    def handler(outs: list[RequestOutput]) -> None:
        seen.extend(outs)
        if len(seen) % 7 == 0 and scope is not None:
            scope.cancel()

    async with llm.generate("abcd", delta(max_tokens=60)) as stream:
        assert stream.set_direct(handler)
        while True:
            with anyio.CancelScope() as scope:
                batch = await stream.next_batch()
            if scope.cancelled_caught:
                woken += 1
                continue
            if not batch:
                break
            seen.extend(batch)
    assert woken >= 2
    assert tokens(seen) == list(b"abcd" * 15)
    assert seen[-1].finished
    assert llm.num_requests == 0


@pytest.mark.reference_engines(**STEPPED)
async def test_only_an_entered_single_request_stream_goes_direct(
    reference_engines: ReferenceEngineSet,
) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    taken: list[RequestOutput] = []
    cm = llm.generate("ab", delta(max_tokens=4))
    assert not cm.set_direct(taken.extend)  # not entered: nothing sent yet
    two = tv.SamplingParams(n=2, seed=1, output_kind=RequestOutputKind.DELTA, max_tokens=4)
    async with llm.generate("ab", two) as stream:
        assert not stream.set_direct(taken.extend)  # n > 1: the children's pumps
        outs = [o async for o in stream]
    assert sum(len(c.token_ids) for o in outs for c in o.outputs) == 8
    async with llm.generate("ab", delta(max_tokens=4)) as stream:
        pass
    assert not stream.set_direct(taken.extend)  # closed
    assert taken == []


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.reference_engines(**STEPPED)
async def test_on_asyncio_every_output_still_reaches_the_caller(
    reference_engines: ReferenceEngineSet, anyio_backend: str
) -> None:
    llm = LLM(reference_engines.client, model=MODEL_DIR)
    taken: list[RequestOutput] = []
    got: list[RequestOutput] = []
    async with llm.generate("abc", delta(max_tokens=12)) as stream:
        assert stream.set_direct(taken.extend)
        while batch := await stream.next_batch():
            got.extend(batch)
    assert taken == []
    assert tokens(got) == list(b"abc" * 4)
