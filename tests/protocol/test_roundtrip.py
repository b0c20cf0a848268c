"""Property: what one side encodes, the other decodes to an equal message (every release)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_vllm.protocol import (
    V0_25_1,
    V0_32_0,
    V0_33_0,
    ClientCodec,
    EngineCodec,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
    LoRARequest,
    PoolingParams,
    SamplingParams,
    UtilityOutput,
    UtilityResult,
)
from trio_vllm.protocol.structs import EngineCoreEvent, EngineCoreEventType

ROUNDTRIP = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
PROFILES = (V0_25_1, V0_32_0, V0_33_0)
token_ids = st.lists(st.integers(0, 200_000), min_size=1, max_size=50)
floats01 = st.floats(0.01, 1.0)

sampling = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 4096),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_p=floats01,
    top_k=st.integers(-1, 100),
    min_p=st.floats(0.0, 1.0),
    presence_penalty=st.floats(-2.0, 2.0),
    seed=st.none() | st.integers(0, 2**63 - 1),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=3),
    stop_token_ids=st.lists(st.integers(0, 1000), max_size=3),
    logprobs=st.none() | st.integers(0, 20),
    _eos_token_id=st.none() | st.integers(0, 1000),
    logit_bias=st.none() | st.dictionaries(st.integers(0, 1000), st.floats(-100, 100), max_size=3),
    extra_args=st.none() | st.dictionaries(st.text(max_size=5), st.integers(-10, 10), max_size=2),
)
pooling = st.builds(
    PoolingParams,
    task=st.sampled_from(["embed", "classify", "token_embed"]),
    dimensions=st.none() | st.integers(1, 64),
)
lora = st.none() | st.builds(
    LoRARequest,
    st.text(min_size=1, max_size=8),
    st.integers(1, 99),
    st.text(min_size=1, max_size=8),
)


@st.composite
def requests(draw: st.DrawFn) -> EngineCoreRequest:
    is_pooling = draw(st.booleans())
    return EngineCoreRequest(
        draw(st.text(min_size=1, max_size=12)),
        prompt_token_ids=draw(token_ids),
        sampling_params=None if is_pooling else draw(sampling),
        pooling_params=draw(pooling) if is_pooling else None,
        arrival_time=draw(st.floats(0, 2e9)),
        lora_request=draw(lora),
        cache_salt=draw(st.none() | st.text(max_size=5)),
        priority=draw(st.integers(-100, 100)),
        current_wave=draw(st.integers(0, 100)),
        trace_headers=draw(
            st.none() | st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2)
        ),
    )


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.vllm_version)
@ROUNDTRIP
@given(request=requests())
def test_request_roundtrip(profile: Any, request: EngineCoreRequest) -> None:
    frames = ClientCodec(profile).encode_add(request)
    back = EngineCodec(profile).decode_input(frames)
    assert back == request


@st.composite
def outputs(draw: st.DrawFn) -> EngineCoreOutputs:
    outs = []
    for i in range(draw(st.integers(0, 6))):
        n = draw(st.integers(0, 40))
        lp = None
        if n and draw(st.booleans()):
            k = draw(st.integers(1, 8))
            lp = LogprobsLists(
                np.arange(n * k, dtype=np.int32).reshape(n, k),
                np.linspace(-5, 0, n * k, dtype=np.float32).reshape(n, k),
                np.arange(n, dtype=np.int32),
                None,
            )
        finish = draw(st.none() | st.sampled_from(list(FinishReason)))
        events = draw(
            st.none()
            | st.lists(
                st.builds(
                    EngineCoreEvent, st.sampled_from(list(EngineCoreEventType)), st.floats(0, 1e6)
                ),
                max_size=2,
            )
        )
        outs.append(
            EngineCoreOutput(
                f"r{i}",
                list(range(n)),
                new_logprobs=lp,
                finish_reason=finish,
                stop_reason=draw(st.none() | st.integers(0, 9) | st.text(max_size=3)),
                events=events,
                num_nans_in_logits=draw(st.integers(0, 3)),
            )
        )
    utility = None
    if draw(st.booleans()):
        utility = UtilityOutput(
            draw(st.integers(0, 2**64 - 1)),
            None,
            UtilityResult(
                None, draw(st.none() | st.booleans() | st.lists(st.integers(), max_size=3))
            ),
        )
    return EngineCoreOutputs(
        engine_index=draw(st.integers(0, 7)),
        outputs=outs,
        timestamp=draw(st.floats(0, 1e6)),
        utility_output=utility,
        finished_requests=draw(st.none() | st.sets(st.text(max_size=4), max_size=3)),
        wave_complete=draw(st.none() | st.integers(0, 9)),
    )


def _same_outputs(a: EngineCoreOutputs, b: EngineCoreOutputs) -> None:
    assert (
        a.engine_index,
        a.timestamp,
        a.utility_output,
        a.finished_requests,
        a.wave_complete,
    ) == (b.engine_index, b.timestamp, b.utility_output, b.finished_requests, b.wave_complete)
    assert len(a.outputs) == len(b.outputs)
    for x, y in zip(a.outputs, b.outputs, strict=True):
        assert (
            x.request_id,
            x.new_token_ids,
            x.finish_reason,
            x.stop_reason,
            x.events,
            x.num_nans_in_logits,
        ) == (
            y.request_id,
            y.new_token_ids,
            y.finish_reason,
            y.stop_reason,
            y.events,
            y.num_nans_in_logits,
        )
        assert (x.new_logprobs is None) == (y.new_logprobs is None)
        if x.new_logprobs is not None and y.new_logprobs is not None:
            np.testing.assert_array_equal(x.new_logprobs.logprobs, y.new_logprobs.logprobs)
            np.testing.assert_array_equal(
                x.new_logprobs.logprob_token_ids, y.new_logprobs.logprob_token_ids
            )


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.vllm_version)
@ROUNDTRIP
@given(message=outputs())
def test_outputs_roundtrip(profile: Any, message: EngineCoreOutputs) -> None:
    frames = EngineCodec(profile).encode_outputs(message)
    back = ClientCodec(profile).decode_outputs(frames)
    assert isinstance(back, EngineCoreOutputs)
    _same_outputs(message, back)


def test_utility_arity_per_release() -> None:
    args = [True, None, None, None]
    ClientCodec(V0_32_0).encode_utility(0, 1, "profile", args, check_arity=True)
    with pytest.raises(ValueError, match=r"0\.\.2 positional arguments"):
        ClientCodec(V0_25_1).encode_utility(0, 1, "profile", args, check_arity=True)
    ClientCodec(V0_25_1).encode_utility(0, 1, "profile", args)  # unchecked by default
    ClientCodec(V0_25_1).encode_utility(0, 1, "my_custom_method", [1, 2, 3], check_arity=True)


junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=3),
    st.lists(st.integers(-5, 5), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


@st.composite
def junk_requests(draw: st.DrawFn) -> EngineCoreRequest:
    fields: dict[str, Any] = {}
    for name in (
        "prompt_token_ids",
        "cache_salt",
        "priority",
        "client_index",
        "current_wave",
        "data_parallel_rank",
        "arrival_time",
        "trace_headers",
        "resumable",
    ):
        if draw(st.booleans()):
            fields[name] = draw(junk)
    sp: dict[str, Any] = {}
    for name in (
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "n",
        "stop",
        "logprobs",
        "seed",
        "min_tokens",
        "logit_bias",
        "stop_token_ids",
    ):
        if draw(st.booleans()):
            sp[name] = draw(junk)
    try:
        params = SamplingParams(**sp)
    except Exception:  # normalization itself may reject junk; that is fine
        params = SamplingParams()
    fields.setdefault("prompt_token_ids", [1, 2])
    return EngineCoreRequest(draw(st.text(max_size=4)), sampling_params=params, **fields)


@ROUNDTRIP
@given(request=junk_requests())
def test_whatever_encodes_is_accepted_by_a_strict_decoder(request: EngineCoreRequest) -> None:
    try:
        frames = ClientCodec().encode_add(request)
    except ValueError:
        return  # refused before any byte: the promise
    back = EngineCodec().decode_input(frames)  # typed like the stock engine's decoder
    assert isinstance(back, EngineCoreRequest)
