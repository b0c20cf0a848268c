"""The checkpoint-cancellation harness on small scenarios (most without engines)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import pytest

from trio_vllm.client import make_request
from trio_vllm.testing import (
    CheckpointRun,
    ReferenceEngineSet,
    assert_no_task_leaks,
    check_cancellation,
)

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio


class Resources:
    def __init__(self) -> None:
        self.open = 0

    def check_closed(self, run: CheckpointRun) -> None:
        leaked, self.open = self.open, 0
        assert leaked == 0, f"{leaked} resource(s) left open"


async def test_reports_the_checkpoints_that_break_a_user_invariant() -> None:
    res = Resources()

    async def scenario() -> None:
        await anyio.lowlevel.checkpoint()  # 1
        res.open += 1
        await anyio.lowlevel.checkpoint()  # 2: a cancellation here leaks
        await anyio.lowlevel.checkpoint()  # 3: and here
        res.open -= 1  # BUG: not in a finally
        await anyio.lowlevel.checkpoint()  # 4

    report = await check_cancellation(scenario, checks=[res.check_closed])
    assert report.checkpoints == 4
    assert [r.checkpoint for r in report.runs] == [None, 1, 2, 3, 4]
    assert all(r.outcome == "cancelled" for r in report.runs[1:])
    assert report.broken_at() == [2, 3]
    assert report.broken_at("check_closed") == [2, 3]
    failing = report.failures[0]
    assert failing.violations[0].message.startswith("1 resource(s) left open")
    assert "test_harness.py" in failing.location
    assert "in scenario" in failing.location
    with pytest.raises(AssertionError, match=r"checkpoint 2 at .*test_harness\.py"):
        report.assert_ok()

    async def fixed() -> None:
        await anyio.lowlevel.checkpoint()
        res.open += 1
        try:
            await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()
        finally:
            res.open -= 1
        await anyio.lowlevel.checkpoint()

    (await check_cancellation(fixed, checks=[res.check_closed])).assert_ok()


async def test_selected_checkpoints_and_async_checks() -> None:
    seen: list[int | None] = []

    async def record(run: CheckpointRun) -> None:
        await anyio.lowlevel.checkpoint()
        seen.append(run.checkpoint)

    async def scenario() -> None:
        for _ in range(5):
            await anyio.lowlevel.checkpoint()

    report = await check_cancellation(scenario, checks=[record], checkpoints=[2, 4, 9])
    report.assert_ok()
    assert seen == [None, 2, 4, 9]
    assert report.runs[3].outcome == "returned"  # only 5 checkpoints: 9 never came
    assert not report.runs[3].cancel_requested
    assert report.runs[1].cancel_requested


async def test_leaked_task_and_converted_cancellation() -> None:
    async with anyio.create_task_group() as outer:

        async def leaks_a_task() -> None:
            outer.start_soon(anyio.sleep_forever, name="forgotten")
            await anyio.lowlevel.checkpoint()

        report = await check_cancellation(leaks_a_task, settle=0.05)
        assert report.broken_at("tasks") == [None, 1]
        assert "forgotten" in str(report)
        outer.cancel_scope.cancel()

    async def converts() -> None:
        try:
            await anyio.lowlevel.checkpoint()
        except anyio.get_cancelled_exc_class():
            raise RuntimeError("cancelled!") from None

    report = await check_cancellation(converts)
    assert report.broken_at("exception") == [1]
    assert report.runs[1].outcome == "raised"
    allowed = await check_cancellation(converts, allowed_exceptions=(RuntimeError,))
    allowed.assert_ok()


async def test_cancellation_in_a_shielded_section_is_not_delivered() -> None:
    async def cleanup_at_the_end() -> None:
        await anyio.lowlevel.checkpoint()
        with anyio.CancelScope(shield=True):
            await anyio.lowlevel.checkpoint()

    report = await check_cancellation(cleanup_at_the_end)
    report.assert_ok()
    assert report.runs[1].outcome == "cancelled"
    assert report.runs[2].cancel_requested
    assert report.runs[2].outcome == "returned"


async def test_assert_no_task_leaks() -> None:
    async with anyio.create_task_group() as outer:
        with pytest.raises(AssertionError, match="lingering"):
            async with assert_no_task_leaks(settle=0.05):
                outer.start_soon(anyio.sleep_forever, name="lingering")
        outer.cancel_scope.cancel()
    async with assert_no_task_leaks() as snapshot, anyio.create_task_group() as inner:
        inner.start_soon(anyio.sleep, 0.01)
    assert snapshot.new_tasks() == []


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.reference_engines(
    extra_args=("--max-model-len", "1000000", "--num-gpu-blocks", "1000000")
)
async def test_raw_request_leak_seen_by_client_and_engine(
    reference_engines: ReferenceEngineSet,
) -> None:
    client = reference_engines.client

    async def raw_without_abort() -> None:
        await client.add_request(make_request([1, 2], max_tokens=500_000))
        with anyio.move_on_after(0.05):
            while True:
                await client.get_output()

    with anyio.fail_after(30):
        report = await check_cancellation(
            raw_without_abort, engines=reference_engines, checkpoints=[3]
        )
        assert report.broken_at("client-requests") == [None, 3]
        # Without the client the harness only sees the engine side.
        alone = await check_cancellation(
            raw_without_abort, engines=reference_engines.controls, checkpoints=[], settle=0.2
        )
        assert alone.broken_at("engine-requests") == [None]
        await client.abort_requests(client.live_requests)
        await reference_engines.wait_idle()


def test_plugin_in_a_fresh_project(tmp_path: Path) -> None:
    """A project with no conftest gets the fixtures from the installed entry point."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nfilterwarnings = error\n")
    (tmp_path / "test_user.py").write_text(
        textwrap.dedent("""
        import pytest
        from trio_vllm.client import make_request
        from trio_vllm.testing import assert_engine_idle, check_cancellation

        @pytest.mark.anyio
        async def test_with_anyio(engine_client, engine_control):
            async with engine_client.generate(make_request([1, 2], max_tokens=3)) as s:
                assert await s.collect() == [1, 2, 1]
            await assert_engine_idle(engine_control)

        @pytest.mark.trio
        @pytest.mark.reference_engines(protocol="0.25.1")
        async def test_with_pytest_trio(reference_engines):
            client = reference_engines.client
            assert client.vllm_version == "0.25.1"

            async def scenario():
                async with client.generate(make_request([5], max_tokens=3)) as s:
                    await s.collect()

            report = await check_cancellation(scenario, engines=reference_engines)
            report.assert_ok()
            assert report.checkpoints >= 3  # send, first receive, end (at least)
    """)
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_stops_when_a_run_kills_the_client(reference_engines: ReferenceEngineSet) -> None:
    client = reference_engines.client

    async def kills_the_engine() -> None:
        await reference_engines.control().kill()
        await client.wait_dead()

    with anyio.fail_after(30):
        report = await check_cancellation(kills_the_engine, engines=reference_engines)
    assert report.broken_at("client-dead") == [None]
    assert len(report.runs) == 1
    assert report.stopped == "the client died during the uncancelled run"
    assert not report.ok
    with pytest.raises(RuntimeError, match="needs a live client"):
        await check_cancellation(kills_the_engine, engines=reference_engines)
