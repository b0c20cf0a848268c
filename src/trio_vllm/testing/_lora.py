"""A random LoRA adapter for a model directory, in PEFT's layout (for tests).

``adapter_config.json`` + ``adapter_model.safetensors``, as ``peft`` saves them and
vLLM's ``--lora-modules`` / ``add_lora`` load them: ``lora_A`` (``r x in``) and
``lora_B`` (``out x r``) per target projection and layer, named
``base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_{A,B}.weight``, for all
seven projections of a Llama layer (attention q/k/v/o, MLP gate/up/down). The
safetensors file is written by hand (an 8-byte little-endian header length, the JSON
header, the raw tensors), so no ``safetensors`` or ``torch`` is needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import os

__all__ = ["write_lora_adapter"]

# Every projection of a Llama decoder layer, with its module: an adapter on q/v alone
# does not change greedy tokens on a dummy-weight model (measured with stock vLLM), so
# a parity test with it would prove nothing.
_TARGETS = (
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
)


def write_lora_adapter(
    path: str | os.PathLike[str],
    model_dir: str | os.PathLike[str],
    *,
    rank: int = 8,
    alpha: int = 16,
    seed: int = 0,
    scale: float = 0.5,
) -> Path:
    """Write an adapter for the Llama-shaped model in ``model_dir`` (its
    ``config.json``: ``hidden_size``, ``num_hidden_layers``, heads) into ``path``;
    return ``path``. Weights are seeded normal values times ``scale`` (large enough that
    the adapter changes what a model generates). Raises ``OSError`` or ``KeyError``
    for a directory without a usable ``config.json``."""
    import numpy as np

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim", hidden // heads))
    inter = int(config["intermediate_size"])
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    # (in, out) of each projection
    dims = {
        "q_proj": (hidden, q_dim),
        "k_proj": (hidden, kv_dim),
        "v_proj": (hidden, kv_dim),
        "o_proj": (q_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    rng = np.random.default_rng(seed)
    tensors: dict[str, Any] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module, proj in _TARGETS:
            fan_in, fan_out = dims[proj]
            prefix = f"base_model.model.model.layers.{layer}.{module}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((rank, fan_in)) * scale
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((fan_out, rank)) * scale
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    _write_safetensors(out / "adapter_model.safetensors", tensors)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": [proj for _, proj in _TARGETS],
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out


def _write_safetensors(path: Path, tensors: dict[str, Any]) -> None:
    import numpy as np

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        data = np.ascontiguousarray(tensors[name], dtype="<f4").tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    with path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for blob in blobs:
            f.write(blob)
