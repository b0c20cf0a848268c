from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, settings

if TYPE_CHECKING:
    from collections.abc import Generator, Iterator

# Property tests must not depend on how fast the machine runs them: a loaded 2-core CI
# box (or a stock engine freezing every process for seconds) can stall one example past
# hypothesis's 200 ms deadline, or the first examples' generation past its "too slow"
# health check. Both would fail a test that is correct. Tests that set their own
# settings inherit this for what they leave out.
settings.register_profile("trio-vllm", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("trio-vllm")


@pytest.fixture(
    params=[
        pytest.param("trio", id="trio"),
        pytest.param("asyncio", id="asyncio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every ``@pytest.mark.anyio`` test on trio and on asyncio."""
    return str(request.param)


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """Move every object alive before the test into the permanent generation.

    For tests with millisecond bounds. Late in a full run, one full collection walks the
    whole session's heap (pytest's reports, every imported module, torch) and takes
    ~160 ms on 2 cores; the allocations of a test (1,000 exceptions at an engine's death)
    can trigger it inside the measured window, which then measures the collector, not
    the client (one CI run failed so). Frozen, a full collection walks only what the
    test allocated; its own garbage is still collected and still counted.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# ---------------------------------------------------------------------- ipc leftovers
# A client removes its ipc directory (``trio-vllm-*`` in the temporary directory) on
# every exit but SIGKILL. The run gets a temporary directory of its own (inherited by
# every engine, server and CLI process through TMPDIR), so that what is left in it at the
# end is this run's, whoever else runs tests on the machine; a leftover fails the run,
# naming the test after which it appeared. A test that SIGKILLs a client on purpose
# gives that client a TMPDIR of its own (tests/client/test_orphans.py).
_IPC_PREFIX = "trio-vllm-"
_run_tmp: str | None = None
_appeared_after: dict[str, str] = {}


def _ipc_entries() -> set[str]:
    assert _run_tmp is not None
    return {name for name in os.listdir(_run_tmp) if name.startswith(_IPC_PREFIX)}


def pytest_configure(config: pytest.Config) -> None:
    global _run_tmp
    _run_tmp = tempfile.mkdtemp(prefix="tv-run-")
    os.environ["TMPDIR"] = _run_tmp
    tempfile.tempdir = None  # gettempdir() caches its first answer; ask again


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    before = _ipc_entries()
    try:
        return (yield)
    finally:
        for name in _ipc_entries() - before:
            _appeared_after.setdefault(name, item.nodeid)


@pytest.hookimpl(trylast=True)  # after pytest's own tmp_path cleanup
def pytest_sessionfinish(session: pytest.Session) -> None:
    if _run_tmp is None:
        return
    # A process stopped by the last test may still be removing its directory.
    deadline = time.monotonic() + 10
    while (left := _ipc_entries()) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        lines = [f"ipc directories left in this run's temporary directory {_run_tmp}:"]
        for name in sorted(left):
            inside = sorted(os.listdir(os.path.join(_run_tmp, name)))
            lines.append(f"  {name} {inside} (appeared during {_appeared_after.get(name, '?')})")
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_sep("=", "FAILED: ipc directories left behind", red=True)
            reporter.write_line("\n".join(lines), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif session.exitstatus == pytest.ExitCode.OK:
        shutil.rmtree(_run_tmp, ignore_errors=True)
    # Otherwise it is kept for a look, with the failed tests' tmp_path directories.
