"""Issue 16 item 8 against stock vLLM 0.32.0: out-of-vocabulary ids never reach the engine.

A live run found that a prompt id at or above the vocabulary size, and out-of-vocabulary
ids in ``allowed_token_ids`` and in ``logit_bias``, each kill a stock engine core (vLLM's
own frontend refuses them when it has a tokenizer; the engine core does not). With
``open_client(vocab_size=...)`` the client refuses them before sending: the engine stays
alive and serves the next request. The control test shows the premise on this build:
without ``vocab_size`` the same prompt kills the engine core.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest

from trio_vllm import EngineDeadError, InvalidRequestError, SamplingParams
from trio_vllm.client import VllmEngines, make_request
from trio_vllm.sync import SyncClient

from .conftest import ENGINE_ARGS, ENGINE_ENV, EXPECTED_GREEDY, TINY_MODEL, vllm_python

if TYPE_CHECKING:
    from collections.abc import Iterator

    from trio_vllm import EngineCoreRequest

pytestmark = pytest.mark.timeout(600)


def _vocab_size() -> int:
    return int(json.loads((TINY_MODEL / "config.json").read_text())["vocab_size"])


def _engines() -> VllmEngines:
    return VllmEngines(
        str(TINY_MODEL), python=vllm_python(), extra_args=ENGINE_ARGS, env=ENGINE_ENV
    )


def _oov(kind: str, vocab: int) -> EngineCoreRequest:
    if kind == "prompt":
        return make_request([1, 5, vocab], max_tokens=4)
    sampling: dict[str, Any] = {
        "allowed_token_ids": {"allowed_token_ids": [5, vocab + 3]},
        "logit_bias": {"logit_bias": {vocab: 5.0}},
    }[kind]
    return make_request(
        [1, 5, 7, 9], sampling_params=SamplingParams(max_tokens=4, temperature=0.0, **sampling)
    )


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def client(request: pytest.FixtureRequest) -> Iterator[SyncClient]:
    with SyncClient(
        _engines(), backend=request.param, ready_timeout=500, vocab_size=_vocab_size()
    ) as sync_client:
        yield sync_client


@pytest.mark.parametrize("kind", ["prompt", "allowed_token_ids", "logit_bias"])
def test_out_of_vocabulary_refused_and_engine_alive(client: SyncClient, kind: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        client.add_request(_oov(kind, _vocab_size()))
    assert (info.value.field or "").startswith(kind), info.value
    assert client.live_requests == []
    # The engine is alive: greedy tokens as vLLM's own frontend gives them.
    tokens = client.generate(make_request([1, 5, 7, 9], max_tokens=8)).collect()
    assert tokens == EXPECTED_GREEDY
    assert not client.dead


def test_control_without_vocab_size_the_engine_core_dies() -> None:
    """The premise, on this vLLM build: an out-of-vocabulary prompt id kills the core."""
    with SyncClient(_engines(), ready_timeout=500) as control:
        with pytest.raises(EngineDeadError):
            control.generate(_oov("prompt", _vocab_size())).collect()
        assert control.dead
