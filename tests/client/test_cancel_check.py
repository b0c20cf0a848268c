"""The buffered paths' cancellation check (client/_cancel.py): the same answers as
anyio's public ``checkpoint_if_cancelled`` in every scope arrangement, on both backends
(on asyncio it reads anyio's scope state itself where that is known to be safe)."""

from __future__ import annotations

import threading

import anyio
import pytest
import sniffio

from trio_vllm.client import _cancel
from trio_vllm.client._mailbox import Mailbox

pytestmark = pytest.mark.anyio


async def _raises(check: object) -> bool:
    """Whether awaiting ``check()`` delivered a cancellation (caught by the scope)."""
    with anyio.CancelScope() as outer:
        outer.cancel()
        with anyio.CancelScope(shield=False):
            await check()  # type: ignore[operator]
    return outer.cancelled_caught


async def test_not_cancelled_returns_without_yielding() -> None:
    check = _cancel.backend_check()
    ran: list[int] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: _append(ran))
        for _ in range(3):
            await check()
        assert ran == []  # no checkpoint yielded to the started task
        with anyio.CancelScope():
            await check()
        assert ran == []


async def _append(ran: list[int]) -> None:
    ran.append(1)


async def test_cancelled_enclosing_scope_raises() -> None:
    assert await _raises(_cancel.backend_check())
    assert await _raises(anyio.lowlevel.checkpoint_if_cancelled)


async def test_nested_arrangements_match_anyio() -> None:
    check = _cancel.backend_check()
    public = anyio.lowlevel.checkpoint_if_cancelled
    for shield_middle in (False, True):
        for cancel_inner in (False, True):
            results = []
            for fn in (check, public):
                with anyio.CancelScope() as outer:
                    outer.cancel()
                    with anyio.CancelScope(shield=shield_middle):
                        with anyio.CancelScope() as inner:
                            if cancel_inner:
                                inner.cancel()
                            await fn()
                            results.append("returned")
                if outer.cancelled_caught or inner.cancelled_caught:
                    results.append("cancelled")
            assert results[: len(results) // 2] == results[len(results) // 2 :], (
                shield_middle,
                cancel_inner,
                results,
            )
            expect_cancel = cancel_inner or not shield_middle
            assert ("cancelled" in results) == expect_cancel


async def test_other_task_with_the_same_check() -> None:
    # One check object (one mailbox) used from two tasks: the second task's own
    # scopes decide, not what the first task's call saw.
    check = _cancel.backend_check()
    await check()
    caught: list[bool] = []

    async def other() -> None:
        caught.append(await _raises(check))

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
    assert caught == [True]
    await check()  # back in the first task, not cancelled


async def test_buffered_mailbox_call_cancelled_consumes_nothing() -> None:
    box: Mailbox[int] = Mailbox()
    box.put_nowait(1)
    box.put_nowait(2)
    assert await box.receive() == 1  # starts the interval: the next call only checks
    with anyio.CancelScope() as scope:
        scope.cancel()
        await box.receive()
    assert scope.cancelled_caught
    assert await box.receive() == 2


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_unknown_anyio_falls_back_to_the_public_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_cancel, "_KNOWN_ANYIO", ((0, 0), (0, 0)))
    monkeypatch.setattr(_cancel, "_probed", False)
    monkeypatch.setattr(_cancel, "_states", None)
    assert _cancel.asyncio_check() is anyio.lowlevel.checkpoint_if_cancelled


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_state_read_is_used_exactly_for_known_anyio() -> None:
    low, high = _cancel._KNOWN_ANYIO
    version = _cancel._anyio_version()
    known = version is not None and low <= version <= high
    uses_public = _cancel.asyncio_check() is anyio.lowlevel.checkpoint_if_cancelled
    assert uses_public is not known


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_unknown_trio_falls_back_to_the_public_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_cancel, "_KNOWN_TRIO", ((0, 0), (0, 0)))
    monkeypatch.setattr(_cancel, "_trio_probed", None)
    assert _cancel.backend_pending() is _cancel._always
    assert _cancel.backend_check() is anyio.lowlevel.checkpoint_if_cancelled
    assert await _raises(_cancel.backend_check())


async def test_the_pending_predicate_counts_a_cancel_point_like_the_public_call() -> None:
    """On trio the predicate is trio's own not-cancelled path (it counts the cancel
    point, as trio.testing.assert_checkpoints sees it); on both backends, in a task the
    backend knows, it answers False outside any cancelled scope and True inside one."""
    answers: list[bool] = []

    async def body() -> None:
        pending = _cancel.backend_pending()
        answers.append(pending())
        with anyio.CancelScope() as scope:  # noqa: ASYNC100 (the predicate reads it)
            scope.cancel()
            answers.append(pending())
        answers.append(pending())
        if sniffio.current_async_library() == "trio":
            import trio

            task = trio.lowlevel.current_task()
            before = task._cancel_points
            pending()
            answers.append(task._cancel_points == before + 1)

    async with anyio.create_task_group() as tg:
        tg.start_soon(body)
    assert answers[:3] == [False, True, False]
    assert all(answers[3:])


async def test_take_now_hands_out_only_what_needs_no_await() -> None:
    """get_output's fast path: None (await the mailbox) before the no-yield window
    opens and while a cancellation is pending; the item otherwise. None takes nothing."""
    box: Mailbox[int] = Mailbox()
    for item in (1, 2, 3):
        box.put_nowait(item)
    taken: list[int | None] = []

    async def body() -> None:  # in a task the backend knows (anyio's asyncio state)
        taken.append(box.take_now())  # the window is not open yet
        taken.append(await box.receive())  # opens it
        with anyio.CancelScope() as scope:  # noqa: ASYNC100 (take_now reads it)
            scope.cancel()
            taken.append(box.take_now())
        taken.append(box.take_now())
        taken.append(box.take_now())

    async with anyio.create_task_group() as tg:
        tg.start_soon(body)
    assert taken == [None, 1, None, 2, 3]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_main_task_outside_any_scope_takes_the_fast_path(backend: str) -> None:
    """anyio.run's main task before it enters any scope (on asyncio: a task state with
    no cancel scope) is not cancelled: the predicate says so itself, as anyio's own call
    finds, instead of sending every buffered receive to that call; a scope it enters
    and cancels is still seen."""

    async def main() -> list[object]:
        box: Mailbox[int] = Mailbox()
        for item in (1, 2, 3):
            box.put_nowait(item)
        pending = _cancel.backend_pending()
        answers: list[object] = [pending(), await box.receive(), box.take_now()]
        with anyio.CancelScope() as scope:  # noqa: ASYNC100 (the predicate reads it)
            scope.cancel()
            answers += [pending(), box.take_now()]
        answers += [pending(), box.take_now()]
        return answers

    answers = anyio.run(main, backend=backend)
    assert answers == [False, 1, 2, True, None, False, 3]


def test_an_asyncio_predicate_elsewhere_reads_the_calling_task() -> None:
    """The asyncio predicate keeps the loop it was made in (no running-loop lookup per
    call); from a later loop in the same thread it knows no task and defers to the
    public call (True), and from another thread's loop it reads that thread's task."""
    made: list[object] = []

    async def make() -> None:
        made.append(_cancel.asyncio_pending())

    anyio.run(make, backend="asyncio")
    pending = made[0]
    assert pending is not _cancel._always  # the known anyio release

    async def ask() -> list[object]:
        async with anyio.create_task_group():  # a task anyio knows, in a scope
            answers = [pending()]  # type: ignore[operator]
            with anyio.CancelScope() as scope:  # noqa: ASYNC100 (the predicate reads it)
                scope.cancel()
                answers.append(pending())  # type: ignore[operator]
            return answers

    assert anyio.run(ask, backend="asyncio") == [True, True]  # a later loop: defer

    results: list[object] = []
    thread = threading.Thread(target=lambda: results.append(anyio.run(ask, backend="asyncio")))
    anyio.run(make, backend="asyncio")  # made in this thread's loop, used in another's
    pending = made[1]
    thread.start()
    thread.join(10)
    assert results == [[False, True]]
