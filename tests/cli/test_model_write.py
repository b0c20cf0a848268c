"""``trio-vllm model write``: the shipped model directories, copied for the docs' examples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trio_vllm.cli import main
from trio_vllm.reference_engine import MODEL_DIR, TINY_LLAMA_DIR

SHARED_TINY_LLAMA = Path(__file__).resolve().parents[2] / ".." / "shared" / "interop" / "tiny-llama"


def test_writes_tiny_llama(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "models" / "tiny-llama"
    assert main(["model", "write", str(out)]) == 0
    assert capsys.readouterr().out == f"{out}\n"
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 512
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 4]
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == 512


def test_refuses_to_overwrite_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exc:
        main(["model", "write", str(tmp_path)])
    assert exc.value.code == 2
    assert "config.json exists (--force overwrites it)" in capsys.readouterr().err
    assert (tmp_path / "config.json").read_text() == "{}"
    assert main(["model", "write", str(tmp_path), "--force"]) == 0
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == 512


def test_writes_the_reference_directory(tmp_path: Path) -> None:
    assert main(["model", "write", str(tmp_path), "--name", "trio-vllm-reference"]) == 0
    for source in Path(MODEL_DIR).iterdir():
        assert (tmp_path / source.name).read_bytes() == source.read_bytes()


@pytest.mark.skipif(not SHARED_TINY_LLAMA.is_dir(), reason="no development workspace beside")
def test_shipped_tiny_llama_is_the_interop_one() -> None:
    # The copy the vllm tier and the benchmarks use: the shipped one must not drift from it.
    shipped = sorted(p.name for p in Path(TINY_LLAMA_DIR).iterdir())
    assert shipped == sorted(p.name for p in SHARED_TINY_LLAMA.iterdir())
    for name in shipped:
        assert (Path(TINY_LLAMA_DIR) / name).read_bytes() == (SHARED_TINY_LLAMA / name).read_bytes()
