"""trio-vllm: a trio-native, anyio-compatible client for vLLM engine-core processes.

Layers, from the bottom: ``protocol`` (sans-I/O codec and state machines),
``transport`` (an anyio-native ZeroMQ socket), ``client`` (tasks, streams, engines).
This module only re-exports the public names.
"""

from __future__ import annotations

from ._exceptions import EngineDeadError as EngineDeadError
from ._exceptions import EngineStartupError as EngineStartupError
from ._exceptions import InsecureSerializationError as InsecureSerializationError
from ._exceptions import ProtocolError as ProtocolError
from ._exceptions import TrioVllmError as TrioVllmError
from ._exceptions import UnroutableError as UnroutableError
from ._exceptions import UtilityCallError as UtilityCallError
from ._version import __version__ as __version__
from .client import EngineCoreClient as EngineCoreClient
from .client import EngineSource as EngineSource
from .client import ExternalEngines as ExternalEngines
from .client import ReferenceEngines as ReferenceEngines
from .client import RequestStream as RequestStream
from .client import StartupProgress as StartupProgress
from .client import VllmEngines as VllmEngines
from .client import make_request as make_request
from .client import new_request_id as new_request_id
from .client import open_client as open_client
from .client import prepare_sampling_params as prepare_sampling_params
from .sync import SyncClient as SyncClient
from .sync import SyncRequestStream as SyncRequestStream
