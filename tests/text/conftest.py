"""Fixtures of the text-layer tests: the tiny-llama model directory and small tokenizers
built in the test with the ``tokenizers`` library (no network, no engine)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trio_vllm.text import ModelFiles, Tokenizer

from ._parity import TINY_LLAMA, tiny_llama_available, tokenizer_for


@pytest.fixture
def tiny_dir() -> Path:
    if not tiny_llama_available():
        pytest.skip(f"the tiny model is missing: {TINY_LLAMA}")
    return Path(TINY_LLAMA)


@pytest.fixture
def tiny(tiny_dir: Path) -> Tokenizer:
    return tokenizer_for(str(tiny_dir))


@pytest.fixture
def tiny_files(tiny_dir: Path) -> ModelFiles:
    return ModelFiles(tiny_dir)


def write_model_dir(
    path: Path,
    backend: Any,
    *,
    tokenizer_config: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    """A model directory with ``backend`` (a tokenizers.Tokenizer) as tokenizer.json."""
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    for name, value in (
        ("tokenizer_config.json", tokenizer_config),
        ("config.json", config),
        ("generation_config.json", generation_config),
    ):
        if value is not None:
            (path / name).write_text(json.dumps(value), encoding="utf-8")
    return path


def metaspace_tokenizer() -> Any:
    """A SentencePiece-style (Metaspace) word-level tokenizer with byte-free vocabulary."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "▁hello", "▁world", "▁", "hello", "!", "▁stop", "x"]
    tok = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return tok
