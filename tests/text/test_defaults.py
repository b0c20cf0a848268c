"""Sampling defaults from a generation config: vLLM 0.32.0's ``--generation-config`` rules.

``get_diff_sampling_param`` (which keys, ``max_new_tokens`` -> ``max_tokens``, the
override), ``override_max_tokens`` (a directory caps every request), the OpenAI layer's
"request, else server default, else OpenAI default" and ``get_max_tokens``, and
``LLM.get_default_sampling_params``. No sockets, no engine.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

from trio_vllm import RequestOutputKind, SamplingParams
from trio_vllm.text import OPENAI_SAMPLING_DEFAULTS, InputProcessor, ModelFiles, SamplingDefaults

from .conftest import metaspace_tokenizer, write_model_dir

if TYPE_CHECKING:
    from pathlib import Path

    from trio_vllm.text import Tokenizer

FULL = {
    "bos_token_id": 1, "eos_token_id": [2], "do_sample": True, "num_beams": 1,
    "repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.3,
    "temperature": 0.6, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "max_new_tokens": 30,
}  # fmt: skip


def test_every_sampling_key_is_taken_and_max_new_tokens_renamed() -> None:
    d = SamplingDefaults.from_generation_config(FULL)
    assert dict(d) == {
        "repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.3,
        "temperature": 0.6, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "max_tokens": 30,
    }  # fmt: skip
    # auto: max_new_tokens is a default, not a cap
    assert (d.source, d.max_tokens_cap) == ("auto", None)


def test_values_equal_to_vllms_defaults_are_still_defaults() -> None:
    # transformers 5's GenerationConfig has no non-None default for these keys, so
    # to_diff_dict keeps a temperature of 1.0 too; None means unset.
    d = SamplingDefaults.from_generation_config(
        {"temperature": 1.0, "top_k": 50, "top_p": None, "eos_token_id": 2}
    )
    assert dict(d) == {"temperature": 1.0, "top_k": 50}


def test_vllm_source_ignores_the_file_but_not_the_override() -> None:
    assert dict(SamplingDefaults.from_generation_config(FULL, source="vllm")) == {}
    d = SamplingDefaults.from_generation_config(
        FULL, source="vllm", override={"top_p": 0.5, "max_new_tokens": 9}
    )
    assert dict(d) == {"top_p": 0.5, "max_tokens": 9}
    assert d.max_tokens_cap == 9  # the override's max_new_tokens caps every request


def test_override_updates_the_file() -> None:
    d = SamplingDefaults.from_generation_config(
        {"temperature": 0.7, "top_k": 5}, override={"temperature": 0.2, "min_p": 0.1}
    )
    assert dict(d) == {"temperature": 0.2, "top_k": 5, "min_p": 0.1}
    assert d.max_tokens_cap is None


def test_a_directory_source_caps_max_tokens() -> None:
    d = SamplingDefaults.from_generation_config({"max_new_tokens": 12}, source="/some/dir")
    assert (d["max_tokens"], d.max_tokens_cap) == (12, 12)
    assert SamplingDefaults.from_generation_config({}, source="/d").max_tokens_cap is None


@pytest.mark.parametrize(
    "config",
    [{"temperature": "0.5"}, {"top_k": True}, {"top_k": 1.5}, {"max_new_tokens": [3]}],
)
def test_a_value_that_is_not_a_number_is_refused(config: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="generation config: "):
        SamplingDefaults.from_generation_config(config)


def test_integral_floats_become_ints() -> None:
    d = SamplingDefaults.from_generation_config({"top_k": 3.0, "max_new_tokens": 8.0})
    assert d["top_k"] == 3
    assert isinstance(d["top_k"], int)
    assert d["max_tokens"] == 8
    assert isinstance(d["max_tokens"], int)


def test_request_value_then_server_default_then_openai_default() -> None:
    d = SamplingDefaults({"temperature": 0.0, "top_k": 3})
    assert d.value("temperature", 0.8) == 0.8
    assert d.value("temperature", None) == 0.0
    assert d.value("top_k", None) == 3
    assert d.value("top_p", None) == OPENAI_SAMPLING_DEFAULTS["top_p"] == 1.0
    assert d.value("repetition_penalty", None) == 1.0
    # 0 is a value, not "unset"
    assert SamplingDefaults({"top_k": 3}).value("top_k", 0) == 0


def test_get_max_tokens() -> None:
    none = SamplingDefaults()
    assert none.max_tokens(None, 100) == 100  # the room the prompt leaves
    assert none.max_tokens(7, 100) == 7
    assert none.max_tokens(700, 100) == 100
    default = SamplingDefaults({"max_tokens": 20})
    assert default.max_tokens(None, 100) == 20
    assert default.max_tokens(50, 100) == 50  # a request may ask for more than the default
    assert default.max_tokens(None, 10) == 10
    capped = SamplingDefaults({"max_tokens": 20}, max_tokens_cap=20, source="/d")
    assert capped.max_tokens(50, 100) == 20  # ... but not more than a cap
    assert capped.max_tokens(5, 100) == 5


def test_default_sampling_params_as_llm_get_default_sampling_params() -> None:
    assert SamplingDefaults().sampling_params() == SamplingParams()
    p = SamplingDefaults({"temperature": 0.5, "top_k": 2}).sampling_params()
    assert (p.temperature, p.top_k, p.max_tokens) == (0.5, 2, 16)  # max_tokens stays 16
    # greedy resets top_k, as vLLM's SamplingParams.__post_init__ does
    assert SamplingDefaults({"temperature": 0.0, "top_k": 2}).sampling_params().top_k == 0
    q = SamplingDefaults({"max_tokens": 5}).sampling_params(
        output_kind=RequestOutputKind.FINAL_ONLY
    )
    assert (q.max_tokens, q.output_kind) == (5, RequestOutputKind.FINAL_ONLY)


def test_model_files_generation_config_sources(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path / "m", metaspace_tokenizer(), generation_config={
        "eos_token_id": [2], "temperature": 0.6, "max_new_tokens": 30,
    })  # fmt: skip
    auto = ModelFiles(model).sampling_defaults()
    assert (dict(auto), auto.max_tokens_cap) == ({"temperature": 0.6, "max_tokens": 30}, None)
    plain = ModelFiles(model, generation_config="vllm")
    assert dict(plain.sampling_defaults()) == {}
    assert plain.eos_token_ids == [2]  # the model's EOS ids still count
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [3, 4], "top_k": 1, "max_new_tokens": 6})
    )
    from_dir = ModelFiles(model, generation_config=other)
    d = from_dir.sampling_defaults()
    assert (dict(d), d.max_tokens_cap, d.source) == ({"top_k": 1, "max_tokens": 6}, 6, str(other))
    assert from_dir.eos_token_ids == [3, 4]  # vLLM takes the EOS ids from there too
    overridden = ModelFiles(model, override_generation_config={"temperature": 0.1})
    assert dict(overridden.sampling_defaults()) == {"temperature": 0.1, "max_tokens": 30}
    with pytest.raises(FileNotFoundError, match="generation config directory"):
        ModelFiles(model, generation_config=tmp_path / "missing")
    with pytest.raises(ValueError, match="temperature must be a number"):
        ModelFiles(model, override_generation_config={"temperature": "hot"})


def test_input_processor_uses_the_defaults_only_without_params(tiny: Tokenizer) -> None:
    d = SamplingDefaults({"temperature": 0.3, "max_tokens": 4, "top_k": 2})
    inp = InputProcessor(tiny, max_model_len=64, sampling_defaults=d)
    assert inp.sampling_defaults is d
    p = inp.process_inputs("r", [5]).sampling_params
    assert (p.temperature, p.max_tokens, p.top_k) == (0.3, 4, 2)
    # vLLM's LLM: given params are used as they are, defaults are not merged in
    q = inp.process_inputs("s", [5], SamplingParams(temperature=0.5)).sampling_params
    assert (q.temperature, q.max_tokens, q.top_k) == (0.5, 16, 0)
