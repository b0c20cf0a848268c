"""Cancel user code at every checkpoint and check what it leaves behind.

Design: the scenario's coroutine is driven by a thin stepping wrapper (`_Stepper`)
that forwards every value the coroutine yields to the event loop, and everything the
loop sends or throws back, unchanged, counting the yields. A yield is where a task
gives control to the event loop: a checkpoint on trio (a schedule point or a block), an
``await`` of a future or ``sleep(0)`` on asyncio. A first run counts them; run *k* then
cancels an anyio cancel scope around the scenario at its *k*-th yield, just before the
yield reaches the event loop, so the cancellation lands at that checkpoint (or the next
unshielded one). The same wrapper works on trio and asyncio because it never interprets
what it forwards.

Limits: only the task that runs the scenario is counted; tasks it starts in its own
task groups are cancelled with it but their checkpoints are not enumerated. The number
of yields depends on timing (a wait that finds its data ready yields once, one that
blocks may yield more), so run *k* may end before its *k*-th yield; it is then reported
as ``returned`` with ``cancel_requested`` false. A cancellation that lands in a shielded
section is delivered at the next unshielded checkpoint, or never if there is none.
"""

from __future__ import annotations

import inspect
import os
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import anyio

import trio_vllm

from ._assertions import TaskSnapshot, _controls
from ._clock import real_time

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable, Sequence

    from ..client import EngineCoreClient
    from ._control import EngineControl
    from ._engines import ReferenceEngineSet

__all__ = ["CancellationReport", "CheckpointRun", "Violation", "check_cancellation"]

Outcome = Literal["returned", "cancelled", "raised", "timed out"]


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant: the check's name and what it found."""

    check: str
    message: str

    def __str__(self) -> str:
        return f"{self.check}: {self.message}"


@dataclass(slots=True)
class CheckpointRun:
    """One run of the scenario.

    Attributes:
        checkpoint: the checkpoint it was cancelled at (1-based); ``None`` for the
            first, uncancelled run that counts them.
        checkpoints_seen: yields the scenario's task made in this run.
        cancel_requested: the run reached ``checkpoint`` and the cancellation was
            requested there.
        outcome: ``"cancelled"``, ``"returned"`` (finished normally: it ended before
            the checkpoint, the cancellation landed in a shielded section, or the
            scenario itself handled what the cancellation caused, e.g. a suppressed
            disconnect; ``cancel_requested`` tells these apart),
            ``"raised"`` (an exception other than the cancellation escaped) or
            ``"timed out"`` (``run_timeout`` passed).
        error: the exception for ``"raised"``.
        where: the await stack at the cancellation point, outermost first
            (``"file:line in function"``).
        violations: the invariants this run broke.
    """

    checkpoint: int | None
    checkpoints_seen: int = 0
    cancel_requested: bool = False
    outcome: Outcome = "returned"
    error: BaseException | None = None
    where: tuple[str, ...] = ()
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def location(self) -> str:
        """Where the cancellation was requested: the innermost frame outside the event
        loop libraries and trio-vllm, plus the innermost trio-vllm frame if any."""
        if not self.where:
            return "?"
        user = [w for w in self.where if not _is_library(w)]
        ours = [w for w in self.where if _in_package(w, _TRIO_VLLM_DIR)]
        text = _short(user[-1]) if user else _short(self.where[-1])
        if ours:
            text += f" (in {_short(ours[-1])})"
        return text

    def describe(self) -> str:
        head = (
            "uncancelled run"
            if self.checkpoint is None
            else f"checkpoint {self.checkpoint} at {self.location}"
        )
        lines = [f"{head}: {self.outcome}"]
        if self.error is not None:
            lines[0] += f" ({type(self.error).__name__}: {self.error})"
        lines += [f"    {v}" for v in self.violations]
        return "\n".join(lines)


@dataclass(slots=True)
class CancellationReport:
    """What `check_cancellation` found.

    Attributes:
        checkpoints: yields counted in the first, uncancelled run.
        runs: every run, the uncancelled one first.
        stopped: why the harness stopped early (``None`` if it ran every checkpoint).
    """

    checkpoints: int
    runs: list[CheckpointRun] = field(default_factory=list)
    stopped: str | None = None

    @property
    def failures(self) -> list[CheckpointRun]:
        """The runs that broke at least one invariant."""
        return [r for r in self.runs if r.violations]

    @property
    def ok(self) -> bool:
        return not self.failures and self.stopped is None

    def broken_at(self, check: str | None = None) -> list[int | None]:
        """Checkpoints whose run broke ``check`` (any check if ``None``)."""
        return [
            r.checkpoint
            for r in self.failures
            if check is None or any(v.check == check for v in r.violations)
        ]

    def assert_ok(self) -> None:
        """Raise ``AssertionError`` with the report if any run broke an invariant."""
        if not self.ok:
            raise AssertionError(str(self))

    def __str__(self) -> str:
        cancelled = sum(r.cancel_requested for r in self.runs)
        lines = [
            f"cancellation check: {self.checkpoints} checkpoint(s), {len(self.runs)} run(s) "
            f"({cancelled} cancelled), {len(self.failures)} failing"
        ]
        lines += [r.describe() for r in self.failures]
        if self.stopped:
            lines.append(f"stopped early: {self.stopped}")
        return "\n".join(lines)


# ---------------------------------------------------------------------- the driver


class _Counter:
    def __init__(self, cancel_at: int | None) -> None:
        self.cancel_at = cancel_at
        self.yields = 0
        self.requested = False
        self.where: tuple[str, ...] = ()
        self.scope: anyio.CancelScope | None = None

    def on_yield(self, coro: Any) -> None:
        self.yields += 1
        if self.yields == self.cancel_at and self.scope is not None:
            self.requested = True
            self.where = _await_stack(coro)
            self.scope.cancel()


class _Stepper:
    """Await ``coro`` while counting its yields to the event loop (see module doc)."""

    def __init__(self, coro: Coroutine[Any, Any, Any], counter: _Counter) -> None:
        self._coro = coro
        self._counter = counter

    def __await__(self) -> Generator[Any, Any, Any]:
        coro = self._coro
        send: Any = None
        error: BaseException | None = None
        try:
            while True:
                try:
                    if error is None:
                        yielded = coro.send(send)
                    else:
                        thrown, error = error, None
                        yielded = coro.throw(thrown)
                except StopIteration as stop:
                    return stop.value
                self._counter.on_yield(coro)
                send = None
                try:
                    send = yield yielded
                except GeneratorExit:
                    raise
                except BaseException as exc:  # the loop throws in cancellations etc.
                    error = exc
        finally:
            coro.close()


def _await_stack(obj: Any) -> tuple[str, ...]:
    frames: list[str] = []
    frame: types.FrameType | None = None
    for _ in range(200):
        if obj is None:
            break
        inner = (
            getattr(obj, "cr_frame", None)
            or getattr(obj, "gi_frame", None)
            or getattr(obj, "ag_frame", None)
        )
        if isinstance(inner, types.FrameType):
            frame = inner
            code = frame.f_code
            frames.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
        following = (
            getattr(obj, "cr_await", None)
            or getattr(obj, "gi_yieldfrom", None)
            or getattr(obj, "ag_await", None)
        )
        if following is None and frame is not None and not hasattr(obj, "cr_await"):
            # An async generator's asend/athrow awaitable hides its generator; the
            # common case is an @asynccontextmanager, whose frame holds it as self.gen.
            owner = frame.f_locals.get("self")
            gen = getattr(owner, "gen", None)
            if gen is not None and hasattr(gen, "ag_frame") and gen is not obj:
                following = gen
        obj = following
    return tuple(frames)


def _package_dir(module: types.ModuleType) -> str:
    return os.path.dirname(os.path.abspath(str(module.__file__))) + os.sep


_TRIO_VLLM_DIR = _package_dir(trio_vllm)
_LIBRARY_DIRS: tuple[str, ...] = ()


def _library_dirs() -> tuple[str, ...]:
    global _LIBRARY_DIRS
    if not _LIBRARY_DIRS:
        import asyncio
        import contextlib

        import trio

        dirs = [_package_dir(m) for m in (anyio, trio, asyncio)]
        dirs.append(os.path.abspath(str(contextlib.__file__)))
        dirs.append(_TRIO_VLLM_DIR)
        _LIBRARY_DIRS = tuple(dirs)
    return _LIBRARY_DIRS


def _in_package(where: str, directory: str) -> bool:
    return where.startswith(directory)


def _is_library(where: str) -> bool:
    return any(where.startswith(d) for d in _library_dirs())


def _short(where: str) -> str:
    path, sep, rest = where.partition(":")
    if path.startswith(_TRIO_VLLM_DIR):
        return "trio_vllm/" + path[len(_TRIO_VLLM_DIR) :] + sep + rest
    try:
        rel = os.path.relpath(path)
    except ValueError:
        rel = path
    return (rel if not rel.startswith("..") else path) + sep + rest


# ---------------------------------------------------------------------- the harness


@dataclass(slots=True)
class _Baseline:
    live: frozenset[str]
    pending: int
    engine_requests: int
    tasks: TaskSnapshot


class _Harness:
    def __init__(
        self,
        scenario: Callable[[], Awaitable[object]],
        client: EngineCoreClient | None,
        controls: Sequence[EngineControl],
        checks: Sequence[Callable[[CheckpointRun], object]],
        default_checks: bool,
        settle: float,
        run_timeout: float,
        repair: bool,
        allowed_exceptions: tuple[type[BaseException], ...],
    ) -> None:
        self.scenario = scenario
        self.client = client
        self.controls = controls
        self.checks = checks
        self.default_checks = default_checks
        self.settle = settle
        self.run_timeout = run_timeout
        self.repair = repair
        self.allowed_exceptions = allowed_exceptions
        self.abandoned: set[str] = set()  # ids the harness aborted (still listed as live)

    async def engine_requests(self) -> int:
        return sum([(await c.status()).requests for c in self.controls])

    async def baseline(self) -> _Baseline:
        client = self.client
        return _Baseline(
            live=frozenset(client.live_requests) if client is not None else frozenset(),
            pending=client.pending_utility_calls if client is not None else 0,
            engine_requests=await self.engine_requests() if self.controls else 0,
            tasks=TaskSnapshot(),
        )

    async def run(self, cancel_at: int | None) -> CheckpointRun:
        if self.client is not None and self.client.dead:
            raise RuntimeError("the client is dead; the harness needs a live client")
        base = await self.baseline()
        counter = _Counter(cancel_at)
        run = CheckpointRun(checkpoint=cancel_at)
        coro = self.scenario()
        if not inspect.iscoroutine(coro):
            raise TypeError(f"the scenario must be an async function, got {coro!r}")
        with anyio.move_on_after(self.run_timeout) as deadline:
            try:
                with anyio.CancelScope() as scope:
                    counter.scope = scope
                    await _Stepper(coro, counter)
            except (KeyboardInterrupt, SystemExit):
                raise
            except anyio.get_cancelled_exc_class():
                raise  # not ours: the run timeout's, or the caller's
            except BaseException as exc:
                run.error = exc
        run.checkpoints_seen = counter.yields
        run.cancel_requested = counter.requested
        run.where = counter.where
        if run.error is not None:
            run.outcome = "raised"
            if not isinstance(run.error, self.allowed_exceptions):
                run.violations.append(
                    Violation("exception", f"{type(run.error).__name__}: {run.error}")
                )
        elif deadline.cancelled_caught:
            run.outcome = "timed out"
            run.violations.append(
                Violation("timeout", f"the run did not end within {self.run_timeout:g} s")
            )
        elif scope.cancelled_caught:
            run.outcome = "cancelled"
        if self.default_checks:
            run.violations += await self.check_defaults(base)
        for check in self.checks:
            try:
                result = check(run)
                if inspect.isawaitable(result):
                    await result
            except AssertionError as exc:
                name = getattr(check, "__name__", type(check).__name__)
                run.violations.append(Violation(name, str(exc) or "assertion failed"))
        if self.repair:
            await self.tidy_up(base)
        return run

    async def check_defaults(self, base: _Baseline) -> list[Violation]:
        found: list[Violation] = []
        client = self.client
        if client is not None:
            new = [r for r in client.live_requests if r not in base.live]
            if new:
                found.append(
                    Violation(
                        "client-requests",
                        f"request(s) {new} still live on the client (a stream left open, "
                        "or a raw request neither finished nor aborted)",
                    )
                )
            if client.pending_utility_calls > base.pending:
                found.append(
                    Violation(
                        "client-calls",
                        f"{client.pending_utility_calls - base.pending} utility call(s) "
                        "still pending on the client",
                    )
                )
            if client.dead:
                found.append(Violation("client-dead", "the run left the client dead"))
        if self.controls and not (client is not None and client.dead):
            allowed = (
                len([r for r in client.live_requests if r not in self.abandoned])
                if client is not None
                else base.engine_requests
            )
            held = await self.wait_engines(allowed)
            if held > allowed:
                found.append(
                    Violation(
                        "engine-requests",
                        f"the engines still hold {held} request(s) after {self.settle:g} s; "
                        f"the client knows of {allowed}",
                    )
                )
        try:
            await base.tasks.assert_no_new_tasks(settle=self.settle)
        except AssertionError as exc:
            found.append(Violation("tasks", str(exc)))
        return found

    async def wait_engines(self, allowed: int) -> int:
        with real_time():
            held = await self.engine_requests()
            with anyio.move_on_after(self.settle):
                while held > allowed:
                    await anyio.sleep(0.005)
                    held = await self.engine_requests()
        return held

    async def tidy_up(self, base: _Baseline) -> None:
        """Abort what the run left live, so the next run starts from a clean engine."""
        client = self.client
        if client is None or client.dead:
            return
        left = [r for r in client.live_requests if r not in base.live]
        if left:
            await client.abort_requests(left)
            self.abandoned.update(left)
        if self.controls:
            await self.wait_engines(len(base.live - self.abandoned))


async def check_cancellation(
    scenario: Callable[[], Awaitable[object]],
    *,
    client: EngineCoreClient | None = None,
    engines: ReferenceEngineSet | EngineControl | Iterable[EngineControl] | None = None,
    checks: Sequence[Callable[[CheckpointRun], object]] = (),
    default_checks: bool = True,
    checkpoints: Iterable[int] | None = None,
    settle: float = 10.0,
    run_timeout: float = 30.0,
    repair: bool = True,
    allowed_exceptions: tuple[type[BaseException], ...] = (),
) -> CancellationReport:
    """Run ``scenario`` once, then once cancelled at each of its checkpoints; check each run.

    Args:
        scenario: an async function without arguments (close over the client) that
            uses trio-vllm. It is called once per run, in the calling task.
        client: the client the scenario uses (taken from ``engines`` if that is a
            `ReferenceEngineSet`).
        engines: reference engines to ask what they still run.
        checks: more invariants, called after every run with its
            `CheckpointRun`; a check fails by raising ``AssertionError``
            (sync or async). The ``assert_*`` helpers of this module fit.
        default_checks: check after every run that no request the run made is live
            on the client (``client-requests``), no utility call is pending
            (``client-calls``), the client is alive (``client-dead``), the engines hold
            no request the client forgot (``engine-requests``, polled up to ``settle``
            s), and no task the run started still runs (``tasks``, same).
        checkpoints: which checkpoints to cancel at (default: all the first run saw).
        settle: real seconds the engines and tasks get to reach a clean state.
        run_timeout: a run that takes longer is stopped and reported (``timeout``).
        repair: after each run, abort requests it left live, so later runs start
            clean (they stay listed as live on the client).
        allowed_exceptions: exceptions the scenario may raise without a violation.

    Returns a `CancellationReport`; call ``report.assert_ok()`` in a test.
    The harness stops early (``report.stopped``) if a run leaves the client dead.
    Cancellation of the caller propagates at once. Works on trio and asyncio.
    """
    from ._engines import ReferenceEngineSet

    if client is None and isinstance(engines, ReferenceEngineSet):
        client = engines.client
    harness = _Harness(
        scenario,
        client,
        _controls(engines) if engines is not None else [],
        checks,
        default_checks,
        settle,
        run_timeout,
        repair,
        allowed_exceptions,
    )
    first = await harness.run(None)
    report = CancellationReport(checkpoints=first.checkpoints_seen, runs=[first])
    targets = range(1, first.checkpoints_seen + 1) if checkpoints is None else checkpoints
    for k in sorted(set(targets)):
        if client is not None and client.dead:
            last = report.runs[-1].checkpoint
            which = "the uncancelled run" if last is None else f"the run cancelled at {last}"
            report.stopped = f"the client died during {which}"
            break
        report.runs.append(await harness.run(k))
    return report
