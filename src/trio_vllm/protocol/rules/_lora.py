"""`LORA`: a LoRA adapter reference."""

from __future__ import annotations

from typing import Final

from ..structs import (
    LoRARequest,
)
from ._core import (
    UINT64_MAX,
    Fail,
    Family,
    Limits,
    is_int,
    nonempty_str,
    not_a,
)

# ---------------------------------------------------------------------------------- LoRA


LORA: Final[Family[LoRARequest]] = Family(
    "lora",
    lambda **kw: LoRARequest(**{"lora_name": "a", "lora_int_id": 1, "lora_path": "/a", **kw}),
)
"""A LoRA adapter reference (an invalid one kills the engine's input thread)."""


@LORA.rule("lora_request", example={}, limits={"supports_lora": False})
def _lora_enabled(lora: LoRARequest, limits: Limits) -> Fail | None:
    given: object = lora
    if not isinstance(given, LoRARequest):
        return not_a("lora_request", "a LoRARequest", given)
    if limits.supports_lora is False:
        return f"Got lora_request {lora} but LoRA is not enabled!", None
    return None


@LORA.rule("lora_request", example={"lora_name": ""})
def _lora_fields(lora: LoRARequest, limits: Limits) -> Fail | None:
    if not nonempty_str(lora.lora_name):
        return f"lora_request.lora_name must be a non-empty str, got {lora.lora_name!r}.", None
    if not is_int(lora.lora_int_id) or not 1 <= lora.lora_int_id <= UINT64_MAX:
        return f"lora_request.lora_int_id must be an integer >= 1, got {lora.lora_int_id!r}.", None
    if not nonempty_str(lora.lora_path):
        return f"lora_request.lora_path must be a non-empty str, got {lora.lora_path!r}.", None
    return None
