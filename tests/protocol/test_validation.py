"""Requests that would wedge or kill a stock engine are refused before any byte is produced."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from trio_vllm.protocol import (
    ClientCodec,
    EngineCoreRequest,
    LoRARequest,
    PoolingParams,
    SamplingParams,
    StructuredOutputsParams,
    validate_request,
)
from trio_vllm.protocol.structs import RepetitionDetectionParams


def _gen(**sp: Any) -> EngineCoreRequest:
    sp.setdefault("max_tokens", 8)
    return EngineCoreRequest("r", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(**sp))


BAD_SAMPLING: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 2, "temperature": 0.0}, "greedy"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_tokens": 9}, "min_tokens"),
    ({"logprobs": -2}, "logprobs"),
    ({"prompt_logprobs": -5}, "prompt_logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["x"], "detokenize": False}, "detokenize"),
    ({"bad_words": [""]}, "bad_words"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stream_interval": 0}, "stream_interval"),
    ({"logprob_token_ids": list(range(129))}, "128"),
    ({"thinking_token_budget": -3}, "thinking_token_budget"),
    ({"logit_bias": {1: float("inf")}}, "logit_bias"),
    ({"extra_args": {"k": 1 << 70}}, "extra_args"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    (
        {
            "structured_outputs": StructuredOutputsParams(
                regex="a", _backend="xgrammar", grammar="g"
            )
        },
        "multiple are specified",
    ),
    ({"structured_outputs": StructuredOutputsParams(regex="a")}, "_backend"),
    ({"repetition_detection": RepetitionDetectionParams(4, 1, 1)}, "min_count"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_SAMPLING, ids=lambda x: str(x)[:40])
def test_bad_sampling_params_refused(kwargs: dict[str, Any], match: str) -> None:
    request = _gen(**kwargs)
    with pytest.raises(ValueError, match=match):
        validate_request(request)
    with pytest.raises(ValueError, match=match):
        ClientCodec().encode_add(request)


def test_good_requests_pass() -> None:
    validate_request(_gen(temperature=0.7, top_p=0.9, top_k=-1, logprobs=-1, stop=["\n"]))
    validate_request(
        _gen(structured_outputs=StructuredOutputsParams(json="{}", _backend="xgrammar"))
    )
    validate_request(
        EngineCoreRequest("p", prompt_token_ids=[1], pooling_params=PoolingParams(task="embed"))
    )


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        (EngineCoreRequest("r", prompt_token_ids=[1]), "exactly one"),
        (
            EngineCoreRequest(
                "r",
                prompt_token_ids=[1],
                sampling_params=SamplingParams(),
                pooling_params=PoolingParams(task="embed"),
            ),
            "exactly one",
        ),
        (
            EngineCoreRequest("", prompt_token_ids=[1], sampling_params=SamplingParams()),
            "request_id",
        ),
        (EngineCoreRequest("r", prompt_token_ids=[], sampling_params=SamplingParams()), "empty"),
        (EngineCoreRequest("r", sampling_params=SamplingParams()), "prompt"),
        (
            EngineCoreRequest("r", prompt_token_ids=[1, "x"], sampling_params=SamplingParams()),  # type: ignore[list-item]
            "prompt_token_ids",
        ),
        (EngineCoreRequest("r", prompt_token_ids=[1], pooling_params=PoolingParams()), "task"),
        (
            EngineCoreRequest("r", prompt_token_ids=[1], pooling_params=PoolingParams(task="gen")),
            "task",
        ),
        (
            EngineCoreRequest(
                "r",
                prompt_token_ids=[1],
                sampling_params=SamplingParams(),
                lora_request=LoRARequest("a", 0, "/p"),
            ),
            "lora_int_id",
        ),
        (
            EngineCoreRequest(
                "r",
                prompt_token_ids=[1],
                sampling_params=SamplingParams(),
                lora_request=LoRARequest("a", 1, ""),
            ),
            "lora_path",
        ),
        (
            EngineCoreRequest(
                "r", prompt_token_ids=[1], sampling_params=SamplingParams(), client_index=-1
            ),
            "client_index",
        ),
        (
            EngineCoreRequest(
                "r",
                prompt_token_ids=[1],
                sampling_params=SamplingParams(),
                prompt_is_token_ids=[True, False],
            ),
            "prompt_is_token_ids",
        ),
        (
            EngineCoreRequest(
                "r", sampling_params=SamplingParams(), prompt_embeds=np.zeros((0, 4), np.float32)
            ),
            "prompt_embeds",
        ),
        (
            EngineCoreRequest(
                "r", prompt_token_ids=[1], sampling_params=SamplingParams(), cache_salt=5
            ),
            "cache_salt",
        ),  # type: ignore[arg-type]
        (
            EngineCoreRequest(
                "r",
                prompt_token_ids=[1],
                sampling_params=SamplingParams(),
                arrival_time=float("inf"),
            ),
            "arrival_time",
        ),
        (
            EngineCoreRequest(
                "r", prompt_token_ids=[1], sampling_params=SamplingParams(), mm_features=[{}]
            ),
            "mm_features",
        ),
    ],
)
def test_bad_requests_refused(request_: EngineCoreRequest, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ClientCodec().encode_add(request_)


def test_engine_limits() -> None:
    req = _gen(logprobs=30)
    validate_request(req)
    with pytest.raises(ValueError, match="greater than max allowed: 20"):
        validate_request(req, max_logprobs=20)
    with pytest.raises(ValueError, match="maximum model length of 3"):
        validate_request(_gen(), max_model_len=3)  # generation needs len < max_model_len
    pooled = EngineCoreRequest(
        "p", prompt_token_ids=[1, 2, 3], pooling_params=PoolingParams(task="embed")
    )
    validate_request(pooled, max_model_len=3)  # pooling allows len == max_model_len
    with pytest.raises(ValueError, match="supported"):
        validate_request(pooled, supported_tasks={"classify"})
    with pytest.raises(ValueError, match="vocabulary"):
        validate_request(_gen(), vocab_size=3)
    with pytest.raises(ValueError, match="output addresses"):
        validate_request(
            EngineCoreRequest(
                "r", prompt_token_ids=[1], sampling_params=SamplingParams(), client_index=1
            ),
            num_clients=1,
        )
    lora = EngineCoreRequest(
        "r",
        prompt_token_ids=[1],
        sampling_params=SamplingParams(),
        lora_request=LoRARequest("a", 1, "/p"),
    )
    with pytest.raises(ValueError, match="LoRA"):
        validate_request(lora, supports_lora=False)


def test_normalization_matches_vllm() -> None:
    sp = SamplingParams(stop="x", seed=-1, stop_token_ids=[5], temperature=0.001, prompt_logprobs=2)
    assert sp.stop == ["x"]
    assert sp.seed is None
    assert sp._all_stop_token_ids == {5}
    assert sp.temperature == 0.01
    assert sp.skip_reading_prefix_cache is True
    assert sp.output_text_buffer_length == 0
    greedy = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
