"""Engine output forwarded to ``trio_vllm.engine.<rank>`` loggers, with real processes."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from typing import TYPE_CHECKING

import anyio
import pytest

import trio_vllm as tv
from trio_vllm import _log
from trio_vllm.client._process import EngineProcess, spawn_engine_process

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.anyio


class _Collect(logging.Handler):
    def __init__(self, block: threading.Event | None = None) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.block = block

    def emit(self, record: logging.LogRecord) -> None:
        if self.block is not None:
            self.block.wait(60)
        self.records.append(record)


@pytest.fixture
def collect() -> Iterator[_Collect]:
    """A handler on ``trio_vllm.engine`` at DEBUG, removed after the test."""
    handler = _Collect()
    log = logging.getLogger("trio_vllm.engine")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(logging.NOTSET)


async def _run(code: str, ranks: list[int]) -> EngineProcess:
    process = await spawn_engine_process([sys.executable, "-c", code], name="child", ranks=ranks)
    try:
        with anyio.fail_after(30):
            await process.watch(lambda _: None)
    finally:
        await process.stop(1.0)
    return process


async def test_each_line_reaches_the_rank_logger_with_its_level(collect: _Collect) -> None:
    code = (
        "import sys\n"
        "print('INFO 12-01 10:00:00 [core.py:1] loading')\n"
        "print('(EngineCore_DP1 pid=7) WARNING 12-01 10:00:01 [x.py:2] slow', file=sys.stderr)\n"
        "print('ERROR 12-01 boom')\n"
        "print('a plain line')\n"
        "sys.stdout.write('no newline at the end')\n"
    )
    process = await _run(code, ranks=[3, 4])
    assert _log.flush_engine_logs(10)
    got = [(r.name, r.levelno, r.getMessage()) for r in collect.records]
    assert got == [
        ("trio_vllm.engine.3", logging.INFO, "INFO 12-01 10:00:00 [core.py:1] loading"),
        (
            "trio_vllm.engine.3",
            logging.WARNING,
            "(EngineCore_DP1 pid=7) WARNING 12-01 10:00:01 [x.py:2] slow",
        ),
        ("trio_vllm.engine.3", logging.ERROR, "ERROR 12-01 boom"),
        ("trio_vllm.engine.3", logging.INFO, "a plain line"),
        ("trio_vllm.engine.3", logging.INFO, "no newline at the end"),
    ]
    assert all(getattr(r, "engine_pid", None) == process.pid for r in collect.records)
    # The ring for error messages is unchanged.
    assert process.output_tail().splitlines()[-2:] == ["a plain line", "no newline at the end"]


async def test_a_launcher_s_lines_go_to_the_rank_they_name(collect: _Collect) -> None:
    code = (
        "print('(EngineCore_DP3 pid=7) INFO 12-01 [core.py:1] three')\n"
        "print('(EngineCore_DP2 pid=8) INFO 12-01 [core.py:1] two')\n"
        "print('(Worker_DP3_TP0 pid=9) WARNING 12-01 [w.py:1] worker of three')\n"
        "print('(APIServer pid=1) INFO 12-01 [api.py:1] launcher')\n"
        "print('(EngineCore_DP9 pid=7) INFO 12-01 [core.py:1] not ours')\n"
    )
    await _run(code, ranks=[2, 3])
    assert _log.flush_engine_logs(10)
    got = [(r.name.rsplit(".", 1)[1], r.getMessage().rsplit(" ", 1)[1]) for r in collect.records]
    assert got == [("3", "three"), ("2", "two"), ("3", "three"), ("2", "launcher"), ("2", "ours")]


async def test_lines_below_the_logger_level_are_not_queued(collect: _Collect) -> None:
    logging.getLogger("trio_vllm.engine").setLevel(logging.WARNING)
    await _run("print('INFO chatter'); print('WARNING kept'); print('more chatter')", ranks=[0])
    assert _log.flush_engine_logs(10)
    assert [r.getMessage() for r in collect.records] == ["WARNING kept"]


async def test_a_blocked_handler_blocks_neither_the_engine_nor_the_client(
    collect: _Collect,
) -> None:
    release = threading.Event()
    collect.block = release
    lines = _log._QUEUE_LINES * 3
    try:
        # The child writes 3x the queue's capacity; with a handler that never returns,
        # the drain must still read everything (else the child blocks on a full pipe and
        # never exits) and the watch must end.
        process = await _run(f"for i in range({lines}): print('line', i)", ranks=[0])
        assert process.output_tail(1) == f"line {lines - 1}"
        assert _log._forwarder.dropped > 0
    finally:
        release.set()
    assert _log.flush_engine_logs(30)
    handled = len(collect.records)
    assert 0 < handled <= _log._QUEUE_LINES + 1
    # Once there is room again, the next line is preceded by a count of what was lost.
    _log.forward_engine_line(logging.getLogger("trio_vllm.engine.0"), "after", 1)
    assert _log.flush_engine_logs(10)
    note, after = (r.getMessage() for r in collect.records[handled:])
    assert note == f"[{lines - handled} lines of engine output dropped: log handlers too slow]"
    assert after == "after"


async def test_reference_engines_log_under_their_ranks(collect: _Collect) -> None:
    with anyio.fail_after(60):
        async with tv.open_client(tv.ReferenceEngines(count=2, extra_args=["-v"], model="echo")):
            pass
    assert _log.flush_engine_logs(10)
    names = {r.name for r in collect.records}
    assert names == {"trio_vllm.engine.0", "trio_vllm.engine.1"}
    assert all("[reference-engine pid" in r.getMessage() for r in collect.records)


async def test_startup_failure_keeps_the_last_lines_in_the_error(collect: _Collect) -> None:
    engines = tv.ReferenceEngines(model="echo", extra_args=["--crash-on-startup", "no weights"])
    with anyio.fail_after(60), pytest.raises(tv.EngineStartupError) as info:
        async with tv.open_client(engines):
            pass
    assert "no weights" in str(info.value)
    assert _log.flush_engine_logs(10)
    assert any("no weights" in r.getMessage() for r in collect.records)


def test_the_library_is_silent_by_default() -> None:
    # A NullHandler keeps the last-resort handler from printing engine warnings.
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("trio_vllm").handlers)


def test_a_forked_child_forwards_with_its_own_thread() -> None:
    # The parent's forwarder thread does not survive a fork; the child gets a fresh one
    # (and fresh locks) instead of lines queued for nobody.
    code = (
        "import logging, os, sys\n"
        "from trio_vllm import _log\n"
        "got = []\n"
        "class H(logging.Handler):\n"
        "    def emit(self, record): got.append(record.getMessage())\n"
        "log = logging.getLogger('trio_vllm.engine.0')\n"
        "log.addHandler(H()); log.setLevel(logging.INFO)\n"
        "_log.forward_engine_line(log, 'parent', 1)\n"
        "assert _log.flush_engine_logs(10) and got == ['parent'], got\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    _log.forward_engine_line(log, 'child', 2)\n"
        "    os._exit(0 if _log.flush_engine_logs(10) and got[-1] == 'child' else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "sys.exit(os.waitstatus_to_exitcode(status))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
