"""Incremental detokenization and stop strings (vLLM's detokenizer.py rules)."""

from __future__ import annotations

from typing import Any

import pytest

from trio_vllm.protocol import SamplingParams
from trio_vllm.text import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    SlowIncrementalDetokenizer,
    Tokenizer,
    check_stop_strings,
)
from trio_vllm.text import _detokenizer as detok_mod

TEXT = "Hello world! 你好，世界 😀🎉 naïve café"


@pytest.fixture(params=["fast", "slow"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "slow":
        monkeypatch.setattr(detok_mod, "_decode_stream_class", lambda: None)
    return str(request.param)


def _detok(tok: Tokenizer, **params: Any) -> IncrementalDetokenizer:
    return IncrementalDetokenizer.for_request(tok, tok.encode("Say: "), SamplingParams(**params))


def test_picks_the_path(tiny: Tokenizer, path: str) -> None:
    d = _detok(tiny)
    expected = FastIncrementalDetokenizer if path == "fast" else SlowIncrementalDetokenizer
    assert type(d) is expected
    assert type(_detok(tiny, detokenize=False)) is IncrementalDetokenizer
    assert type(IncrementalDetokenizer.for_request(None, [1], SamplingParams())) is (
        IncrementalDetokenizer
    )


def test_utf8_split_across_tokens_never_shows_half_characters(tiny: Tokenizer, path: str) -> None:
    ids = tiny.encode(TEXT, add_special_tokens=False)
    d = _detok(tiny)
    deltas = []
    for token_id in ids:
        assert d.update([token_id], False) is None
        deltas.append(d.get_next_output_text(False, True))
    assert all("\ufffd" not in s for s in deltas)
    assert "".join(deltas) == TEXT
    assert d.output_text == TEXT
    assert d.output_token_ids == ids
    # Some tokens are only part of a character: they add no text on their own.
    assert "" in deltas


def test_prompt_priming_keeps_the_leading_space(tiny: Tokenizer, path: str) -> None:
    # The first generated token " world" follows the prompt: its space is kept.
    prompt = tiny.encode("Hello")
    d = IncrementalDetokenizer.for_request(tiny, prompt, SamplingParams())
    d.update(tiny.encode(" world", add_special_tokens=False), False)
    assert d.output_text == " world"


def test_stop_string_across_token_boundaries(tiny: Tokenizer, path: str) -> None:
    ids = tiny.encode(TEXT, add_special_tokens=False)
    d = _detok(tiny, stop=["你好，世"])
    shown = []
    matched = None
    for token_id in ids:
        matched = d.update([token_id], False)
        shown.append(d.get_next_output_text(matched is not None, True))
        if matched:
            break
    assert matched == "你好，世"
    assert "".join(shown) == "Hello world! "
    assert d.output_text == "Hello world! "
    # Tokens up to the one completing the stop string are kept.
    assert tiny.decode(d.output_token_ids).startswith("Hello world! 你好，世")


def test_hold_back_buffer_while_streaming(tiny: Tokenizer, path: str) -> None:
    ids = tiny.encode("abcdefgh", add_special_tokens=False)
    d = _detok(tiny, stop=["xyz1"])  # 3 characters held back
    d.update(ids, False)
    assert d.get_next_output_text(False, False) == "abcde"
    assert d.get_next_output_text(False, True) == "abcde"
    assert d.get_next_output_text(True, True) == "fgh"
    assert d.get_next_output_text(True, False) == "abcdefgh"


def test_include_stop_str_in_output(tiny: Tokenizer, path: str) -> None:
    ids = tiny.encode("one two three four", add_special_tokens=False)
    d = _detok(tiny, stop=["two"], include_stop_str_in_output=True)
    assert d.update(ids, False) == "two"
    assert d.output_text == "one two"
    # With several tokens in one step, the ones after the match are dropped.
    assert tiny.decode(d.output_token_ids).startswith("one two")
    assert "three" not in tiny.decode(d.output_token_ids)


def test_no_stop_before_min_tokens(tiny: Tokenizer, path: str) -> None:
    ids = tiny.encode("a b a b a b", add_special_tokens=False)
    d = _detok(tiny, stop=["b"], min_tokens=len(ids) - 1)
    found = [d.update([token_id], False) for token_id in ids]
    # Only the text of tokens past min_tokens is searched.
    assert found == [None] * (len(ids) - 1) + ["b"]
    assert d.output_text == "a b a b a "  # cut at the last "b"


def test_stop_terminated_token_is_not_text(tiny: Tokenizer, path: str) -> None:
    ids = tiny.encode("hi", add_special_tokens=False)
    d = _detok(tiny, skip_special_tokens=False)
    d.update([*ids, 2], True)  # EOS ends the request
    assert d.output_text == "hi"
    assert d.output_token_ids == [*ids, 2]
    kept = _detok(tiny, skip_special_tokens=False, include_stop_str_in_output=True)
    kept.update([*ids, 2], True)
    assert kept.output_text == "hi</s>"


def test_special_tokens_skip_and_keep(tiny: Tokenizer, path: str) -> None:
    hi = tiny.encode("hi", add_special_tokens=False)
    ids = [*hi, 3, 4, *hi]
    skip = _detok(tiny)
    skip.update(ids, False)
    assert skip.output_text == "hihi"
    keep = _detok(tiny, skip_special_tokens=False)
    keep.update(ids, False)
    assert keep.output_text == "hi<|im_start|><|im_end|>hi"
    tight = _detok(tiny, skip_special_tokens=False, spaces_between_special_tokens=False)
    tight.update(ids, False)
    assert tight.output_text == "hi<|im_start|><|im_end|>hi"


def test_invalid_prefix_resets_the_stream(tiny: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    d = _detok(tiny)
    assert isinstance(d, FastIncrementalDetokenizer)
    calls: list[int] = []

    def broken(tokenizer: Any, token_id: int) -> str:
        calls.append(token_id)
        raise Exception("Invalid prefix encountered while decoding")

    monkeypatch.setattr(d, "_step", broken)
    ids = tiny.encode(" ok", add_special_tokens=False)
    d.update(ids, False)
    assert calls == [ids[0]]  # a fresh stream (without the prompt) decoded it
    assert d.output_text.strip() == "ok"

    def other(tokenizer: Any, token_id: int) -> str:
        raise RuntimeError("something else")

    monkeypatch.setattr(d, "_step", other)
    before = d.output_text
    with pytest.raises(RuntimeError, match="something else"):
        d.update(ids, False)
    assert d.output_text == before  # the text so far survives the error


def test_out_of_vocabulary_ids_give_no_text(tiny: Tokenizer, path: str) -> None:
    d = _detok(tiny)
    d.update([*tiny.encode("a", add_special_tokens=False), 10_000], False)
    assert d.output_text == "a"


@pytest.mark.parametrize(
    ("text", "new", "stop", "include", "expected"),
    [
        ("hello world", 5, ["world"], False, ("world", 6)),
        ("hello world", 5, ["world"], True, ("world", -1)),
        ("hello world!", 6, ["world"], True, ("world", 11)),
        ("hello world", 2, ["hello"], False, None),  # searched already
        ("hello world", 5, ["o w"], False, ("o w", 4)),  # ends in the new text
        ("hello world", 4, ["o w"], False, None),  # ended before the new text
        ("abcab", 5, ["cab", "ab"], False, ("ab", 0)),  # earliest completion wins
        ("abc", 3, ["bc", "c"], False, ("bc", 1)),  # ties: first in the list
        ("abc", 0, ["abc"], False, None),
        ("abc", 3, [], False, None),
    ],
)
def test_check_stop_strings(
    text: str, new: int, stop: list[str], include: bool, expected: tuple[str, int] | None
) -> None:
    assert check_stop_strings(text, new, stop, include) == expected


def test_sentencepiece_style_byte_fallback(tmp_path: Any, path: str) -> None:
    from trio_vllm.text import load_tokenizer

    from ._parity import build_sentencepiece_model

    tok = load_tokenizer(build_sentencepiece_model(tmp_path / "sp"))
    prompt = tok.encode("Hello")
    ids = tok.encode(" world 你好 😀 café", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids).count("<0xE4>") == 1  # byte-fallback pieces
    d = IncrementalDetokenizer.for_request(tok, prompt, SamplingParams())
    deltas = []
    for token_id in ids:
        d.update([token_id], False)
        deltas.append(d.get_next_output_text(False, True))
    assert all("\ufffd" not in s for s in deltas)
    # What the whole sequence decodes to, past the prompt's text.
    full = tok.decode([*prompt, *ids])
    assert "".join(deltas) == full[len(tok.decode(prompt)) :] == " world 你好 😀 café"
    # Logprobs decode one token alone: the Metaspace marker's space is put back.
    marked = [
        i
        for i, piece in enumerate(tok.convert_ids_to_tokens(range(259, 300)), 259)
        if piece and piece.startswith("\u2581") and len(piece) > 1
    ]
    assert marked
    assert all(tok.decode([i]).startswith(" ") is False for i in marked)  # Strip ate it
    assert all(s.startswith(" ") for s in tok.decode_tokens_individually(marked))
