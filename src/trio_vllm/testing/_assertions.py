"""Assertions for the invariants a cancellation-safe program keeps.

Each raises ``AssertionError`` with a message that says what was left behind, so they
work as plain test assertions and as checks for
`check_cancellation`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import anyio

from ._clock import real_time
from ._control import EngineControl
from ._engines import ReferenceEngineSet

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable

    from .._exceptions import EngineDeadError
    from ..client import EngineCoreClient

__all__ = [
    "TaskSnapshot",
    "assert_client_dies",
    "assert_engine_idle",
    "assert_no_inflight_requests",
    "assert_no_task_leaks",
]


def assert_no_inflight_requests(client: EngineCoreClient) -> None:
    """Assert the client has no live request (stream or raw) and no pending utility call.

    Not a checkpoint. A stream that was left without leaving its ``generate`` block,
    or a utility call whose caller vanished, shows up here.
    """
    problems = []
    if client.live_requests:
        problems.append(f"live requests {client.live_requests}")
    if client.pending_utility_calls:
        problems.append(f"{client.pending_utility_calls} pending utility call(s)")
    if problems:
        raise AssertionError("the client still has " + " and ".join(problems))


def _controls(
    engines: ReferenceEngineSet | EngineControl | Iterable[EngineControl],
) -> list[EngineControl]:
    if isinstance(engines, ReferenceEngineSet):
        return list(engines.controls)
    if isinstance(engines, EngineControl):
        return [engines]
    return list(engines)


async def assert_engine_idle(
    engines: ReferenceEngineSet | EngineControl | Iterable[EngineControl],
    *,
    within: float = 10.0,
) -> None:
    """Assert every engine holds no request, asking the engines themselves.

    An abort travels on another socket than the control command, so this waits up to
    ``within`` (real) seconds for the engines to get there before failing. The wait is
    polled, so a generous default costs a passing test nothing and spares a loaded CI
    machine a false failure.
    """
    for control in _controls(engines):
        try:
            await control.wait_idle(within)
        except TimeoutError as exc:
            raise AssertionError(str(exc)) from None


async def assert_client_dies(client: EngineCoreClient, *, within: float) -> EngineDeadError:
    """Assert the client turns dead within ``within`` real seconds; return its error."""
    with real_time(), anyio.move_on_after(within):
        return await client.wait_dead()
    raise AssertionError(f"the client was still alive {within:g} s later")


class TaskSnapshot:
    """The tasks running now (anyio's view, both backends), to compare with later."""

    def __init__(self) -> None:
        self.ids = frozenset(task.id for task in anyio.get_running_tasks())

    def new_tasks(self) -> list[str]:
        """Names of the tasks running now that were not running at the snapshot."""
        return sorted(
            task.name or f"task {task.id}"
            for task in anyio.get_running_tasks()
            if task.id not in self.ids
        )

    async def assert_no_new_tasks(self, *, settle: float = 5.0) -> None:
        """Assert no task started since the snapshot is still running.

        Tasks get up to ``settle`` real seconds to finish (polled every 5 ms).
        """
        with real_time(), anyio.move_on_after(settle):
            while self.new_tasks():  # noqa: ASYNC110 - no event tells when tasks end
                await anyio.sleep(0.005)
        leaked = self.new_tasks()
        if leaked:
            raise AssertionError(f"task(s) still running: {leaked}")


@contextlib.asynccontextmanager
async def assert_no_task_leaks(*, settle: float = 5.0) -> AsyncIterator[TaskSnapshot]:
    """Assert that every task started inside the block has ended when it exits.

    Checked only when the block exits without an exception.
    """
    snapshot = TaskSnapshot()
    yield snapshot
    await snapshot.assert_no_new_tasks(settle=settle)
