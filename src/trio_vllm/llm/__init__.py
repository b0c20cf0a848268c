"""The async text frontend: ``open_llm`` and ``LLM`` over the engine-core client.

Text in, text out, as vLLM's ``AsyncLLM``, with the rules in the sans-I/O text layer
(`trio_vllm.text`). Importing this package does not import ``tokenizers`` or
``jinja2`` (the first model loaded does). The blocking twin, `SyncLLM`, lives with the
other blocking facades in `trio_vllm.sync`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._llm import LLM as LLM
from ._llm import open_llm as open_llm
from ._stream import RequestOutputStream as RequestOutputStream

if TYPE_CHECKING:
    from ..sync import SyncLLM as SyncLLM
    from ..sync import SyncRequestOutputStream as SyncRequestOutputStream

__all__ = ["LLM", "RequestOutputStream", "open_llm"]


def __getattr__(name: str) -> object:
    """``trio_vllm.llm.SyncLLM`` (and its stream) still resolve: they moved to
    `trio_vllm.sync`, which builds on this package (so it is imported on use only)."""
    if name in ("SyncLLM", "SyncRequestOutputStream"):
        from .. import sync

        return getattr(sync, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
