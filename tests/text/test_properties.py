"""Properties of the detokenizer and stop strings over generated text (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_vllm.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    RequestOutputKind,
    SamplingParams,
)
from trio_vllm.text import IncrementalDetokenizer, OutputProcessor, Tokenizer
from trio_vllm.text import _detokenizer as detok_mod

# Letters, CJK, emoji, accents and spaces: many characters split across byte-level tokens.
_ALPHABET = st.sampled_from(list("ab cdé你好世界😀🎉,.!\n"))
_TEXT = st.text(_ALPHABET, min_size=1, max_size=40)
_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.parametrize("slow", [False, True])
@_SETTINGS
@given(text=_TEXT, per_step=st.integers(1, 4))
def test_streamed_text_is_the_decoded_text(
    tiny: Tokenizer, monkeypatch: pytest.MonkeyPatch, slow: bool, text: str, per_step: int
) -> None:
    if slow:
        monkeypatch.setattr(detok_mod, "_decode_stream_class", lambda: None)
    prompt = tiny.encode("Q: ")
    ids = tiny.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer.for_request(tiny, prompt, SamplingParams())
    deltas = []
    for i in range(0, len(ids), per_step):
        d.update(ids[i : i + per_step], False)
        deltas.append(d.get_next_output_text(False, True))
    assert all("\ufffd" not in s for s in deltas)
    assert "".join(deltas) == d.output_text == text


@_SETTINGS
@given(
    text=_TEXT,
    start=st.integers(0, 39),
    length=st.integers(1, 4),
    include=st.booleans(),
    per_step=st.integers(1, 3),
)
def test_stop_string_cuts_at_its_first_occurrence(
    tiny: Tokenizer, text: str, start: int, length: int, include: bool, per_step: int
) -> None:
    stop = text[start : start + length]
    if not stop:
        return
    ids = tiny.encode(text, add_special_tokens=False)
    params = SamplingParams(
        max_tokens=1000,
        stop=[stop],
        include_stop_str_in_output=include,
        output_kind=RequestOutputKind.DELTA,
    )
    proc = OutputProcessor(tiny)
    proc.add_request(
        EngineCoreRequest(
            "r", prompt_token_ids=tiny.encode("Q: "), sampling_params=params, external_req_id="r"
        )
    )
    shown, finish, aborted = [], None, []
    for i in range(0, len(ids), per_step):
        res = proc.process_outputs([EngineCoreOutput("r", new_token_ids=ids[i : i + per_step])])
        aborted += res.reqs_to_abort
        for out in res.request_outputs:
            shown.append(out.outputs[0].text)
            finish = out.outputs[0].finish_reason
        if finish:
            break
    at = text.find(stop)
    expected = text[: at + len(stop)] if include else text[:at]
    assert finish == "stop"
    assert aborted == ["r"]
    assert "".join(shown) == expected
