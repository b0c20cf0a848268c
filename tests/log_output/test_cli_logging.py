"""``trio-vllm -v``: the engine's own lines on stderr, through the logging hierarchy."""

from __future__ import annotations

import subprocess
import sys

CLI = [sys.executable, "-m", "trio_vllm.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=100, check=False)


def test_verbose_shows_the_engine_output_under_its_rank_logger() -> None:
    # The reference engine's own -v makes it write its startup steps.
    result = run("-v", "generate", "hello", "--max-tokens", "2", "--engine-args=-v")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "he\n"
    lines = [line for line in result.stderr.splitlines() if " trio_vllm.engine.0 INFO: " in line]
    assert lines, result.stderr
    assert all("[reference-engine pid" in line for line in lines)


def test_debug_adds_the_client_records_and_quiet_by_default() -> None:
    debug = run("--log-level", "debug", "generate", "hello", "--max-tokens", "2")
    assert debug.returncode == 0, debug.stderr
    assert " trio_vllm.client DEBUG: spawned reference engine 0 " in debug.stderr
    quiet = run("generate", "hello", "--max-tokens", "2", "--engine-args=-v")
    assert quiet.returncode == 0, quiet.stderr
    assert "trio_vllm." not in quiet.stderr
    assert "[reference-engine pid" not in quiet.stderr


def test_the_top_level_verbosity_and_a_subcommand_s_own_v_are_separate() -> None:
    from trio_vllm.cli._main import _build_parser

    top = _build_parser().parse_args(["-vv", "wire", "check", "DIR"])
    assert (top.log_verbosity, top.verbose) == (2, False)
    sub = _build_parser().parse_args(["wire", "check", "-v", "DIR"])
    assert (sub.log_verbosity, sub.verbose) == (0, True)
