"""vLLM's own ``LLM.embed`` on the tiny model as a pooling model, and the frames it sent
and received (issue 22).

Not a test module: run in vLLM's python as ``PY embed_reference.py MODEL_DIR OUT.json``.
Writes ``{"embeddings": [...], "vectors": [...]}``: the embeddings of PROMPTS (one
``LLM.embed`` call), and wire vectors in the shared format (wire-vectors/README.md) of
the first pooling ADD the frontend encoded and the first pooling output it decoded,
captured at vLLM's own ``MsgpackEncoder.encode`` / ``MsgpackDecoder.decode``.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import os
import sys
from typing import Any

PROMPTS: list[Any] = ["The quick brown fox", "日本語 🎉", {"prompt_token_ids": [1, 5, 7, 9]}]


def spelled(value: Any) -> Any:
    """A message spelled out as the shared vectors spell it."""
    import msgspec
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        return {"__tensor__": {"dtype": str(t.dtype).removeprefix("torch."),
                               "shape": list(t.shape), "values": t.flatten().tolist()}}  # fmt: skip
    if isinstance(value, msgspec.Struct):
        return {f: spelled(getattr(value, f)) for f in value.__struct_fields__}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # vLLM's stats (PrefillStats, PrefixCacheStats) are dataclasses, spelled as maps
        return {f.name: spelled(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(spelled(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [spelled(v) for v in value]
    if isinstance(value, dict):
        return {k: spelled(v) for k, v in value.items()}
    if hasattr(value, "__dict__") and not isinstance(value, type):  # a plain object
        return {k: spelled(v) for k, v in vars(value).items() if not k.startswith("_")}
    return value


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    from vllm import LLM
    from vllm.v1 import serial_utils
    from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest

    captured: dict[str, Any] = {}
    encode, decode = serial_utils.MsgpackEncoder.encode, serial_utils.MsgpackDecoder.decode

    def recording_encode(self: Any, obj: Any) -> Any:
        bufs = encode(self, obj)
        if isinstance(obj, EngineCoreRequest) and obj.pooling_params is not None:
            captured.setdefault("add", (obj, [b"\x00", *(bytes(b) for b in bufs)]))
        return bufs

    def recording_decode(self: Any, bufs: Any) -> Any:
        obj = decode(self, bufs)
        if isinstance(obj, EngineCoreOutputs) and any(
            o.pooling_output is not None for o in obj.outputs
        ):
            frames = [bytes(bufs)] if isinstance(bufs, (bytes, bytearray, memoryview)) else [
                bytes(b) for b in bufs]  # fmt: skip
            captured.setdefault("out", (obj, frames))
        return obj

    serial_utils.MsgpackEncoder.encode = recording_encode  # type: ignore[method-assign]
    serial_utils.MsgpackDecoder.decode = recording_decode  # type: ignore[method-assign]
    llm = LLM(model=sys.argv[1], runner="pooling", convert="embed", load_format="dummy",
              dtype="float32", max_model_len=256, enforce_eager=True, max_num_seqs=8)  # fmt: skip
    outs = llm.embed(PROMPTS, use_tqdm=False)
    result: dict[str, Any] = {
        "embeddings": [
            {"prompt_token_ids": list(o.prompt_token_ids), "embedding": o.outputs.embedding}
            for o in outs
        ],
        "vectors": [],
    }
    for key, name, socket, direction, notes in (
        ("add", "add_pooling_embed_stock", "input", "client_to_engine",
         "Pooling ADD as vLLM's LLM.embed sends it (task embed, use_activation and "
         "skip_reading_prefix_cache filled in by PoolingParams.verify)."),
        ("out", "outputs_pooling_embed_stock", "output", "engine_to_client",
         "Embedding output of a stock engine (--runner pooling --convert embed, tiny-llama, "
         "dummy weights): float32 [128], normalised."),
    ):  # fmt: skip
        if key in captured:
            obj, frames = captured[key]
            result["vectors"].append({
                "name": name, "vllm_version": vllm.__version__.split("+")[0],
                "socket": socket, "direction": direction,
                "frames_b64": [base64.b64encode(f).decode() for f in frames],
                "value": spelled(obj), "notes": notes,
            })  # fmt: skip
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
