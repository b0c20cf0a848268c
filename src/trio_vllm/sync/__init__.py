"""The blocking facades, in one place: `SyncClient` (the raw client, vLLM's
``SyncMPClient`` shape) and `SyncLLM` (the text frontend), each with its blocking
streams, both over one event-loop thread (``_loop.py``).

Public names are re-exported from `trio_vllm`.
"""

from __future__ import annotations

from .._public import publish
from ._client import SyncClient as SyncClient
from ._client import SyncEngineEvents as SyncEngineEvents
from ._client import SyncRequestStream as SyncRequestStream
from ._llm import SyncLLM as SyncLLM
from ._llm import SyncRequestOutputStream as SyncRequestOutputStream

__all__ = [
    "SyncClient",
    "SyncEngineEvents",
    "SyncLLM",
    "SyncRequestOutputStream",
    "SyncRequestStream",
]

publish("trio_vllm", globals(), __all__)
