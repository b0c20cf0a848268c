"""anyio-native ZeroMQ transport: one async socket type plus endpoint helpers.

Public names:

* `AsyncSocket` wraps and owns a ``zmq.Socket`` for trio, asyncio and uvloop
  (through anyio). Receive with `receive_batch` (the main path) or
  `receive`; send with `send`,
  `send_nowait`, `send_many` or
  `send_tracked` plus `wait_tracker`. Options only through
  `get_option` / `set_option`.
* `tcp_endpoint`, `normalize_endpoint`, `is_ipv6_endpoint`,
  `PrivateIpcDir`: endpoint strings.

This layer knows sockets and the event loop, nothing about vLLM. See
``docs/transport.md`` for the design and the cancellation contract.
"""

from __future__ import annotations

from ._endpoints import PrivateIpcDir as PrivateIpcDir
from ._endpoints import is_ipv6_endpoint as is_ipv6_endpoint
from ._endpoints import normalize_endpoint as normalize_endpoint
from ._endpoints import tcp_endpoint as tcp_endpoint
from ._socket import DEFAULT_BATCH_BYTES as DEFAULT_BATCH_BYTES
from ._socket import DEFAULT_COPY_THRESHOLD as DEFAULT_COPY_THRESHOLD
from ._socket import AsyncSocket as AsyncSocket
from ._socket import InFrame as InFrame
from ._socket import OutFrame as OutFrame
from ._socket import wait_tracker as wait_tracker

__all__ = [
    "DEFAULT_BATCH_BYTES",
    "DEFAULT_COPY_THRESHOLD",
    "AsyncSocket",
    "InFrame",
    "OutFrame",
    "PrivateIpcDir",
    "is_ipv6_endpoint",
    "normalize_endpoint",
    "tcp_endpoint",
    "wait_tracker",
]
