"""The LLM API's sampling defaults (vLLM's ``LLM.get_default_sampling_params``): a call
without params uses the model's generation config; given params are used as they are."""

from __future__ import annotations

import json
import shutil
from typing import TYPE_CHECKING

import pytest

import trio_vllm as tv
from trio_vllm.llm import LLM, open_llm
from trio_vllm.protocol import RequestOutputKind
from trio_vllm.reference_engine import MODEL_DIR

if TYPE_CHECKING:
    from pathlib import Path

    from trio_vllm.testing import ReferenceEngineSet

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def _model_with(tmp_path: Path, sampling: dict[str, object]) -> Path:
    model = tmp_path / "model"
    shutil.copytree(MODEL_DIR, model)
    path = model / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **sampling}))
    return model


async def test_calls_without_params_use_the_generation_config(tmp_path: Path) -> None:
    model = _model_with(tmp_path, {"temperature": 0.5, "top_k": 4, "max_new_tokens": 5})
    async with open_llm(tv.ReferenceEngines(model="echo"), model=model) as llm:
        p = llm.get_default_sampling_params()
        assert (p.temperature, p.top_k, p.max_tokens) == (0.5, 4, 5)
        assert llm.get_default_sampling_params() is not p  # a fresh object each call
        out = await llm.generate_final("hello world")
        assert out.outputs[0].text == "hello"  # max_new_tokens=5
        async with llm.generate("hello world") as stream:
            last = await stream.collect()
        assert last is not None
        assert len(last.outputs[0].token_ids) == 5
        chat = await llm.chat_final([{"role": "user", "content": "hi"}])
        assert len(chat.outputs[0].token_ids) == 5
        given = await llm.generate_final("hello world", tv.SamplingParams(max_tokens=8))
        assert given.outputs[0].text == "hello wo"  # given params are not merged


async def test_generation_config_vllm_and_override(tmp_path: Path) -> None:
    model = _model_with(tmp_path, {"max_new_tokens": 5})
    engines = tv.ReferenceEngines(model="echo")
    async with open_llm(engines, model=model, generation_config="vllm") as llm:
        assert dict(llm.sampling_defaults) == {}
        # vLLM's SamplingParams default of 16 tokens
        assert (await llm.generate_final("hello world")).outputs[0].text == "hello worldhello"
    async with open_llm(
        engines, model=model, override_generation_config={"max_new_tokens": 2}
    ) as llm:
        assert (await llm.generate_final("hello world")).outputs[0].text == "he"


@pytest.mark.reference_engines(model="echo")
async def test_llm_built_over_a_client(
    reference_engines: ReferenceEngineSet, tmp_path: Path
) -> None:
    model = _model_with(tmp_path, {"max_new_tokens": 3})
    llm = LLM(reference_engines.client, model=model)
    assert llm.get_default_sampling_params().max_tokens == 3
    plain = LLM(reference_engines.client, model=model, generation_config="vllm")
    assert plain.get_default_sampling_params().max_tokens == 16
    out = await llm.generate_final("abcdef")
    assert out.outputs[0].text == "abc"
    assert llm.get_default_sampling_params().output_kind != RequestOutputKind.FINAL_ONLY


def test_sync_llm_uses_the_generation_config(tmp_path: Path) -> None:
    model = _model_with(tmp_path, {"max_new_tokens": 5})
    with tv.SyncLLM(tv.ReferenceEngines(model="echo"), model=model) as llm:
        assert llm.generate_final("hello world").outputs[0].text == "hello"
        chat = llm.chat_final([{"role": "user", "content": "hi"}])
        assert len(chat.outputs[0].token_ids) == 5
    engines = tv.ReferenceEngines(model="echo")
    with tv.SyncLLM(engines, model=model, override_generation_config={"max_new_tokens": 2}) as llm:
        assert llm.generate_final("hello world").outputs[0].text == "he"
    with tv.SyncLLM(engines, model=model, generation_config="vllm") as llm:
        assert llm.generate_final("hello world").outputs[0].text == "hello worldhello"
