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
