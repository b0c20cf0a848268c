"""The per-call cancellation check of the buffered paths, per backend.

Every public receive call checks for cancellation, also when it returns at once from
what is buffered (documented; see `Mailbox`). That check is paid once per output on
the buffered path, so it is bound to the cheapest form that keeps the contract:

- trio: trio's own ``checkpoint_if_cancelled``, skipping anyio's dispatch.
- asyncio: `asyncio_check`, which answers "nothing to do" by reading anyio's cancel
  scope state itself and hands every other case to anyio's public
  ``checkpoint_if_cancelled``. The public call costs several times more per call: a
  backend lookup through sniffio, then anyio's ``WeakKeyDictionary``
  lookup (a new weakref per call) and its scope walk. `asyncio_check` reads the same
  state through a weakref kept from the previous call (figures in
  docs/performance.md). That needs anyio's private asyncio internals
  (``_task_states``, ``TaskState.cancel_scope``, ``CancelScope._cancel_called``,
  ``_shield``, ``_parent_scope``), so it is used only for the anyio versions whose
  internals were read and tested (`_KNOWN_ANYIO`) and after probing that the names
  exist; otherwise the public call is used. It can only err towards safety: the
  raising is always anyio's, and a state it cannot read (a task anyio does not know)
  goes to the public call too.
"""

from __future__ import annotations

import asyncio
import sys
import weakref
from typing import TYPE_CHECKING, Any, Final

import anyio.lowlevel

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["backend_check"]

# anyio releases whose asyncio backend was read and tested with the code below (its own
# checkpoint_if_cancelled walks the same fields). Any other falls back to the public
# call until someone reads its source and widens this range.
_KNOWN_ANYIO: Final = ((4, 16), (4, 16))


def _anyio_version() -> tuple[int, int] | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = version("anyio").split(".")[:2]
        return int(major), int(minor)
    except (PackageNotFoundError, ValueError):
        return None


def _asyncio_states() -> Any:
    """anyio's task-state map if its internals are the known ones, else None."""
    found = _anyio_version()
    if found is None or not _KNOWN_ANYIO[0] <= found <= _KNOWN_ANYIO[1]:
        return None
    try:
        from anyio._backends import _asyncio as backend

        states = backend._task_states
        data = vars(states).get("data")  # its own dict: {weakref(task): TaskState}
        slots = backend.TaskState.__slots__
        scope = backend.CancelScope()
        probe = (scope._cancel_called, scope._shield, scope._parent_scope)
    except (ImportError, AttributeError):
        return None
    if not isinstance(data, dict) or "cancel_scope" not in slots or probe != (False, False, None):
        return None
    return data


_states: Any = None
_probed = False


def asyncio_check() -> Callable[[], Awaitable[None]]:
    """A cancellation check for one consumer on asyncio (each mailbox binds its own:
    it remembers the last calling task). Same contract as anyio's
    ``checkpoint_if_cancelled``: no yield unless cancelled; if cancelled, anyio's
    call raises."""
    global _states, _probed
    if not _probed:
        _states, _probed = _asyncio_states(), True
    public = anyio.lowlevel.checkpoint_if_cancelled
    data = _states
    if data is None:
        return public
    current_task = asyncio.current_task
    ref = weakref.ref
    key: weakref.ref[asyncio.Task[Any]] | None = None

    async def check() -> None:
        nonlocal key
        task = current_task()
        if key is None or key() is not task:
            if task is None:
                return await public()
            key = ref(task)
        # Read anew on every call: anyio replaces a task's state only when the task
        # starts or ends, but reading it costs one dict lookup with the kept key.
        state = data.get(key)
        scope = None if state is None else state.cancel_scope
        if scope is None:
            return await public()  # a task anyio does not know: its call decides
        while scope is not None:
            if scope._cancel_called:
                return await public()  # cancelled: anyio's call raises
            if scope._shield:
                return None
            scope = scope._parent_scope
        return None

    return check


def backend_check() -> Callable[[], Awaitable[None]]:
    """The running backend's cancellation check (see the module docs).

    trio is looked up, not imported: no trio task can run before trio is imported, and
    the client must import where only anyio is installed (the in-process adapter runs in
    vLLM's own interpreter, which has no trio)."""
    trio = sys.modules.get("trio")
    if trio is not None and trio.lowlevel.in_trio_task():
        check: Callable[[], Awaitable[None]] = trio.lowlevel.checkpoint_if_cancelled
        return check
    return asyncio_check()
