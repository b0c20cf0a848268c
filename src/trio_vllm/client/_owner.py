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

__all__ = ["LoopOwner", "get_ident", "get_running_loop", "sniffio_local"]

_get_running_loop: Final = asyncio._get_running_loop  # C fast path, None outside a loop
_get_ident: Final = threading.get_ident
# The three reads of `LoopOwner.check`, for a caller that compares inline.
get_running_loop: Final = _get_running_loop
get_ident: Final = _get_ident
sniffio_local: Final = _sniffio


class LoopOwner:
    """The thread and event loop current at creation; `check` compares."""

    __slots__ = ("_thread_name", "asyncio_loop", "library", "thread")

    def __init__(self) -> None:
        # Read-only after creation; public so that the hottest caller (get_output) can
        # compare inline and call `check` only to raise.
        self.thread = _get_ident()
        self._thread_name = threading.current_thread().name
        self.asyncio_loop = _get_running_loop()
        self.library = _sniffio.name

    def check(self, method: str) -> None:
        """Raise ``RuntimeError`` naming ``method`` unless called from the owner loop.

        Synchronous and cheap (an identity comparison per part); not a checkpoint.
        """
        if _get_ident() != self.thread:
            what = f"EngineCoreClient.{method}()"
            raise RuntimeError(
                f"{what} was called from thread {threading.current_thread().name!r}; this "
                f"client belongs to the event loop of thread {self._thread_name!r} that "
                "opened it. Call it from that loop (from another thread: through "
                "anyio.from_thread or trio.from_thread with that loop's token, or use "
                "trio_vllm.SyncClient)"
            )
        if _get_running_loop() is not self.asyncio_loop or _sniffio.name != self.library:
            raise RuntimeError(
                f"EngineCoreClient.{method}() was called from another event loop than the "
                "one that opened this client (in the same thread); a client is bound to "
                "its loop"
            )
