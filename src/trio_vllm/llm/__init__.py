"""The async text frontend: ``open_llm`` and ``LLM`` over the engine-core client.

Text in, text out, as vLLM's ``AsyncLLM``, with the rules in the sans-I/O text layer
(:mod:`trio_vllm.text`). Importing this package does not import ``tokenizers`` or
``jinja2`` (the first model loaded does).
"""

from __future__ import annotations

from ._llm import LLM as LLM
from ._llm import open_llm as open_llm
from ._stream import RequestOutputStream as RequestOutputStream
from ._sync import SyncLLM as SyncLLM
from ._sync import SyncRequestOutputStream as SyncRequestOutputStream

__all__ = ["LLM", "RequestOutputStream", "SyncLLM", "SyncRequestOutputStream", "open_llm"]
