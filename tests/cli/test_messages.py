"""What a user can get wrong or interrupt ends in one line on stderr and an exit status.

Every test runs the real command in a subprocess. ``_site/sitecustomize.py`` (put on the
child's PYTHONPATH) hides modules or blocks an import, for the cases a user meets on
another machine: torch not installed, Ctrl-C while the command is still importing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import pytest

import trio_vllm

if TYPE_CHECKING:
    from collections.abc import Callable

T = TypeVar("T")

CLI = [sys.executable, "-m", "trio_vllm.cli"]
SITE = Path(__file__).parent / "_site"
SRC = Path(trio_vllm.__file__).parent.parent


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(SRC), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def run(*args: str, timeout: float = 100, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, check=False, env=_env(**env)
    )


def one_line_error(result: subprocess.CompletedProcess[str], status: int) -> str:
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr


@pytest.mark.parametrize(
    ("args", "usage"),
    [
        (["generate", "--bogus"], "usage: trio-vllm generate "),
        (["bench", "latency", "--bogus"], "usage: trio-vllm bench latency "),
        (["wire", "check", "x", "--bogus"], "usage: trio-vllm wire check "),
        # before the subcommand: the top-level parser's option, so its usage
        (["--bogus", "generate", "x"], "usage: trio-vllm [-h]"),
        (["--log-level", "info", "--bogus", "generate", "x"], "usage: trio-vllm [-h]"),
    ],
)
def test_an_unknown_option_prints_the_usage_of_its_subcommand(args: list[str], usage: str) -> None:
    err = one_line_error(run(*args), 2)
    assert err.startswith(usage), err
    assert err.rstrip().endswith("error: unrecognized arguments: --bogus")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "latency", "--rounds", "-3"], "argument --rounds: must be at least 1, got -3"),
        (["bench", "startup", "--backend", "foo"], "unknown 'foo' (choose from trio, asyncio)"),
        (["bench", "sync", "--backend", "trio,curio"], "unknown 'curio'"),
        (["bench", "idle", "--seconds", "0"], "argument --seconds: must be a positive number"),
        (["bench", "firehose", "--batch", "0"], "argument --batch: must be at least 1"),
        (["bench", "firehose", "--mode", "fast"], "unknown 'fast' (choose from live, backlog)"),
    ],
)
def test_bad_bench_arguments_are_usage_errors(args: list[str], message: str) -> None:
    err = one_line_error(run(*args), 2)
    assert f"trio-vllm {' '.join(args[:2])}: error: " in err
    assert message in err


@pytest.mark.parametrize("command", [[], ["generate"], ["bench"], ["bench", "firehose"]])
def test_help_is_plain_text_fitted_to_the_terminal(command: list[str]) -> None:
    result = run(*command, "--help", COLUMNS="60")
    assert result.returncode == 0, result.stderr
    assert "``" not in result.stdout
    assert ":class:" not in result.stdout
    assert "-v, --verbose" in run("--help").stdout
    lines = result.stdout.splitlines()
    if "examples:" in lines:  # command lines are kept as written
        lines = lines[: lines.index("examples:")]
    assert all(len(line) <= 60 for line in lines), [line for line in lines if len(line) > 60]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_output_to_a_full_disk_is_one_line() -> None:
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [*CLI, "generate", "hello", "--json"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=100,
            check=False,
            env=_env(),
        )
    err = one_line_error(result, 1)
    assert err.splitlines()[-1] == "trio-vllm generate: error: No space left on device"


def test_the_tiny_model_without_torch_says_what_to_install() -> None:
    err = one_line_error(run("generate", "hi", "--model", "tiny", TRIO_VLLM_TEST_HIDE="torch"), 1)
    assert (
        "the tiny model needs torch, which is not installed: "
        "pip install torch --index-url https://download.pytorch.org/whl/cpu" in err
    )


def _interruptible(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    # SIGINT back to its default in the child: a shell's background job (and so a
    # pytest started from one) ignores it, and an ignored SIGINT stays ignored in Python.
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            children = Path(f"/proc/{pid}/task/{task}/children").read_text()
            found.update(int(p) for p in children.split())
    return found


def _assert_reaped(pids: set[int]) -> None:
    """Every one of ``pids`` is gone (or a zombie); one left running is killed first,
    so a failing test leaves no engine behind."""
    running = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]:
                running.append(pid)
                os.kill(pid, signal.SIGKILL)
    assert not running, f"engine processes left running: {running}"


def _interrupt_when(
    cmd: list[str],
    env: dict[str, str],
    reached: Callable[[int], T],
    what: str,
    then: Callable[[], object] = lambda: None,
) -> tuple[subprocess.Popen[str], str, T]:
    """Run ``cmd``, poll ``reached(pid)`` until it is true, send SIGINT, call ``then()``,
    and return the process, its stderr and what ``reached`` returned."""
    child = _interruptible(cmd, env)
    try:
        deadline = time.monotonic() + 60
        while not (value := reached(child.pid)):
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, f"{what} was never reached"
            time.sleep(0.02)
        child.send_signal(signal.SIGINT)
        then()
        _, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    return child, err, value


def test_ctrl_c_while_a_benchmark_runs_exits_130_quietly_and_stops_its_engines() -> None:
    cmd = [*CLI, "bench", "latency", "--rounds", "10000000"]
    child, err, engines = _interrupt_when(cmd, _env(), _children, "an engine start")
    assert child.returncode == 130, err
    assert "Traceback" not in err, err
    _assert_reaped(engines)  # by the command on its way out


def test_ctrl_c_while_an_engine_process_starts_stops_it(tmp_path: Path) -> None:
    # Ctrl-C lands inside subprocess.Popen(), after the fork and before Popen() returns
    # (the _site hook holds it there until the SIGINT is sent): the engine must still
    # be stopped, not left running with no one to own it.
    marker = tmp_path / "spawned"
    env = _env(TRIO_VLLM_TEST_HOLD_SPAWN=str(marker))
    cmd = [*CLI, "bench", "latency", "--rounds", "1"]
    child, err, engines = _interrupt_when(
        cmd, env, lambda pid: marker.exists() and _children(pid), "the engine spawn",
        then=marker.unlink,
    )  # fmt: skip
    assert child.returncode == 130, err
    assert "Traceback" not in err, err
    _assert_reaped(engines)


def _interrupt_at_import(
    cmd: list[str], module: str, marker: Path
) -> tuple[subprocess.Popen[str], str]:
    """Run ``cmd`` with the first import of ``module`` blocked (``_site``) and send
    SIGINT once the import is reached; returns the process and its stderr."""
    env = _env(TRIO_VLLM_TEST_BLOCK_IMPORT=f"{module}:{marker}")
    child, err, _ = _interrupt_when(cmd, env, lambda _: marker.exists(), f"import {module}")
    return child, err


@pytest.mark.parametrize(
    ("args", "module"),
    [(["generate", "hello"], "trio"), (["bench", "latency", "--rounds", "1"], "anyio")],
)
def test_ctrl_c_during_start_up_imports_exits_130_quietly(
    tmp_path: Path, args: list[str], module: str
) -> None:
    child, err = _interrupt_at_import([*CLI, *args], module, tmp_path / "importing")
    assert child.returncode == 130, err
    assert "Traceback" not in err, err
    assert "KeyboardInterrupt" not in err, err


def test_the_import_block_ends_at_a_sigint_another_thread_took(tmp_path: Path) -> None:
    """The ``_site`` hook's blocked import gives way to a Ctrl-C even when the signal's C
    handler ran in a thread other than the sleeping main thread (so the sleep's syscall
    was never interrupted; the same state as a SIGINT landing just before the sleep
    starts). The hook used to sleep 60 s in one call and so exit 130 only after the
    callers' communicate(timeout=60) had expired: the flake of the tests above."""
    marker = tmp_path / "importing"
    code = (
        "import os, signal, sys, threading, time\n"
        "def interrupt():\n"
        "    while not os.path.exists(sys.argv[1]):\n"
        "        time.sleep(0.01)\n"
        "    signal.pthread_kill(threading.get_ident(), signal.SIGINT)\n"
        "threading.Thread(target=interrupt, daemon=True).start()\n"
        "try:\n"
        "    import colorsys\n"
        "except KeyboardInterrupt:\n"
        "    sys.exit(130)\n"
    )
    env = _env(TRIO_VLLM_TEST_BLOCK_IMPORT=f"colorsys:{marker}")
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code, str(marker)],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
        env=env,
    )
    assert marker.exists(), result.stderr  # the import was blocked, then interrupted
    assert result.returncode == 130, result.stderr
    # The hook sleeps 60 s; well under it means the interrupt, not the sleep, ended it.
    assert time.monotonic() - start < 30


# What pip writes into the ``trio-vllm`` console script, less the argv[0] fix-up.
CONSOLE_SCRIPT = [
    sys.executable, "-c", "import re, sys\nfrom trio_vllm.cli import main\nsys.exit(main())"
]  # fmt: skip


@pytest.mark.parametrize("launcher", ["python -m", "console script"])
@pytest.mark.parametrize("module", ["msgspec", "numpy"])
def test_ctrl_c_while_trio_vllm_itself_imports_exits_130_quietly(
    tmp_path: Path, launcher: str, module: str
) -> None:
    # msgspec and numpy are the first heavy imports of the protocol layer, which
    # ``import trio_vllm`` used to load before the command's handler existed.
    cmd = [*(CLI if launcher == "python -m" else CONSOLE_SCRIPT), "generate", "hello"]
    child, err = _interrupt_at_import(cmd, module, tmp_path / "importing")
    assert child.returncode == 130, err
    assert "Traceback" not in err, err
    assert "KeyboardInterrupt" not in err, err


def test_the_console_script_reaches_main_before_any_heavy_import() -> None:
    """What runs before ``main``'s Ctrl-C handler: ``import trio_vllm`` and the
    ``trio_vllm.cli`` package, a few pure-Python modules (argparse, msgspec, numpy,
    anyio and the protocol layer are imported inside ``main``)."""
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "from trio_vllm.cli import main\n"
        "print(' '.join(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
        env=_env(),
    )  # fmt: skip
    assert out.stdout.split() == [
        "__future__",
        "trio_vllm",
        "trio_vllm._exceptions",
        "trio_vllm._public",
        "trio_vllm._version",
        "trio_vllm.cli",
    ]
