"""The shipped model directory (a byte-level tokenizer for the engine's vocabulary) and
``--model-dir`` (the vocabulary size of another model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from trio_vllm.reference_engine import EOS_TOKEN_ID, MODEL_DIR, VOCAB_SIZE, echo_continuation
from trio_vllm.reference_engine._model_dir import model_files, read_model_config
from trio_vllm.reference_engine._options import parse_options

from ._harness import request

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._harness import Frontend

pytestmark = pytest.mark.timeout(60)

HS = ["--handshake-address", "ipc:///tmp/unused"]


def test_shipped_files_are_the_generated_ones() -> None:
    files = model_files()
    assert sorted(files) == sorted(p.name for p in Path(MODEL_DIR).iterdir())
    for name, text in files.items():
        assert (Path(MODEL_DIR) / name).read_text(encoding="utf-8") == text, name


def test_byte_level_tokenizer() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(Path(MODEL_DIR) / "tokenizer.json"))
    assert tok.get_vocab_size() == VOCAB_SIZE
    text = "héllo 日本 🎉\n\t  x"
    ids = tok.encode(text).ids
    assert ids == list(text.encode())  # one token per byte, id = byte, no BOS
    assert tok.decode(ids) == text
    assert tok.encode("a</s>b").ids == [ord("a"), EOS_TOKEN_ID, ord("b")]
    assert tok.decode([ord("a"), EOS_TOKEN_ID]) == "a"
    assert tok.decode([ord("a"), EOS_TOKEN_ID], skip_special_tokens=False) == "a</s>"
    # Streaming: a multi-byte character comes out once its last byte arrives.
    stream = tokenizers.decoders.DecodeStream(skip_special_tokens=True)
    assert [stream.step(tok, t) for t in "日!".encode()] == [None, None, "日", "!"]
    generation = json.loads((Path(MODEL_DIR) / "generation_config.json").read_text())
    assert generation["eos_token_id"] == EOS_TOKEN_ID
    config = json.loads((Path(MODEL_DIR) / "tokenizer_config.json").read_text())
    assert "add_generation_prompt" in config["chat_template"]
    assert read_model_config(MODEL_DIR) == (VOCAB_SIZE, 2048, EOS_TOKEN_ID)


def _write_config(tmp_path: Path, **config: object) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_model_dir_options(tmp_path: Path) -> None:
    d = _write_config(tmp_path, vocab_size=512, max_position_embeddings=512, eos_token_id=[2, 4])
    opts = parse_options([*HS, "--model-dir", d])
    assert (opts.vocab_size, opts.max_model_len, opts.eos_token_id) == (512, 512, 2)
    opts = parse_options([*HS, "--model-dir", d, "--max-model-len", "64"])
    assert opts.max_model_len == 64
    default = parse_options(HS)
    assert (default.vocab_size, default.max_model_len, default.eos_token_id) == (
        VOCAB_SIZE,
        2048,
        EOS_TOKEN_ID,
    )
    (tmp_path / "small").mkdir()
    small = _write_config(tmp_path / "small", vocab_size=100)
    opts = parse_options([*HS, "--model-dir", small])
    assert (opts.vocab_size, opts.max_model_len, opts.eos_token_id) == (100, 2048, 99)


@pytest.mark.parametrize(
    "config", [None, {"vocab_size": "many"}, {"vocab_size": 0}, {"hidden_size": 3}]
)
def test_bad_model_dir_is_a_usage_error(
    tmp_path: Path, config: dict[str, object] | None, capsys: pytest.CaptureFixture[str]
) -> None:
    if config is not None:
        _write_config(tmp_path, **config)
    with pytest.raises(SystemExit) as info:
        parse_options([*HS, "--model-dir", str(tmp_path)])
    assert info.value.code == 2
    assert "config.json" in capsys.readouterr().err


def test_engine_takes_the_vocabulary_from_model_dir(
    tmp_path: Path, spawn: Callable[..., Frontend]
) -> None:
    d = _write_config(tmp_path, vocab_size=512, max_position_embeddings=512, eos_token_id=[2, 4])
    fe = spawn(["--model-dir", d, "--max-model-len", "512"])
    assert fe.ready_response is not None
    assert fe.ready_response.max_model_len == 512
    failure, info = fe.call("collective_rpc", "reference_engine_info")
    assert failure is None
    assert info[0]["vocab_size"] == 512
    assert info[0]["eos_token_id"] == 2
    prompt = [300, 511, 7, 400]  # beyond the byte vocabulary, inside the model's
    r = fe.generate(request(prompt, max_tokens=6, logprobs=2))
    assert r.tokens == echo_continuation(prompt, 6)
    assert r.finish_reason == 1
    rid = fe.add(request([1, 512], max_tokens=2), validate=False)
    assert fe.collect([rid])[rid].finish_reason == 3  # error: out of vocabulary


def test_default_engine_rejects_ids_beyond_its_vocabulary(
    spawn: Callable[..., Frontend],
) -> None:
    fe = spawn()
    rid = fe.add(request([1, VOCAB_SIZE], max_tokens=2), validate=False)
    assert fe.collect([rid])[rid].finish_reason == 3
