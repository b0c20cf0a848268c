"""Issue 16 items 6, 7 (``n != 1``) and 8: caller input refused before anything changes.

* Item 6: ``abort_requests([live_id, "x"], rank=7)`` and ``abort_requests([live_id,
  "\\ud800"])`` raised after forgetting the live request locally but before its ABORT
  went out, so the engine kept running it and leaving ``generate`` sent nothing. Now the
  call raises before it changes anything: the request is still live, and an ABORT still
  reaches the engine when the caller leaves the block.
* Item 7: a hand-built request with ``n=2`` was sent (only ``make_request`` refused it).
* Item 8: out-of-vocabulary ids (prompt, ``allowed_token_ids``, ``logit_bias``) kill a
  stock engine core. With ``open_client(vocab_size=...)`` the client refuses them before
  sending. The reference engine with ``--oov-fatal`` dies of them as vLLM does, so the
  control case (no ``vocab_size``) shows the engine would have died. The same against
  stock vLLM is in ``tests/vllm_tier/test_vocab.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import pytest

from trio_vllm import (
    EngineCoreRequest,
    EngineDeadError,
    InvalidRequestError,
    ReferenceEngines,
    SamplingParams,
    make_request,
    open_client,
)
from trio_vllm.protocol import AbortRequests, UtilityCall

from ._peer import peer_client

if TYPE_CHECKING:
    from trio_vllm import EngineCoreClient

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.mark.parametrize(
    ("extra", "rank", "error"),
    [
        (["x"], 7, ValueError),  # unknown rank
        (["\ud800"], None, ValueError),  # an id that cannot be encoded (UTF-8)
        ([3], None, TypeError),  # not a str
    ],
    ids=["unknown-rank", "unencodable-id", "non-str-id"],
)
@pytest.mark.parametrize("api", ["generate", "add_request"])
async def test_item6_refused_abort_changes_nothing(
    api: str, extra: list[Any], rank: int | None, error: type[Exception]
) -> None:
    async with peer_client() as (client, peer):
        request = make_request([1, 2, 3], max_tokens=900_000, request_id="live")
        with anyio.fail_after(30):
            if api == "generate":
                async with client.generate(request) as stream:
                    await peer.wait_for(1)
                    with pytest.raises(error):
                        await client.abort_requests(["live", *extra], rank=rank)
                    assert client.live_requests == ["live"]
                    assert not stream.finished
                    assert not stream.aborted
                # Leaving the block aborts the request on the engine.
                await peer.wait_for(2)
            else:
                await client.add_request(request)
                await peer.wait_for(1)
                with pytest.raises(error):
                    await client.abort_requests(["live", *extra], rank=rank)
                assert client.live_requests == ["live"]
                assert client.in_flight == {0: 1}
                await client.abort_requests(["live"])
                await peer.wait_for(2)
        assert isinstance(peer.received[0], EngineCoreRequest)
        (abort,) = peer.received[1:]
        assert isinstance(abort, AbortRequests), peer.received
        assert abort.request_ids == ["live"]
        assert client.live_requests == []
        assert client.in_flight == {0: 0}


async def _start(client: EngineCoreClient, api: str, request: EngineCoreRequest) -> None:
    if api == "generate":
        async with client.generate(request):
            pytest.fail("generate must refuse the request")
    else:
        await client.add_request(request)


async def _consume(client: EngineCoreClient, request: EngineCoreRequest) -> None:
    async with client.generate(request) as stream:
        async for _ in stream:
            pass


def _hand_built(n: int) -> EngineCoreRequest:
    good = make_request([1, 2], max_tokens=4, request_id="n2", temperature=1.0)
    assert good.sampling_params is not None
    params = SamplingParams(n=n, max_tokens=4, temperature=1.0)
    return EngineCoreRequest(
        request_id="n2",
        prompt_token_ids=[1, 2],
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=good.arrival_time,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )


@pytest.mark.parametrize("api", ["generate", "add_request"])
async def test_item7_hand_built_n2_refused(api: str) -> None:
    async with peer_client() as (client, peer):
        request = _hand_built(2)
        with pytest.raises(ValueError, match="n must be 1"):
            await _start(client, api, request)
        with anyio.fail_after(30):
            assert await client.call_utility("echo", "sentinel") == ["sentinel"]
        assert len(peer.received) == 1
        assert isinstance(peer.received[0], UtilityCall)
        assert client.live_requests == []


VOCAB = 260  # the reference engine's byte-level vocabulary


def _oov(kind: str, request_id: str) -> EngineCoreRequest:
    if kind == "prompt":
        return make_request([1, VOCAB], max_tokens=2, request_id=request_id)
    if kind == "prompt-far":
        return make_request([10**9], max_tokens=2, request_id=request_id)
    sampling: dict[str, Any] = {
        "allowed_token_ids": {"allowed_token_ids": [1, VOCAB + 5]},
        "logit_bias": {"logit_bias": {VOCAB * 4: 1.0}},
        "stop_token_ids": {"stop_token_ids": [VOCAB]},
    }[kind]
    params = SamplingParams(max_tokens=2, temperature=0.0, **sampling)
    return make_request([1, 2], sampling_params=params, request_id=request_id)


KINDS = ["prompt", "prompt-far", "allowed_token_ids", "logit_bias", "stop_token_ids"]
ENGINE = ReferenceEngines(1, model="echo", faults=["--oov-fatal"])


@pytest.mark.parametrize("api", ["generate", "add_request"])
async def test_item8_out_of_vocabulary_refused_before_sending(api: str) -> None:
    """With ``vocab_size`` known, each out-of-vocabulary request is refused with a
    ValueError naming the field; the engine (which would die of it) stays alive and
    serves the next valid request."""
    async with open_client(ENGINE, vocab_size=VOCAB, ready_timeout=30) as client:
        for i, kind in enumerate(KINDS):
            request = _oov(kind, f"bad{i}")
            field = kind.split("-")[0]
            with pytest.raises(InvalidRequestError) as info:
                await _start(client, api, request)
            assert (info.value.field or "").startswith(field), (kind, info.value)
        assert client.live_requests == []
        with anyio.fail_after(30):
            async with client.generate(make_request([104, 105], max_tokens=4)) as stream:
                tokens = [t async for out in stream for t in out.new_token_ids]
        assert tokens == [104, 105, 104, 105]
        assert not client.dead


@pytest.mark.parametrize("kind", ["prompt", "allowed_token_ids", "logit_bias"])
async def test_item8_control_without_vocab_size_the_engine_dies(kind: str) -> None:
    """The control: without ``vocab_size`` the request goes out and the engine core
    dies of it (as stock vLLM's does), so the refusal above is what keeps it alive."""
    async with open_client(ENGINE, ready_timeout=30) as client:
        with anyio.fail_after(30), pytest.raises(EngineDeadError, match="ENGINE_CORE_DEAD"):
            await _consume(client, _oov(kind, "bad"))
        assert client.dead
