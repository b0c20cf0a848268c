"""``trio-vllm generate`` run as a real subprocess against real engine processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "trio_vllm.cli", "generate"]
LONG = "--max-model-len 1000000 --num-gpu-blocks 1000000"


def run(*args: str, timeout: float = 100) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def children_of(pid: int) -> set[int]:
    pids: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            text = Path(f"/proc/{pid}/task/{task}/children").read_text()
            pids.update(int(p) for p in text.split())
    return pids


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_text_prompt_streams_text_on_the_reference_engine() -> None:
    started = time.monotonic()
    result = run("hello", "--max-tokens", "16")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hellohellohelloh\n"  # the echo model repeats the prompt
    assert "1/1 connected" in result.stderr
    assert "1 engine(s) ready" in result.stderr
    assert "16 tokens, finish_reason=length" in result.stderr
    assert time.monotonic() - started < 30


def test_utf8_text_round_trips_byte_level() -> None:
    result = run("héllo", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "héllohéllo\n"  # 12 bytes: é is two


def test_json_token_ids_one_line_per_request_and_quiet() -> None:
    result = run(
        "--prompt-token-ids", "1,5,7,9", "--prompt-token-ids", "3,4", "--max-tokens", "8", "--json"
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == 2
    by_tokens = sorted(lines, key=lambda line: line["token_ids"])
    assert by_tokens[0]["token_ids"] == [1, 5, 7, 9, 1, 5, 7, 9]
    assert by_tokens[1]["token_ids"] == [3, 4, 3, 4, 3, 4, 3, 4]
    assert all(set(line) == {"request_id", "token_ids", "finish_reason"} for line in lines)
    assert all(line["finish_reason"] == "length" for line in lines)
    assert lines[0]["request_id"] != lines[1]["request_id"]


def test_token_prompt_prints_ids_and_seeded_sampling_is_reproducible() -> None:
    result = run("--prompt-token-ids", "1,5,7", "--max-tokens", "5")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "1 5 7 1 5\n"
    # Two requests with the same seed sample the same tokens (unseeded ones would not).
    seeded = run(
        "--model",
        "tiny",
        "--prompt-token-ids",
        "1,2,3",
        "--prompt-token-ids",
        "1,2,3",
        "--max-tokens",
        "6",
        "--temperature",
        "1.0",
        "--seed",
        "7",
        "--json",
        "--ignore-eos",
        timeout=110,
    )
    assert seeded.returncode == 0, seeded.stderr
    first, second = (json.loads(line)["token_ids"] for line in seeded.stdout.splitlines())
    assert len(first) == 6
    assert first == second


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "give a PROMPT"),
        (("--prompt-token-ids", "1,x"), "comma-separated ints"),
        (("hi", "--engine", "vllm"), "needs --model"),
        (("hi", "--engine", "vllm", "--model", "m"), "needs --vllm-python"),
        (("hi", "--connect", "127.0.0.1:5"), "tcp://HOST:PORT"),
        (("hi", "--max-tokens", "0"), "at least 1"),
        (("hi", "--model", "gpt"), "echo and tiny"),
    ],
)
def test_usage_errors_exit_2(args: tuple[str, ...], message: str) -> None:
    result = run(*args)
    assert result.returncode == 2
    assert message in result.stderr


def test_engine_startup_failure_exits_1_with_the_engine_output() -> None:
    result = run("hi", "--engine-args", "--crash-on-startup 'no such model'")
    assert result.returncode == 1
    assert "engines did not start" in result.stderr
    assert "no such model" in result.stderr


def test_engine_death_mid_stream_exits_1() -> None:
    result = run("hi", "--max-tokens", "100", "--engine-args", "--die-after-steps 3")
    assert result.returncode == 1
    assert "engine died" in result.stderr


def test_ctrl_c_stops_cleanly_and_stops_the_engine() -> None:
    proc = subprocess.Popen(
        [*CLI, "abc", "--max-tokens", "900000", "--engine-args", LONG],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.read(6) == "abcabc"  # streaming has started
        engines = children_of(proc.pid)
        assert engines
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert "interrupted" in err
    assert "Traceback" not in err
    assert all(gone(pid) for pid in engines)


def test_connect_waits_for_an_engine_started_elsewhere() -> None:
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    cli = subprocess.Popen(
        [
            *CLI,
            "--connect",
            address,
            "--engines",
            "1",
            "--prompt-token-ids",
            "1,5,7,9",
            "--max-tokens",
            "8",
            "--ready-timeout",
            "90",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    engine = None
    try:
        assert cli.stderr is not None
        first = cli.stderr.readline()  # progress shows before any engine exists
        assert "0/1 connected" in first, first
        engine = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trio_vllm.reference_engine",
                "--handshake-address",
                address,
                "--model",
                "echo",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        out, err = cli.communicate(timeout=100)
    finally:
        for p in (cli, engine):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert cli.returncode == 0, err
    assert out == "1 5 7 9 1 5 7 9\n"
    assert "1/1 ready" in err
