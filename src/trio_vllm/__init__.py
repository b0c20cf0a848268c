"""trio-vllm: a trio-native, anyio-compatible client for vLLM engine-core processes.

Layers, from the bottom: ``protocol`` (sans-I/O codec and state machines),
``transport`` (an anyio-native ZeroMQ socket), ``client`` (tasks, streams, engines).
This module only re-exports the public names.
"""

from __future__ import annotations

from ._exceptions import EngineDeadError as EngineDeadError
from ._exceptions import EngineStartupError as EngineStartupError
from ._exceptions import InsecureSerializationError as InsecureSerializationError
from ._exceptions import InvalidRequestError as InvalidRequestError
from ._exceptions import ProtocolError as ProtocolError
from ._exceptions import TrioVllmError as TrioVllmError
from ._exceptions import UnroutableError as UnroutableError
from ._exceptions import UtilityCallError as UtilityCallError
from ._public import publish
from ._version import __version__ as __version__

# Not ``from typing import TYPE_CHECKING``: typing costs more to import than the rest of
# this module (mypy knows the name either way).
TYPE_CHECKING = False
if TYPE_CHECKING:
    # Loaded on first use (__getattr__ below). The protocol layer pulls in msgspec and
    # numpy (the slow part of the import), the client anyio (and trio): ``import
    # trio_vllm`` itself stays a few pure-Python modules, so the ``trio-vllm`` command
    # is inside its Ctrl-C handler before anything heavy is imported, and engine
    # processes (python -m trio_vllm.reference_engine) never load the client.
    from typing import Any

    from .client import AttachedEngines as AttachedEngines
    from .client import ClientOptions as ClientOptions
    from .client import EngineAttachment as EngineAttachment
    from .client import EngineCoreClient as EngineCoreClient
    from .client import EngineEvent as EngineEvent
    from .client import EngineEvents as EngineEvents
    from .client import EngineSource as EngineSource
    from .client import ExternalEngines as ExternalEngines
    from .client import ReferenceEngines as ReferenceEngines
    from .client import RequestStream as RequestStream
    from .client import SharedEngines as SharedEngines
    from .client import StartupProgress as StartupProgress
    from .client import VllmEngines as VllmEngines
    from .client import make_pooling_request as make_pooling_request
    from .client import make_request as make_request
    from .client import new_request_id as new_request_id
    from .client import open_client as open_client
    from .client import open_shared_engines as open_shared_engines
    from .client import prepare_pooling_params as prepare_pooling_params
    from .client import prepare_sampling_params as prepare_sampling_params
    from .inproc import InprocEngine as InprocEngine
    from .llm import LLM as LLM
    from .llm import RequestOutputStream as RequestOutputStream
    from .llm import open_llm as open_llm
    from .protocol import ENGINE_CORE_DEAD as ENGINE_CORE_DEAD
    from .protocol import PROFILES as PROFILES
    from .protocol import ClientCodec as ClientCodec
    from .protocol import EngineCodec as EngineCodec
    from .protocol import EngineCoreEvent as EngineCoreEvent
    from .protocol import EngineCoreEventType as EngineCoreEventType
    from .protocol import EngineCoreOutput as EngineCoreOutput
    from .protocol import EngineCoreOutputs as EngineCoreOutputs
    from .protocol import EngineCoreReadyResponse as EngineCoreReadyResponse
    from .protocol import EngineCoreRequest as EngineCoreRequest
    from .protocol import FinishReason as FinishReason
    from .protocol import LogprobsLists as LogprobsLists
    from .protocol import LogprobsTensors as LogprobsTensors
    from .protocol import LoRARequest as LoRARequest
    from .protocol import PoolingParams as PoolingParams
    from .protocol import ProtocolProfile as ProtocolProfile
    from .protocol import RawTensor as RawTensor
    from .protocol import RequestOutputKind as RequestOutputKind
    from .protocol import RequestType as RequestType
    from .protocol import SamplingParams as SamplingParams
    from .protocol import SchedulerStats as SchedulerStats
    from .protocol import StructuredOutputsParams as StructuredOutputsParams
    from .protocol import UtilityOutput as UtilityOutput
    from .protocol import UtilityResult as UtilityResult
    from .protocol import profile_for_version as profile_for_version
    from .protocol import validate_request as validate_request
    from .sync import SyncClient as SyncClient
    from .sync import SyncEngineEvents as SyncEngineEvents
    from .sync import SyncLLM as SyncLLM
    from .sync import SyncRequestOutputStream as SyncRequestOutputStream
    from .sync import SyncRequestStream as SyncRequestStream
    from .text import CompletionOutput as CompletionOutput
    from .text import Logprob as Logprob
    from .text import ModelFiles as ModelFiles
    from .text import RequestOutput as RequestOutput
    from .text import SamplingDefaults as SamplingDefaults
    from .text import TextPrompt as TextPrompt
    from .text import Tokenizer as Tokenizer
    from .text import TokensPrompt as TokensPrompt

_LAZY: dict[str, str] = {
    "ENGINE_CORE_DEAD": ".protocol",
    "PROFILES": ".protocol",
    "ClientCodec": ".protocol",
    "EngineCodec": ".protocol",
    "EngineCoreEvent": ".protocol",
    "EngineCoreEventType": ".protocol",
    "EngineCoreOutput": ".protocol",
    "EngineCoreOutputs": ".protocol",
    "EngineCoreReadyResponse": ".protocol",
    "EngineCoreRequest": ".protocol",
    "FinishReason": ".protocol",
    "LogprobsLists": ".protocol",
    "LogprobsTensors": ".protocol",
    "LoRARequest": ".protocol",
    "PoolingParams": ".protocol",
    "ProtocolProfile": ".protocol",
    "RawTensor": ".protocol",
    "RequestOutputKind": ".protocol",
    "RequestType": ".protocol",
    "SamplingParams": ".protocol",
    "SchedulerStats": ".protocol",
    "StructuredOutputsParams": ".protocol",
    "UtilityOutput": ".protocol",
    "UtilityResult": ".protocol",
    "profile_for_version": ".protocol",
    "validate_request": ".protocol",
    "AttachedEngines": ".client",
    "EngineAttachment": ".client",
    "SharedEngines": ".client",
    "open_shared_engines": ".client",
    "EngineCoreClient": ".client",
    "EngineEvent": ".client",
    "EngineEvents": ".client",
    "EngineSource": ".client",
    "ClientOptions": ".client",
    "ExternalEngines": ".client",
    "ReferenceEngines": ".client",
    "RequestStream": ".client",
    "StartupProgress": ".client",
    "VllmEngines": ".client",
    "make_pooling_request": ".client",
    "make_request": ".client",
    "new_request_id": ".client",
    "open_client": ".client",
    "prepare_pooling_params": ".client",
    "prepare_sampling_params": ".client",
    "InprocEngine": ".inproc",
    "SyncClient": ".sync",
    "SyncEngineEvents": ".sync",
    "SyncRequestStream": ".sync",
    "SyncLLM": ".sync",
    "SyncRequestOutputStream": ".sync",
    "LLM": ".llm",
    "RequestOutputStream": ".llm",
    "open_llm": ".llm",
    "CompletionOutput": ".text",
    "Logprob": ".text",
    "ModelFiles": ".text",
    "RequestOutput": ".text",
    "SamplingDefaults": ".text",
    "TextPrompt": ".text",
    "Tokenizer": ".text",
    "TokensPrompt": ".text",
}

_LAZY_SUBMODULES = frozenset({"client", "llm", "protocol", "sync", "text", "transport"})

__all__ = [
    "EngineDeadError",
    "EngineStartupError",
    "InsecureSerializationError",
    "InvalidRequestError",
    "ProtocolError",
    "TrioVllmError",
    "UnroutableError",
    "UtilityCallError",
    "__version__",
    *_LAZY,
]


publish(__name__, globals(), __all__)


def __getattr__(name: str) -> Any:
    """PEP 562: import a public name's module on first access; every public name of
    that module is then published and cached here."""
    import importlib

    if name in _LAZY_SUBMODULES:  # ``import trio_vllm; trio_vllm.client`` worked before
        submodule = importlib.import_module(f".{name}", __name__)
        if f".{name}" in _LAZY.values():
            _load(f".{name}", submodule)
        return submodule
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _load(module, importlib.import_module(module, __name__))
    return globals()[name]


def _load(module: str, namespace: object) -> None:
    # All of a module's names at once: ``trio_vllm.protocol``'s classes say
    # ``trio_vllm`` in their ``__module__`` after any first use, as when it was eager.
    names = [n for n, m in _LAZY.items() if m == module]
    values = {n: getattr(namespace, n) for n in names}
    publish(__name__, values, names)
    globals().update(values)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
