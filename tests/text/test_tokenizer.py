"""Model files and the tokenizer: what vLLM reads through transformers, read from JSON."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import pytest

from trio_vllm.text import ModelFiles, Tokenizer, load_tokenizer, resolve_model_dir

from .conftest import metaspace_tokenizer, write_model_dir

if TYPE_CHECKING:
    from pathlib import Path


def test_tiny_llama_model_files(tiny_files: ModelFiles) -> None:
    assert tiny_files.vocab_size == 512
    assert tiny_files.max_position_embeddings == 512
    assert tiny_files.eos_token_ids == [2, 4]
    assert tiny_files.sampling_defaults() == {}
    assert "<|im_start|>" in (tiny_files.tokenizer_config.get("chat_template") or "")


def test_tiny_llama_tokenizer(tiny: Tokenizer) -> None:
    assert tiny.is_fast
    assert (tiny.bos_token_id, tiny.eos_token_id) == (1, 2)
    assert tiny.vocab_size == len(tiny) == 512
    assert tiny.max_token_id == 511
    assert set(tiny.all_special_ids) == {0, 1, 2, 3, 4}
    ids = tiny.encode("Hello world")
    assert ids[0] == 1  # the post-processor's BOS
    assert tiny.encode("Hello world", add_special_tokens=False) == ids[1:]
    assert tiny.decode(ids) == "Hello world"
    assert tiny.decode(ids, skip_special_tokens=False) == "<s>Hello world"
    assert tiny.chat_template is not None


def test_decoding_single_tokens_splits_utf8(tiny: Tokenizer) -> None:
    ids = tiny.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE: the emoji is several tokens
    singles = tiny.decode_tokens_individually(ids)
    assert all(s.endswith("\ufffd") for s in singles)
    assert tiny.decode(ids) == "😀"


def test_special_tokens_and_added_tokens_from_tokenizer_config(tmp_path: Path) -> None:
    backend = metaspace_tokenizer()
    model = write_model_dir(
        tmp_path / "m",
        backend,
        tokenizer_config={
            "bos_token": {"content": "<s>", "__type": "AddedToken"},
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "add_bos_token": True,
            "added_tokens_decoder": {"10": {"content": "<|tool|>", "special": True}},
            "additional_special_tokens": ["<|tool|>"],
            "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
        },
        config={"vocab_size": 16},
    )
    tok = load_tokenizer(model)
    assert tok.token_to_id("<|tool|>") == 10
    assert tok.special_tokens_map["bos_token"] == "<s>"
    assert 10 in tok.all_special_ids
    # No post-processor in tokenizer.json: add_bos_token builds one, as transformers does.
    assert tok.encode("hello world") == [1, 3, 4]
    assert tok.encode("hello world", add_special_tokens=False) == [3, 4]
    assert tok.max_token_id == 10  # the tokenizer's own, as vLLM's
    assert tok.model_vocab_size == 16  # the model's vocabulary is larger
    # Metaspace strips the first token's leading space; single-token decode puts it back.
    assert tok.decode([3]) == "hello"
    assert tok.decode_tokens_individually([3, 4, 7]) == [" hello", " world", "!"]


def test_generation_config_falls_back_to_config_json(tmp_path: Path) -> None:
    model = write_model_dir(
        tmp_path / "m",
        metaspace_tokenizer(),
        config={
            "eos_token_id": 2,
            "bos_token_id": 1,
            "vocab_size": 10,
            "max_position_embeddings": 64,
        },
    )
    files = ModelFiles(model)
    assert files.eos_token_ids == [2]
    assert files.max_position_embeddings == 64


def test_sampling_defaults_from_generation_config(tmp_path: Path) -> None:
    model = write_model_dir(
        tmp_path / "m",
        metaspace_tokenizer(),
        generation_config={
            "eos_token_id": [2],
            "temperature": 0.6,
            "top_p": 0.9,
            "max_new_tokens": 30,
            "do_sample": True,
        },
    )
    assert ModelFiles(model).sampling_defaults() == {
        "temperature": 0.6,
        "top_p": 0.9,
        "max_tokens": 30,
    }


def test_directory_without_tokenizer_json_needs_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
    with pytest.raises(FileNotFoundError, match="transformers"):
        load_tokenizer(tmp_path / "m")


def test_unknown_model_name_is_not_found_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
        resolve_model_dir("no-such-org/no-such-model-trio-vllm")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_dir("/no/such/dir")


def test_hub_names_need_huggingface_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(FileNotFoundError, match="huggingface_hub is not installed"):
        resolve_model_dir("some-org/some-model")


class _FakeSlowTokenizer:
    """The transformers surface the fallback uses, over a tokenizers backend (not fast)."""

    is_fast = False

    def __init__(self, backend: object) -> None:
        self._b = backend
        self.special_tokens_map = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
        self.all_special_tokens = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
        self.added_tokens_decoder = {
            i: t.content for i, t in backend.get_added_tokens_decoder().items()
        }
        self.chat_template = "{{ messages[0]['content'] }}"

    def get_vocab(self) -> dict[str, int]:
        return self._b.get_vocab(with_added_tokens=True)

    def get_added_vocab(self) -> dict[str, int]:
        return {t: i for i, t in self.added_tokens_decoder.items()}

    def __len__(self) -> int:
        return self._b.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._b.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._b.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(
        self, ids: list[int], skip_special_tokens: bool = False
    ) -> list[str | None]:
        special = {self.get_vocab()[t] for t in self.all_special_tokens}
        return [self._b.id_to_token(i) for i in ids if not (skip_special_tokens and i in special)]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self._b.decoder.decode(tokens)


def test_transformers_fallback_takes_the_slow_path(
    tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    from tokenizers import Tokenizer as HFTokenizer

    from trio_vllm.protocol import SamplingParams
    from trio_vllm.text import IncrementalDetokenizer, SlowIncrementalDetokenizer

    backend = HFTokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    loaded: list[str] = []

    def from_pretrained(path: str) -> _FakeSlowTokenizer:
        loaded.append(path)
        return _FakeSlowTokenizer(backend)

    fake = types.ModuleType("transformers")
    fake.AutoTokenizer = types.SimpleNamespace(from_pretrained=from_pretrained)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers", fake)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"vocab_size": 512}')
    tok = load_tokenizer(tmp_path / "m")
    assert loaded == [str(tmp_path / "m")]
    assert not tok.is_fast
    assert (tok.eos_token_id, tok.bos_token_id, tok.max_token_id) == (2, 1, 511)
    assert tok.chat_template == "{{ messages[0]['content'] }}"
    text = "Hi 你好 😀"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer.for_request(
        tok, tok.encode("Say: "), SamplingParams(skip_special_tokens=False)
    )
    assert isinstance(d, SlowIncrementalDetokenizer)
    pieces = []
    for token_id in [*ids, 3, 4]:
        d.update([token_id], False)
        pieces.append(d.get_next_output_text(False, True))
    assert all("\ufffd" not in p for p in pieces)
    # Slow tokenizers with added tokens join the pieces around them with spaces (vLLM).
    assert d.output_text == text + " <|im_start|> <|im_end|>"


def test_hub_name_from_the_local_cache_offline(
    tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    hub = pytest.importorskip("huggingface_hub")
    # The cache layout huggingface_hub writes: refs/main names a snapshot directory.
    repo = tmp_path / "hub" / "models--some-org--tiny"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        shutil.copy(tiny_dir / name, snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_dir("some-org/tiny") == snapshot
    files = ModelFiles("some-org/tiny")
    assert files.eos_token_ids == [2, 4]
    assert files.load_tokenizer().encode("Hello")[0] == 1
