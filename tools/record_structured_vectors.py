"""Record ADD frames carrying structured outputs, encoded by stock vLLM itself.

Run with the python that has vLLM (``$VPY tools/record_structured_vectors.py OUT_DIR``).
Each request's ``structured_outputs`` goes through vLLM's own frontend resolution
(``SamplingParams._validate_structured_outputs`` with the configured backend ``auto``
and the tiny model's tokenizer), so the frames are what ``vllm serve`` sends: the
backend it picked, a choice turned into its grammar. The vector format is
``../shared/wire-vectors/README.md``'s, plus ``given_structured_outputs`` (the request's
constraint before vLLM resolved it); tests/protocol/test_vectors.py checks our codec
and tests/protocol/test_structured.py our resolution against them. Not imported by the
package (it needs vLLM).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import sys
import types
from pathlib import Path

import msgspec
from transformers import AutoTokenizer
from vllm import SamplingParams
from vllm.config import StructuredOutputsConfig
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.serial_utils import MsgpackEncoder

REPO = Path(__file__).resolve().parents[1]
TINY = REPO.parent / "shared" / "interop" / "tiny-llama"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

CASES = {
    "add_structured_json": (StructuredOutputsParams(json=SCHEMA), "a JSON schema (a map)"),
    "add_structured_json_text": (
        StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True),
        "a JSON schema as text, compact whitespace",
    ),
    "add_structured_regex": (StructuredOutputsParams(regex="[0-9]{3}"), "a regex"),
    "add_structured_choice": (
        StructuredOutputsParams(choice=["yes", "no"]),
        "a choice: vLLM's xgrammar path sends it as its EBNF grammar, choice nil",
    ),
    "add_structured_grammar": (
        StructuredOutputsParams(grammar='root ::= "a" | "b"'),
        "an EBNF grammar",
    ),
    "add_structured_json_object": (
        StructuredOutputsParams(json_object=True, whitespace_pattern=" ?"),
        "json_object with a whitespace pattern",
    ),
}


def _plain(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, msgspec.Struct):
        return {name: _plain(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)  # type: ignore[type-var]
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if hasattr(value, "value") and not isinstance(value, (int, float, str, bool)):
        return value.value  # enums by value
    return value


def main(out: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(TINY))
    model_config = types.SimpleNamespace(is_diffusion=False)
    config = StructuredOutputsConfig(backend="auto")
    index = []
    for name, (so, notes) in CASES.items():
        given = _plain(so)
        params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=so)
        params._validate_structured_outputs(model_config, config, tokenizer)  # type: ignore[arg-type]
        request = EngineCoreRequest(
            request_id=f"req-{name}",
            prompt_token_ids=[1, 2, 3],
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=1764400000.25,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        frames = [b"\x00", *MsgpackEncoder().encode(request)]
        vector = {
            "name": name,
            "vllm_version": "0.32.0",
            "socket": "input",
            "direction": "client_to_engine",
            "frames_b64": [base64.b64encode(bytes(f)).decode() for f in frames],
            "value": _plain(request),
            "given_structured_outputs": given,
            "notes": f"ADD with structured outputs: {notes}; resolved by vLLM's frontend "
            "(backend auto).",
        }
        (out / f"{name}.json").write_text(json.dumps(vector, indent=1) + "\n")
        index.append(name)
    listing = {"vllm_version": "0.32.0", "vectors": index}
    (out / "INDEX.json").write_text(json.dumps(listing, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
