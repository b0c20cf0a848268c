"""The structured-concurrency client: `open_client`, engine sources, streams.

Public names are re-exported from `trio_vllm`.
"""

from __future__ import annotations

from .._public import publish
from ._client import EngineCoreClient as EngineCoreClient
from ._client import EngineEvent as EngineEvent
from ._client import EngineEvents as EngineEvents
from ._client import StartupProgress as StartupProgress
from ._client import open_client as open_client
from ._engines import EngineSource as EngineSource
from ._engines import ExternalEngines as ExternalEngines
from ._engines import ReferenceEngines as ReferenceEngines
from ._engines import VllmEngines as VllmEngines
from ._options import ClientOptions as ClientOptions
from ._prepare import make_pooling_request as make_pooling_request
from ._prepare import make_request as make_request
from ._prepare import new_request_id as new_request_id
from ._prepare import prepare_pooling_params as prepare_pooling_params
from ._prepare import prepare_sampling_params as prepare_sampling_params
from ._shared import AttachedEngines as AttachedEngines
from ._shared import EngineAttachment as EngineAttachment
from ._shared import SharedEngines as SharedEngines
from ._shared import open_shared_engines as open_shared_engines
from ._streams import RequestStream as RequestStream

__all__ = [
    "AttachedEngines",
    "ClientOptions",
    "EngineAttachment",
    "EngineCoreClient",
    "EngineEvent",
    "EngineEvents",
    "EngineSource",
    "ExternalEngines",
    "ReferenceEngines",
    "RequestStream",
    "SharedEngines",
    "StartupProgress",
    "VllmEngines",
    "make_pooling_request",
    "make_request",
    "new_request_id",
    "open_client",
    "open_shared_engines",
    "prepare_pooling_params",
    "prepare_sampling_params",
]

publish("trio_vllm", globals(), __all__)
