"""The text layer's ``/tokenize`` rules (sans-I/O, tiny-llama's tokenizer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from trio_vllm import InvalidRequestError
from trio_vllm.text import detokenize, render_chat_template, token_strs, tokenize, tokenize_chat

if TYPE_CHECKING:
    from trio_vllm.text import Tokenizer

MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]


def test_text_prompt_special_tokens(tiny: Tokenizer) -> None:
    with_bos = tokenize(tiny, "Hello world")
    plain = tokenize(tiny, "Hello world", add_special_tokens=False)
    assert with_bos[0] == tiny.bos_token_id
    assert with_bos[1:] == plain
    assert detokenize(tiny, plain) == "Hello world"


def test_no_length_check(tiny: Tokenizer) -> None:
    # vLLM's /tokenize passes max_total_tokens=None: far past max_model_len is fine.
    long = "word " * 5000
    assert len(tokenize(tiny, long)) > 5000


def test_chat_defaults(tiny: Tokenizer) -> None:
    text, ids = tokenize_chat(tiny, MESSAGES)
    assert text == render_chat_template(MESSAGES, tokenizer=tiny, add_generation_prompt=True)
    assert ids == tiny.encode(text, add_special_tokens=False)  # the template brings its own
    _, with_bos = tokenize_chat(tiny, MESSAGES, add_special_tokens=True)
    assert with_bos == tiny.encode(text, add_special_tokens=True) != ids
    bare, bare_ids = tokenize_chat(tiny, MESSAGES, add_generation_prompt=False)
    assert text.startswith(bare)
    assert len(bare) < len(text)
    assert bare_ids == tiny.encode(bare, add_special_tokens=False)


def test_chat_explicit_flags_win_over_kwargs(tiny: Tokenizer) -> None:
    # merge_kwargs: the request's add_generation_prompt overrides chat_template_kwargs'.
    kw = {"add_generation_prompt": False}
    assert tokenize_chat(tiny, MESSAGES, chat_template_kwargs=kw) == tokenize_chat(tiny, MESSAGES)


def test_chat_continue_final_message(tiny: Tokenizer) -> None:
    msgs = [*MESSAGES, {"role": "assistant", "content": "Hel"}]
    text, _ = tokenize_chat(tiny, msgs, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("Hel")
    with pytest.raises(InvalidRequestError, match="are not compatible"):
        tokenize_chat(tiny, msgs, continue_final_message=True)


def test_detokenize_keeps_special_tokens(tiny: Tokenizer) -> None:
    ids = tokenize(tiny, "Hi")
    assert detokenize(tiny, ids).startswith("<s>")
    assert detokenize(tiny, [tiny.vocab_size + 5]) == ""  # unknown ids decode to nothing


def test_token_strs_are_vocabulary_pieces(tiny: Tokenizer) -> None:
    ids = tokenize(tiny, "Hello world")
    strs = token_strs(tiny, ids)
    assert strs[0] == "<s>"
    assert all(tiny.token_to_id(s) == i for s, i in zip(strs, ids, strict=True) if s)
    assert tiny.convert_tokens_to_string([s for s in strs[1:] if s]) == "Hello world"


def test_bad_prompt_type(tiny: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError):
        tokenize(tiny, [1, 2])  # type: ignore[arg-type]
