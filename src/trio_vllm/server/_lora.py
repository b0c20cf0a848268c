"""LoRA adapters served as model names: vLLM 0.32.0's ``OpenAIServingModels``.

``--lora-modules`` entries (``name=path`` or JSON ``{"name", "path", "base_model_name"}``,
vLLM's ``LoRAParserAction``) are loaded on the engines at startup (``add_lora``, ids
1, 2, ... in order, as vLLM counts them); each is a model name: a request naming it runs
with that `LoRARequest`, and ``/v1/models`` lists it after the base names with
``root`` = its path and ``parent`` = its base model. ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` exist only with runtime updating allowed
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, as vLLM), with vLLM's checks and messages.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import msgspec
from msgspec import Struct

from ..protocol import LoRARequest
from ._http import HTTPError

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from ._frontend import EngineClientLike

__all__ = [
    "LoRAAdapters",
    "LoRAModulePath",
    "LoadLoRAAdapterRequest",
    "UnloadLoRAAdapterRequest",
    "parse_lora_modules",
    "runtime_lora_updating_allowed",
]


class LoRAModulePath(Struct, kw_only=True, forbid_unknown_fields=True):
    """One ``--lora-modules`` entry (vLLM's ``LoRAModulePath``)."""

    name: str
    path: str
    base_model_name: str | None = None
    is_3d_lora_weight: bool = False


class LoadLoRAAdapterRequest(Struct, kw_only=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class UnloadLoRAAdapterRequest(Struct, kw_only=True):
    lora_name: str
    lora_int_id: int | None = None


def parse_lora_modules(values: Iterable[str]) -> list[LoRAModulePath]:
    """vLLM's ``LoRAParserAction``: ``name=path`` (no comma), else a JSON object.
    Empty entries are skipped. Raises ``ValueError`` with vLLM's message."""
    modules: list[LoRAModulePath] = []
    for item in values:
        if not item:
            continue
        if "=" in item and "," not in item:
            name, path = item.split("=", 1)
            modules.append(LoRAModulePath(name=name, path=path))
            continue
        try:
            raw = json.loads(item)
        except json.JSONDecodeError:
            raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
        try:
            modules.append(msgspec.convert(raw, LoRAModulePath))
        except msgspec.ValidationError as exc:
            raise ValueError(f"Invalid fields for --lora-modules: {item} - {exc}") from None
    return modules


def runtime_lora_updating_allowed() -> bool:
    """vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (``1`` or ``true``)."""
    value = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
    return value.strip().lower() in ("1", "true")


class LoRAAdapters:
    """The adapters a server serves by name, and the id counter (vLLM counts from 1 and
    never reuses an id, a reload in place keeps its id).

    Not safe for two loads of one name at once from different tasks: the server holds
    its own lock around `load` and `unload` (vLLM's per-name lock)."""

    def __init__(self, base_names: Sequence[str]) -> None:
        self.base_names = list(base_names)
        self.requests: dict[str, LoRARequest] = {}
        self._last_id = 0

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self.requests.get(name)

    def check_load(self, req: LoadLoRAAdapterRequest) -> None:
        """vLLM's ``_check_load_lora_adapter_request``: `HTTPError` 400."""
        if not req.lora_name or not req.lora_path:
            raise HTTPError(
                "Both 'lora_name' and 'lora_path' must be provided.", err_type="InvalidUserInput"
            )
        if req.lora_name in self.base_names:
            raise HTTPError(
                f"The lora adapter '{req.lora_name}' conflicts with a served base model.",
                err_type="InvalidUserInput",
            )
        if not req.load_inplace and req.lora_name in self.requests:
            raise HTTPError(
                f"The lora adapter '{req.lora_name}' has already been loaded. If you want "
                "to load the adapter in place, set 'load_inplace' to True.",
                err_type="InvalidUserInput",
            )

    def prepare(
        self, req: LoadLoRAAdapterRequest, base_model_name: str | None = None
    ) -> LoRARequest:
        """The `LoRARequest` for a checked load: the name's old id, or the next one."""
        previous = self.requests.get(req.lora_name)
        if previous is not None:
            lora_id = previous.lora_int_id
        else:
            self._last_id += 1
            lora_id = self._last_id
        return LoRARequest(
            lora_name=req.lora_name,
            lora_int_id=lora_id,
            lora_path=req.lora_path,
            base_model_name=base_model_name if base_model_name in self.base_names else None,
            load_inplace=req.load_inplace,
            is_3d_lora_weight=req.is_3d_lora_weight,
        )

    async def load(
        self,
        client: EngineClientLike,
        req: LoadLoRAAdapterRequest,
        base_model_name: str | None = None,
    ) -> str:
        """Check, ``add_lora`` on every engine, register; vLLM's success text.

        Raises `HTTPError` (400 for a bad request, 500 with the engine's message when
        an engine refuses the adapter, e.g. a missing path). Cancellation: nothing is
        registered unless every engine answered (an engine may have loaded it)."""
        self.check_load(req)
        lora = self.prepare(req, base_model_name)
        try:
            await client.add_lora(lora)
        except Exception as exc:
            if isinstance(exc, HTTPError):
                raise
            raise HTTPError(str(exc), 500, err_type="InternalServerError") from None
        self.requests[req.lora_name] = lora
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        """vLLM's ``unload_lora_adapter``: forget the name (the engines keep the weights
        until evicted, as vLLM's do). `HTTPError` 400/404."""
        if not req.lora_name:
            raise HTTPError(
                "'lora_name' needs to be provided to unload a LoRA adapter.",
                err_type="InvalidUserInput",
            )
        if req.lora_name not in self.requests:
            raise HTTPError(
                f"The lora adapter '{req.lora_name}' cannot be found.",
                404,
                err_type="NotFoundError",
            )
        del self.requests[req.lora_name]
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
