"""Which event loop and thread own a client, and the check every public method makes.

A client's state (its events, pending calls, streams) belongs to the event loop that
opened it. Used from another thread or another loop it breaks in ways that surface far
from the mistake: trio's ``Event.set()`` asserts in the receive task and the client dies
for every caller, asyncio's caller hangs and leaks a pending call. So the client records
its owner when it is created and every public method compares first, raising
``RuntimeError`` naming the method before anything is sent or changed.

The owner is the triple (thread, asyncio loop, sniffio's thread-local library name):
the running asyncio loop tells an ``asyncio.run`` nested in trio's thread, the library
name (trio sets it to ``"trio"`` for the whole run, guest mode included; asyncio leaves
it unset) a ``trio.run`` nested in asyncio's thread; a second trio run cannot share a
thread with the first. All three are plain reads: the check sits on ``get_output``'s
path. (``trio.lowlevel.current_trio_token`` and ``in_trio_run`` cost more, the latter
raising internally outside a run; docs/performance.md.)
"""

from __future__ import annotations

import asyncio
import threading
from typing import Final

from sniffio import thread_local as _sniffio

__all__ = ["LoopOwner"]

_get_running_loop: Final = asyncio._get_running_loop  # C fast path, None outside a loop
_get_ident: Final = threading.get_ident


class LoopOwner:
    """The thread and event loop current at creation; `check` compares."""

    __slots__ = ("_asyncio_loop", "_library", "_thread", "_thread_name")

    def __init__(self) -> None:
        self._thread = _get_ident()
        self._thread_name = threading.current_thread().name
        self._asyncio_loop = _get_running_loop()
        self._library = _sniffio.name

    def check(self, method: str) -> None:
        """Raise ``RuntimeError`` naming ``method`` unless called from the owner loop.

        Synchronous and cheap (an identity comparison per part); not a checkpoint.
        """
        if _get_ident() != self._thread:
            what = f"EngineCoreClient.{method}()"
            raise RuntimeError(
                f"{what} was called from thread {threading.current_thread().name!r}; this "
                f"client belongs to the event loop of thread {self._thread_name!r} that "
                "opened it. Call it from that loop (from another thread: through "
                "anyio.from_thread or trio.from_thread with that loop's token, or use "
                "trio_vllm.SyncClient)"
            )
        if _get_running_loop() is not self._asyncio_loop or _sniffio.name != self._library:
            raise RuntimeError(
                f"EngineCoreClient.{method}() was called from another event loop than the "
                "one that opened this client (in the same thread); a client is bound to "
                "its loop"
            )
