"""The reference engine core: a real vLLM engine-core process for tests and benchmarks.

Run it as ``python -m trio_vllm.reference_engine --handshake-address ADDR --index N``
(see ``--help`` and ``docs/reference-engine.md``). It speaks vLLM's ZeroMQ + msgpack
engine-core protocol through `trio_vllm.protocol`, runs a tiny torch transformer
(``--model tiny``) or the exactly predictable echo model (``--model echo``), and injects
faults on demand.

Importing this package imports neither torch nor zmq; the constants below are what a
client needs to talk to its models. `MODEL_DIR` is the path of a model directory
for the engine's vocabulary (a byte-level ``tokenizer.json``, a ChatML-like chat template,
EOS 257), so a text frontend works out of the box: ``open_llm(ReferenceEngines(),
model=MODEL_DIR)``. ``--model-dir DIR`` makes the engine take its vocabulary size from
another model's ``config.json`` (the echo model works with any vocabulary).
`TINY_LLAMA_DIR` is a shipped copy of a small real model directory (tiny-llama, no
weights) for examples: ``trio-vllm model write DIR`` copies it.
"""

from __future__ import annotations

from ._model import BOS_TOKEN_ID as BOS_TOKEN_ID
from ._model import EOS_TOKEN_ID as EOS_TOKEN_ID
from ._model import HIDDEN_SIZE as HIDDEN_SIZE
from ._model import PAD_TOKEN_ID as PAD_TOKEN_ID
from ._model import UNK_TOKEN_ID as UNK_TOKEN_ID
from ._model import VOCAB_SIZE as VOCAB_SIZE
from ._model_dir import MODEL_DIR as MODEL_DIR
from ._model_dir import TINY_LLAMA_DIR as TINY_LLAMA_DIR

__all__ = [
    "BOS_TOKEN_ID",
    "EOS_TOKEN_ID",
    "HIDDEN_SIZE",
    "MODEL_DIR",
    "PAD_TOKEN_ID",
    "TINY_LLAMA_DIR",
    "UNK_TOKEN_ID",
    "VOCAB_SIZE",
    "echo_continuation",
]


def echo_continuation(prompt: list[int], num_tokens: int) -> list[int]:
    """The tokens the echo model generates greedily for ``prompt`` (no stop conditions)."""
    return [prompt[k % len(prompt)] for k in range(num_tokens)]
