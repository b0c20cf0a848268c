"""A small byte-level BPE model directory, built in the test (a stand-in for tiny-llama:
merges, BOS added by the post-processor, ChatML special tokens, EOS ids [2, 4])."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "trio and anyio run structured concurrency; vllm serves models.",
    "日本語のテキスト 🎉 emoji and CJK characters split across tokens.",
] * 20


def write_bpe_model_dir(path: Path, *, vocab_size: int = 400) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    files = {
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "chat_template": CHAT_TEMPLATE,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        },
        "generation_config.json": {"bos_token_id": 1, "eos_token_id": [2, 4]},
        "config.json": {
            "vocab_size": tok.get_vocab_size(),
            "max_position_embeddings": 512,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    }
    for name, doc in files.items():
        (path / name).write_text(json.dumps(doc, indent=1))
    return str(path)
