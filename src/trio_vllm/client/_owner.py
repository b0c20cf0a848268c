"""Which event loop and thread own a client, and the check every public method makes.

A client's state (its events, pending calls, streams) belongs to the event loop that
opened it. Used from another thread or another loop it breaks in ways that surface far
from the mistake: trio's ``Event.set()`` asserts in the receive task and the client dies
for every caller, asyncio's caller hangs and leaks a pending call. So the client records
its owner when it is created and every public method compares first, raising
``RuntimeError`` naming the method before anything is sent or changed.

The owner is the tuple (thread, trio run, asyncio loop): the trio token when a trio run
is current in the thread, the running asyncio loop when there is one. Comparing all
three tells apart a second thread, an ``asyncio.run`` or ``trio.run`` nested in the
owner's thread, and trio's guest mode (where both are current, legitimately).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Final

__all__ = ["LoopOwner"]

_get_running_loop: Final = asyncio._get_running_loop  # C fast path, None outside a loop


def _trio_token() -> object:
    trio = sys.modules.get("trio")
    if trio is None:  # trio never imported: no trio run can be current
        return None
    try:
        return trio.lowlevel.current_trio_token()
    except RuntimeError:
        return None


class LoopOwner:
    """The thread and event loop current at creation; :meth:`check` compares."""

    __slots__ = ("_asyncio_loop", "_thread", "_thread_name", "_trio_token")

    def __init__(self) -> None:
        self._thread = threading.get_ident()
        self._thread_name = threading.current_thread().name
        self._trio_token = _trio_token()
        self._asyncio_loop = _get_running_loop()

    def check(self, method: str) -> None:
        """Raise ``RuntimeError`` naming ``method`` unless called from the owner loop.

        Synchronous and cheap (an identity comparison per part); not a checkpoint.
        """
        if threading.get_ident() != self._thread:
            what = f"EngineCoreClient.{method}()"
            raise RuntimeError(
                f"{what} was called from thread {threading.current_thread().name!r}; this "
                f"client belongs to the event loop of thread {self._thread_name!r} that "
                "opened it. Call it from that loop (from another thread: through "
                "anyio.from_thread or trio.from_thread with that loop's token, or use "
                "trio_vllm.SyncClient)"
            )
        if _get_running_loop() is not self._asyncio_loop or _trio_token() is not self._trio_token:
            raise RuntimeError(
                f"EngineCoreClient.{method}() was called from another event loop than the "
                "one that opened this client (in the same thread); a client is bound to "
                "its loop"
            )
