"""Pooling requests (issue 22): the frontend duties and rules sans-I/O, then the raw
client's ``encode``, ``LLM.encode`` / ``LLM.embed`` and their blocking twins against a
reference engine in pooling mode (``--supported-tasks embed,token_embed``, the tasks
``vllm serve --runner pooling --convert embed`` reports)."""

from __future__ import annotations

import numpy as np
import pytest

import trio_vllm as tv
from trio_vllm.llm import open_llm
from trio_vllm.protocol import FinishReason, PoolingParams
from trio_vllm.protocol import rules as R
from trio_vllm.text import EmbeddingRequestOutput, pooling_model_of, prepare_pooling

POOLING_ENGINE = {"model": "echo", "extra_args": ["--supported-tasks", "embed,token_embed"]}
HIDDEN = 64  # the reference engine's hidden size


def one_hot(token: int) -> np.ndarray:
    """The echo model's hidden state of a token: last-token pooling gives this."""
    vec = np.zeros(HIDDEN, dtype=np.float32)
    vec[token % HIDDEN] = 1.0
    return vec


# ------------------------------------------------------------------------ sans-I/O


def test_make_pooling_request_does_vllms_frontend_duties() -> None:
    req = tv.make_pooling_request([1, 2, 3])
    pp = req.pooling_params
    assert req.sampling_params is None
    assert pp is not None
    # vLLM's PoolingParams.verify: activation (normalisation) on, prefix cache read.
    assert (pp.task, pp.use_activation, pp.skip_reading_prefix_cache) == ("embed", True, False)
    tok = tv.make_pooling_request([1], task="token_embed", use_activation=False).pooling_params
    assert tok is not None
    assert (tok.task, tok.use_activation, tok.skip_reading_prefix_cache) == (
        "token_embed",
        False,
        True,
    )
    # A pooling prompt may fill the context (nothing is generated); one more may not.
    tv.make_pooling_request([5] * 256, max_model_len=256)
    with pytest.raises(tv.InvalidRequestError, match="maximum context length is 256"):
        tv.make_pooling_request([5] * 257, max_model_len=256)
    with pytest.raises(tv.InvalidRequestError, match="task must be one of"):
        tv.make_pooling_request([1], task="score")  # removed in 0.32 (use classify)
    with pytest.raises(tv.InvalidRequestError, match="does not support \\['dimensions'\\]"):
        tv.make_pooling_request([1], task="classify", dimensions=4)


def test_matryoshka_rule_reads_the_model_config() -> None:
    plain = pooling_model_of("m", {"hidden_size": 128})
    assert plain == R.PoolingModel("m", 128, False, None)
    limits = R.Limits(pooling_model=plain, supported_tasks=frozenset({"embed"}))
    with pytest.raises(tv.InvalidRequestError) as info:
        prepare_pooling(PoolingParams(dimensions=8), "embed", limits)
    assert str(info.value) == (
        "Model 'm' does not support Matryoshka embeddings; dimensions must be unset "
        "(received dimensions=8)."
    )
    mrl = pooling_model_of("m", {"hidden_size": 128, "matryoshka_dimensions": [32, 64]})
    limits = R.Limits(pooling_model=mrl, supported_tasks=frozenset({"embed"}))
    assert prepare_pooling(PoolingParams(dimensions=32), "embed", limits).dimensions == 32
    with pytest.raises(tv.InvalidRequestError, match=r"Matryoshka dimensions \[32, 64\], got 8"):
        prepare_pooling(PoolingParams(dimensions=8), "embed", limits)
    with pytest.raises(tv.InvalidRequestError, match=r"range \[1, 128\], got 200"):
        prepare_pooling(PoolingParams(dimensions=200), "embed", limits)
    with pytest.raises(tv.InvalidRequestError, match="Unsupported task: 'classify'"):
        prepare_pooling(None, "classify", limits)


def test_embedding_output_from_base() -> None:
    from trio_vllm.text import PoolingOutput, PoolingRequestOutput

    base = PoolingRequestOutput("r", PoolingOutput(np.arange(3, dtype=np.float32)), [1], 0, True)
    out = EmbeddingRequestOutput.from_base(base)
    assert out.outputs.embedding == [0.0, 1.0, 2.0]
    assert out.outputs.hidden_size == 3
    base.outputs.data = np.zeros((2, 3), dtype=np.float32)
    with pytest.raises(tv.InvalidRequestError, match="1-D embedding vector"):
        EmbeddingRequestOutput.from_base(base)


# ------------------------------------------------------------------ against an engine


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_encode_and_embed_on_a_pooling_engine() -> None:
    async with tv.open_client(tv.ReferenceEngines(1, **POOLING_ENGINE)) as client:
        out = await client.encode(tv.make_pooling_request([1, 5, 7, 9]))
        assert out.finish_reason == FinishReason.STOP
        vec = np.asarray(out.pooling_output)
        assert np.array_equal(vec, one_hot(9))
        again = np.asarray(
            (await client.encode(tv.make_pooling_request([1, 5, 7, 9]))).pooling_output
        )
        assert np.array_equal(vec, again)  # deterministic
        rows = await client.encode(tv.make_pooling_request([1, 5, 7], task="token_embed"))
        assert np.asarray(rows.pooling_output).shape == (3, HIDDEN)
        # The engine's tasks were asked once; a task it lacks is refused, not sent.
        with pytest.raises(tv.InvalidRequestError, match="Unsupported task: 'classify'"):
            await client.encode(tv.make_pooling_request([1], task="classify"))
        with pytest.raises(tv.InvalidRequestError, match="pooling_params set"):
            await client.encode(tv.make_request([1, 2]))
        assert client.live_requests == []
        assert not client.dead

    async with open_llm(tv.ReferenceEngines(1, **POOLING_ENGINE)) as llm:
        assert await llm.supported_tasks() == ("embed", "token_embed")
        outs = await llm.embed(["hello", [1, 5, 7, 9], {"prompt": "hi"}])
        assert [o.prompt_token_ids for o in outs] == [list(b"hello"), [1, 5, 7, 9], list(b"hi")]
        assert np.allclose(outs[1].outputs.embedding, vec, atol=1e-6)  # same as the raw path
        assert all(len(o.outputs.embedding) == HIDDEN and o.finished for o in outs)
        assert np.array_equal(outs[0].outputs.embedding, one_hot(ord("o")))
        [tokens] = await llm.encode("abc", pooling_task="token_embed")
        assert tokens.outputs.data.shape == (3, HIDDEN)
        with pytest.raises(tv.InvalidRequestError, match="Classification API is not supported"):
            await llm.encode("x", pooling_task="classify")
        with pytest.raises(tv.InvalidRequestError, match="maximum context length"):
            await llm.embed(["fine", [5] * 5000])  # nothing sent: the second is too long
        with pytest.raises(tv.InvalidRequestError, match="pooling_task required"):
            await llm.encode("x")
        assert llm.client.live_requests == []


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_embed_on_a_generate_only_engine_is_refused() -> None:
    engines = tv.ReferenceEngines(1, model="echo", extra_args=["--supported-tasks", "generate"])
    async with open_llm(engines) as llm:
        # vLLM's LLM checks its runner first: a generate model is no pooling model
        with pytest.raises(tv.InvalidRequestError, match="only supported for pooling models"):
            await llm.embed("hello")
        with pytest.raises(tv.InvalidRequestError, match="only supported for pooling models"):
            await llm.encode("hello")  # even without a pooling_task
        assert llm.client.live_requests == []
        assert not llm.dead


@pytest.mark.timeout(120)
def test_sync_embed_and_encode() -> None:
    """The blocking twins, on the seeded transformer (``tiny``): unit vectors unless
    ``use_activation=False``; the raw client gives the same numbers."""
    engines = tv.ReferenceEngines(1, model="tiny", extra_args=["--supported-tasks", "embed"])
    with tv.SyncLLM(engines) as llm:
        [a, b, c] = llm.embed(["same", "same", "other"])
        assert a.outputs.embedding == b.outputs.embedding
        assert a.request_id != b.request_id
        assert not np.allclose(a.outputs.embedding, c.outputs.embedding)
        assert abs(float(np.linalg.norm(a.outputs.embedding)) - 1.0) < 1e-5
        [raw] = llm.encode("same", PoolingParams(use_activation=False), pooling_task="embed")
        norm = float(np.linalg.norm(raw.outputs.data))
        assert abs(norm - 1.0) > 1e-3  # not normalised by the engine
        assert np.allclose(raw.outputs.data / norm, a.outputs.embedding, atol=1e-5)
    with tv.SyncClient(tv.ReferenceEngines(1, **POOLING_ENGINE)) as client:
        out = client.encode(tv.make_pooling_request(list(b"same")))
        assert np.array_equal(np.asarray(out.pooling_output), one_hot(ord("e")))
