"""The per-call cancellation check of the buffered paths, per backend.

Every public receive call checks for cancellation, also when it returns at once from
what is buffered (documented; see `Mailbox`). That check is paid once per output on
the buffered path, so it is bound to the cheapest form that keeps the contract: a
plain function (`backend_pending`) that answers "certainly not cancelled" by reading
the backend's own cancel state, and hands every other case to anyio's public
``checkpoint_if_cancelled``, which yields and raises. A plain call, not a coroutine:
awaiting a coroutine per output was a visible part of a stream's cost (issue 25).

- trio: `trio_pending` reads the calling task's cancel status (``_cancel_status``,
  ``effectively_cancelled``, ``_runner.main_task``, ``ki_pending``) and counts the
  cancel point (``_cancel_points``), exactly what trio's own
  ``checkpoint_if_cancelled`` does when it does not yield.
- asyncio: `asyncio_pending` reads anyio's cancel scope state. anyio's public call costs
  several times more per call: a backend lookup through sniffio, then anyio's
  ``WeakKeyDictionary`` lookup (a new weakref per call) and its scope walk; this reads
  the same state through a weakref kept from the previous call (figures in
  docs/performance.md), through anyio's private asyncio internals (``_task_states``,
  ``TaskState.cancel_scope``, ``CancelScope._cancel_called``, ``_shield``,
  ``_parent_scope``).

Both read private internals, so each is used only for the releases whose source was
read and tested (`_KNOWN_TRIO`, `_KNOWN_ANYIO`) and after probing that the names exist;
otherwise every call goes to the public one. They can only err towards safety: the
raising is always the library's own, and a state they cannot read (a task anyio does
not know) goes to the public call too.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import types
import weakref
from typing import TYPE_CHECKING, Any, Final

import anyio.lowlevel

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["backend_check", "backend_pending", "checkpoint_if_cancelled"]

#: What a caller awaits when a pending predicate answers True: it yields and raises
#: if the calling task is cancelled, and returns otherwise.
checkpoint_if_cancelled: Final = anyio.lowlevel.checkpoint_if_cancelled

# anyio releases whose asyncio backend was read and tested with the code below (its own
# checkpoint_if_cancelled walks the same fields). Any other falls back to the public
# call until someone reads its source and widens this range.
_KNOWN_ANYIO: Final = ((4, 16), (4, 16))
# The same for trio (its checkpoint_if_cancelled reads the fields trio_pending reads).
_KNOWN_TRIO: Final = ((0, 35), (0, 35))


def _version(dist: str) -> tuple[int, int] | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return _parse(version(dist))
    except PackageNotFoundError:
        return None


def _parse(text: str) -> tuple[int, int] | None:
    try:
        major, minor = text.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def _anyio_version() -> tuple[int, int] | None:
    return _version("anyio")


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


def _always() -> bool:
    """The pending predicate where the backend's state cannot be read: always ask."""
    return True


def asyncio_pending() -> Callable[[], bool]:
    """A pending predicate for one consumer on asyncio (each mailbox binds its own: it
    remembers the last calling task): False only when anyio's scopes certainly do not
    cancel the calling task; True sends the caller to the public call."""
    global _states, _probed
    if not _probed:
        _states, _probed = _asyncio_states(), True
    data = _states
    if data is None:
        return _always
    current_task = asyncio.current_task
    # On Python 3.11 asyncio.current_task is a Python function around this dict (the
    # running loop -> its task); read it directly where it is that (~0.1 us per call).
    by_loop = vars(asyncio.tasks).get("_current_tasks")
    if isinstance(current_task, types.BuiltinFunctionType) or not isinstance(by_loop, dict):
        by_loop = None
    task_of = None if by_loop is None else by_loop.get  # bound once
    return _asyncio_pending(data, task_of, current_task)


def _asyncio_pending(
    data: Any, task_of: Any, current_task: Callable[[], asyncio.Task[Any] | None]
) -> Callable[[], bool]:
    """`asyncio_pending`'s predicate over anyio's task states ``data``: the calling task
    is ``task_of(loop)`` (asyncio's loop -> task dict's get), or, without it,
    ``current_task()``. Bound methods throughout: this runs on every buffered receive.

    ``loop`` is the loop running when the predicate is made (the consumer's), taken
    for the running one while the call comes from the same thread: asyncio's
    ``_get_running_loop`` makes a ``getpid()`` system call each time (~70 ns, its fork
    check). Sound because a thread runs at most one asyncio loop at a time and asyncio's
    dict holds a loop's task only while a step of that task runs: called from a task
    of ``loop``, ``task_of(loop)`` is the caller; called from anywhere else in this
    thread (a callback, a later loop), it is None, and None goes to the public call.
    From another thread the running loop is asked as before."""
    get_loop = asyncio._get_running_loop  # C; None outside a loop
    get_ident = threading.get_ident
    loop = get_loop()
    thread = get_ident() if loop is not None else None
    ref = weakref.ref
    get_state = data.get  # bound once: anyio's {weakref(task): TaskState}
    key: weakref.ref[asyncio.Task[Any]] | None = None

    def pending() -> bool:
        nonlocal key
        if task_of is None:
            task = current_task()
        elif get_ident() == thread:
            task = task_of(loop)
        else:
            task = task_of(get_loop())
        if key is None or key() is not task:
            if task is None:
                return True
            key = ref(task)
        # Read anew on every call: anyio replaces a task's state only when the task
        # starts or ends, but reading it costs one dict lookup with the kept key.
        state = get_state(key)
        if state is None:
            return True  # a task anyio does not know: its call decides
        # No scope at all (the main task of anyio.run outside any scope): nothing of
        # anyio's can cancel it, which is what anyio's own call finds there too (it
        # walks the same None and returns); it was sent to that call on every receive.
        scope = state.cancel_scope
        while scope is not None:
            if scope._cancel_called:
                return True  # cancelled: anyio's call raises
            if scope._shield:
                return False
            scope = scope._parent_scope
        return False

    return pending


def asyncio_check() -> Callable[[], Awaitable[None]]:
    """`asyncio_pending` as a check to await (anyio's public call where the state is not
    read)."""
    pending = asyncio_pending()
    if pending is _always:
        return checkpoint_if_cancelled
    return _awaitable(pending)


def _awaitable(pending: Callable[[], bool]) -> Callable[[], Awaitable[None]]:
    async def check() -> None:
        if pending():
            await checkpoint_if_cancelled()

    return check


_trio_probed: Callable[[], bool] | None = None


def _trio_pending_for(trio: Any) -> Callable[[], bool]:
    """`trio_pending` if trio's internals are the known ones, else `_always`."""
    found = _parse(getattr(trio, "__version__", ""))
    if found is None or not _KNOWN_TRIO[0] <= found <= _KNOWN_TRIO[1]:
        return _always
    current_task = trio.lowlevel.current_task
    try:
        task = current_task()
        probe = (
            task._cancel_status.effectively_cancelled,
            task._runner.main_task,
            task._runner.ki_pending,
            task._cancel_points,
        )
    except (AttributeError, RuntimeError):
        return _always
    if not isinstance(probe[0], bool) or not isinstance(probe[3], int):
        return _always
    # The calling task as current_task reads it (trio's run context, a thread-local),
    # without current_task's Python frame: one call per buffered receive less.
    context: Any
    try:
        from trio._core._run_context import GLOBAL_RUN_CONTEXT as context
    except ImportError:
        context = None
    if getattr(context, "task", None) is not task:
        return _trio_pending_calling(current_task)

    def trio_pending() -> bool:
        try:
            task = context.task
        except AttributeError:
            return True  # not in a trio task: the public call says what is wrong
        if task._cancel_status.effectively_cancelled or (
            task is task._runner.main_task and task._runner.ki_pending
        ):
            return True  # trio's call yields and raises
        task._cancel_points += 1  # what trio's call counts when it does not yield
        return False

    return trio_pending


def _trio_pending_calling(current_task: Callable[[], Any]) -> Callable[[], bool]:
    """`trio_pending` through trio's public current_task (its run context not found)."""

    def trio_pending() -> bool:
        task = current_task()
        if task._cancel_status.effectively_cancelled or (
            task is task._runner.main_task and task._runner.ki_pending
        ):
            return True  # trio's call yields and raises
        task._cancel_points += 1  # what trio's call counts when it does not yield
        return False

    return trio_pending


def backend_pending() -> Callable[[], bool]:
    """The running backend's pending predicate (see the module docs): call it, and
    await `checkpoint_if_cancelled` when it returns True.

    trio is looked up, not imported: no trio task can run before trio is imported, and
    the client must import where only anyio is installed (the in-process adapter runs in
    vLLM's own interpreter, which has no trio)."""
    global _trio_probed
    trio = sys.modules.get("trio")
    if trio is not None and trio.lowlevel.in_trio_task():
        if _trio_probed is None:
            _trio_probed = _trio_pending_for(trio)
        return _trio_probed
    return asyncio_pending()


def backend_check() -> Callable[[], Awaitable[None]]:
    """`backend_pending` as a check to await (for callers that want one awaitable)."""
    pending = backend_pending()
    if pending is _always:
        return checkpoint_if_cancelled
    return _awaitable(pending)
