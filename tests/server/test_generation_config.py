"""Sampling defaults from ``generation_config.json`` (vLLM's ``--generation-config``).

The planning rules without sockets (``plan_completion``/``plan_chat`` over a stand-in
frontend), then the served API on the reference engine with a model directory whose
generation config carries sampling values.
"""

from __future__ import annotations

import json
import shutil
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
import pytest

import trio_vllm as tv
from trio_vllm.llm import open_llm
from trio_vllm.reference_engine import MODEL_DIR
from trio_vllm.server._http import HTTPError
from trio_vllm.server._openai import plan_chat, plan_completion
from trio_vllm.server._schemas import ChatCompletionRequest, CompletionRequest
from trio_vllm.text import InputProcessor, ModelFiles, SamplingDefaults

from ._util import serving

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from pathlib import Path

    from trio_vllm.protocol import SamplingParams
    from trio_vllm.text import ChatMessage

_FILES = ModelFiles(MODEL_DIR)
_TOKENIZER = _FILES.load_tokenizer()


class _Frontend:
    """What plan_completion/plan_chat read of the text frontend."""

    def __init__(self, defaults: SamplingDefaults, max_model_len: int = 100) -> None:
        self.tokenizer = _TOKENIZER
        self.max_model_len = max_model_len
        self.sampling_defaults = defaults
        self._inputs = InputProcessor(_TOKENIZER, max_model_len=max_model_len)

    def render_chat(self, messages: Sequence[ChatMessage], **options: Any) -> tuple[str, list[int]]:
        return self._inputs.render_chat(messages, **options)


def _completion(defaults: SamplingDefaults, **body: Any) -> SamplingParams:
    req = msgspec.convert({"prompt": "abcd", **body}, CompletionRequest)
    plan = plan_completion(
        req,
        _Frontend(defaults),
        model="m",
        header_request_id=None,
        extra={},  # type: ignore[arg-type]
    )
    (params,) = plan.params
    return params


def _chat(defaults: SamplingDefaults, **body: Any) -> SamplingParams:
    req = msgspec.convert(
        {"messages": [{"role": "user", "content": "hi"}], **body}, ChatCompletionRequest
    )
    plan = plan_chat(
        req,
        _Frontend(defaults),
        model="m",
        header_request_id=None,
        extra={},  # type: ignore[arg-type]
    )
    (params,) = plan.params
    return params


DEFAULTS = SamplingDefaults(
    {"temperature": 0.6, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.2,
     "presence_penalty": 0.1, "frequency_penalty": 0.2, "max_tokens": 9},
    source="auto",
)  # fmt: skip


@pytest.mark.parametrize("plan", [_completion, _chat])
def test_unset_fields_take_the_models_defaults(plan: Any) -> None:
    p = plan(DEFAULTS)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.6, 0.9, 7, 0.05)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.2, 0.1, 0.2)


@pytest.mark.parametrize("plan", [_completion, _chat])
def test_request_fields_win(plan: Any) -> None:
    p = plan(DEFAULTS, temperature=0.3, top_p=0.5, top_k=2, min_p=0.0, repetition_penalty=1.0,
             presence_penalty=0.0, frequency_penalty=-0.5)  # fmt: skip
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.3, 0.5, 2, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, -0.5)


@pytest.mark.parametrize("plan", [_completion, _chat])
def test_without_defaults_the_openai_defaults(plan: Any) -> None:
    p = plan(SamplingDefaults())
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)


def test_max_tokens_default() -> None:
    # chat: no max_tokens means the model's default, else the room (100 - 11 prompt tokens)
    assert _chat(DEFAULTS).max_tokens == 9
    assert _chat(DEFAULTS, max_tokens=30).max_tokens == 30
    assert _chat(DEFAULTS, max_completion_tokens=31).max_tokens == 31
    room = 100 - len(_Frontend(DEFAULTS).render_chat([{"role": "user", "content": "hi"}])[1])
    assert _chat(SamplingDefaults()).max_tokens == room
    # completions: vLLM's CompletionRequest.max_tokens defaults to 16, an explicit null
    # too (normalize_null_max_tokens), so the model's default never applies there
    assert _completion(DEFAULTS).max_tokens == 16
    assert _completion(DEFAULTS, max_tokens=None).max_tokens == 16
    assert _completion(SamplingDefaults(), max_tokens=None).max_tokens == 16
    assert _completion(DEFAULTS, max_tokens=40).max_tokens == 40


def test_a_generation_config_directory_caps_max_tokens() -> None:
    capped = SamplingDefaults.from_generation_config({"max_new_tokens": 5}, source="/dir")
    assert _chat(capped).max_tokens == 5
    assert _chat(capped, max_tokens=50).max_tokens == 5
    assert _chat(capped, max_tokens=3).max_tokens == 3
    assert _completion(capped).max_tokens == 5  # 16 capped
    # the request's own bound still applies first
    with pytest.raises(HTTPError, match="cannot be greater than max_model_len"):
        _chat(capped, max_tokens=500)


# ----------------------------------------------------------------------------- served


def _model_with(tmp_path: Path, sampling: Mapping[str, object]) -> Path:
    model = tmp_path / "model"
    shutil.copytree(MODEL_DIR, model)
    path = model / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **sampling}))
    return model


@pytest.mark.anyio
async def test_served_defaults_from_generation_config(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _model_with(tmp_path, {"temperature": 0.0, "max_new_tokens": 3})
    engines = tv.ReferenceEngines(1, model="echo")
    async with open_llm(engines, model=model) as llm, serving(llm) as served:
        assert dict(llm.sampling_defaults) == {"temperature": 0.0, "max_tokens": 3}
        assert "Default sampling parameters are overridden" in caplog.text
        messages = [{"role": "user", "content": "hi"}]
        text, _ = llm.render_chat(messages)
        async with httpx.AsyncClient(base_url=served.base_url, timeout=60) as http:
            r = await http.post("/v1/chat/completions", json={"messages": messages})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["completion_tokens"] == 3  # max_new_tokens
            assert body["choices"][0]["message"]["content"] == text[:3]
            assert body["choices"][0]["finish_reason"] == "length"
            # temperature 0 from the file: n=2 is greedy, which vLLM refuses
            r = await http.post("/v1/chat/completions", json={"messages": messages, "n": 2})
            assert r.status_code == 400, r.text
            assert "greedy" in r.json()["error"]["message"]
            r = await http.post(
                "/v1/chat/completions", json={"messages": messages, "n": 2, "temperature": 0.5}
            )
            assert r.status_code == 200, r.text
            assert [c["message"]["content"] for c in r.json()["choices"]] == [text[:3]] * 2
            # completions keep their own max_tokens default of 16
            r = await http.post("/v1/completions", json={"prompt": "a" * 20})
            assert r.json()["usage"]["completion_tokens"] == 16


@pytest.mark.anyio
async def test_served_generation_config_vllm_ignores_the_file(tmp_path: Path) -> None:
    model = _model_with(tmp_path, {"temperature": 0.0, "max_new_tokens": 3})
    engines = tv.ReferenceEngines(1, model="echo")
    async with (
        open_llm(engines, model=model, generation_config="vllm") as llm,
        serving(llm) as served,
    ):
        assert dict(llm.sampling_defaults) == {}
        async with httpx.AsyncClient(base_url=served.base_url, timeout=60) as http:
            r = await http.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 4},
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 8
