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

from trio_vllm.reference_engine import MODEL_DIR, TINY_LLAMA_DIR

from ._bpe import write_bpe_model_dir

CLI = [sys.executable, "-m", "trio_vllm.cli", "generate"]
LONG = "--max-model-len 1000000 --num-gpu-blocks 1000000"


def run(
    *args: str, timeout: float = 100, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    # Standard input is empty unless given: a prompt-less command reads it (as a filter).
    return subprocess.run(
        [*CLI, *args],
        input="" if stdin is None else stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
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


def test_json_one_line_per_request_in_prompt_order_and_quiet() -> None:
    result = run(
        "--prompt-token-ids", "104,105", "abcdefgh", "--prompt-token-ids", "120,121",
        "--max-tokens", "8", "--json", "--quiet",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    keys = {"prompt_index", "index", "request_id", "text", "token_ids", "finish_reason",
            "stop_reason"}  # fmt: skip
    assert all(set(line) == keys for line in lines)
    # Text prompts first, then --prompt-token-ids, each in the order given.
    assert [line["prompt_index"] for line in lines] == [0, 1, 2]
    assert [line["text"] for line in lines] == ["abcdefgh", "hihihihi", "xyxyxyxy"]
    assert lines[1]["token_ids"] == [104, 105] * 4
    assert all(line["index"] == 0 for line in lines)
    assert all(line["finish_reason"] == "length" for line in lines)
    assert all(line["stop_reason"] is None for line in lines)
    assert len({line["request_id"] for line in lines}) == 3


def test_json_keeps_the_progress_on_stderr() -> None:
    result = run("hi", "--max-tokens", "2", "--json")
    assert result.returncode == 0, result.stderr
    assert "1/1 ready" in result.stderr
    assert json.loads(result.stdout)["text"] == "hi"


def test_stop_strings_n_min_tokens_and_logprobs() -> None:
    result = run(
        "abcabc", "--max-tokens", "30", "--stop", "ca", "--stop", "zz", "--min-tokens", "4",
        "--n", "2", "--temperature", "1", "--seed", "3", "--logprobs", "2", "--json", "-q",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(line["prompt_index"], line["index"]) for line in lines] == [(0, 0), (0, 1)]
    for line in lines:
        # "ca" completes at token 4 ("abca") but min_tokens=4 lets the check start only
        # after token 4: the next match ends at token 7.
        assert line["text"] == "abcab"
        assert (line["finish_reason"], line["stop_reason"]) == ("stop", "ca")
        assert len(line["logprobs"]) == len(line["token_ids"]) == 7
        top = line["logprobs"][0][0]
        assert top["token_id"] == ord("a")
        assert top["decoded_token"] == "a"
        assert top["rank"] == 1
    kept = run("abcabc", "--stop", "ca", "--include-stop-str-in-output", "--json", "-q")
    assert json.loads(kept.stdout)["text"] == "abca"


def test_chat_with_system_message() -> None:
    result = run("--chat", "--system", "be brief", "hi", "--max-tokens", "40", "--json", "-q")
    assert result.returncode == 0, result.stderr
    text = json.loads(result.stdout)["text"]
    prompt = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    assert text == prompt[:40]  # the echo model repeats the rendered conversation


def test_model_dir_bpe_tokenizer_eos_ids_and_chat(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    model = write_bpe_model_dir(tmp_path / "bpe")
    tok = Tokenizer.from_file(f"{model}/tokenizer.json")
    prompt = "hello world 日本🎉"
    ids = tok.encode(prompt).ids
    assert ids[0] == 1  # BOS, from the post-processor
    assert len(ids) < len(prompt.encode())  # merges: not byte-level
    result = run("--model", model, prompt, "--max-tokens", "25", "--json", "-q")
    assert result.returncode == 0, result.stderr
    line = json.loads(result.stdout)
    expected = [ids[k % len(ids)] for k in range(25)]
    assert line["token_ids"] == expected
    # BOS skipped; the last tokens end inside 日: streaming shows no half character
    # (a one-shot decode shows U+FFFD there).
    assert tok.decode(expected).endswith("\ufffd")
    assert line["text"] == tok.decode(expected).rstrip("\ufffd")
    # The chat template's <|im_end|> is EOS id 4 of generation_config.json: it stops there.
    chat = run("--model", model, "--chat", "hello", "--max-tokens", "40", "--json", "-q")
    assert chat.returncode == 0, chat.stderr
    line = json.loads(chat.stdout)
    assert line["text"] == "user\nhello"
    assert (line["finish_reason"], line["stop_reason"]) == ("stop", 4)
    assert line["token_ids"][-1] == 4


def test_token_prompt_and_seeded_sampling_is_reproducible() -> None:
    result = run("--prompt-token-ids", "104,105,33", "--max-tokens", "5")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hi!hi\n"
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
        (("--prompt-token-ids", "1", "--connect", "127.0.0.1:5"), "tcp://HOST:PORT"),
        (("hi", "--max-tokens", "0"), "at least 1"),
        (("hi", "--model", "gpt"), "echo and tiny"),
        (("hi", "--top-p", "2"), "--top-p must be in (0, 1]"),
        (("hi", "--temperature", "1", "--top-p", "0"), "--top-p must be in (0, 1]"),
        (("hi", "--n", "0"), "--n must be at least 1"),
        (("hi", "--n", "2"), "n must be 1 when using greedy sampling"),
        (("hi", "--min-tokens", "20"), "min_tokens must be less than or equal to max_tokens"),
        (("hi", "--logprobs", "1000"), "logprobs"),
        (("hi", "--stop", ""), "stop cannot contain an empty string"),
        (("--prompt-token-ids", "300,2"), "Token id 300 is out of vocabulary"),
        (("--chat", "--prompt-token-ids", "1,2"), "--chat takes text prompts"),
        (("hi", "--system", "x"), "--system goes with --chat"),
        (
            ("hi", "--engine", "vllm", "--model", "/nonexistent", "--vllm-python", "py"),
            "cannot load the tokenizer",
        ),
    ],
)
def test_usage_errors_exit_2(args: tuple[str, ...], message: str) -> None:
    """Every bad value is refused before any engine starts (a stock engine takes a
    minute to load): no progress line was printed."""
    result = run(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "connected" not in result.stderr


def test_a_request_ending_in_error_exits_1_with_the_reason(tmp_path: Path) -> None:
    # The engine's vocabulary (100 ids) is smaller than the tokenizer's: it refuses "hi".
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100}))
    result = run("hi", "ok", "--engine-args", f"--model-dir {tmp_path}", "--json", "-q")
    assert result.returncode == 1, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["finish_reason"] for line in lines] == ["error", "error"]
    assert "(prompt 0, completion 0) ended in error" in result.stderr
    assert "(prompt 1, completion 0) ended in error" in result.stderr


@pytest.mark.parametrize(
    "engine_args",
    [
        ("--engine-args", "--startup-delay=0.2"),
        ("--engine-args=--startup-delay=0.2",),
        ("--engine-args", "--startup-delay 0.2"),
    ],
)
def test_engine_args_values_starting_with_a_dash(engine_args: tuple[str, ...]) -> None:
    result = run("hi", "--max-tokens", "2", *engine_args, "-q")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hi\n"


def test_progress_fits_a_narrow_terminal() -> None:
    """On a 50-column terminal every rewritten progress line is shorter than 50 columns
    (a longer one would wrap and leave a stale row per update); --quiet prints none."""
    import pty

    for quiet in (False, True):
        master, slave = pty.openpty()
        try:
            env = {**os.environ, "COLUMNS": "50", "LINES": "20"}
            proc = subprocess.Popen(
                [*CLI, "hi", "--max-tokens", "2", "--engine-args", "--startup-delay=0.6",
                 *(["--quiet"] if quiet else [])],
                stdout=subprocess.PIPE, stderr=slave, env=env,
            )  # fmt: skip
            os.close(slave)
            slave = -1
            chunks = []
            while True:
                try:
                    data = os.read(master, 4096)
                except OSError:  # EIO: the child closed its end
                    break
                if not data:
                    break
                chunks.append(data)
            out, _ = proc.communicate(timeout=60)
        finally:
            os.close(master)
            if slave >= 0:
                os.close(slave)
        assert proc.returncode == 0
        assert out == b"hi\n"
        err = b"".join(chunks).decode()
        if quiet:
            assert err == ""
            continue
        # Each update clears the row and writes one frame; every frame but the last is
        # overwritten by the next update, so it must fit in the row, on one line.
        rewritten = err.split("\r\x1b[K")[1:-1]
        assert all("\n" not in f and "\r" not in f for f in rewritten), rewritten
        assert any("waiting for" in f for f in rewritten), err
        assert max(len(f) for f in rewritten) < 50, rewritten


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
            "--model",  # the engines' model directory: text needs its tokenizer
            MODEL_DIR,
            "abcd",
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
    assert out == "abcdabcd\n"
    assert "1/1 ready" in err


def test_connect_without_model_sends_ids_unchecked_and_prints_ids() -> None:
    # The engine stands in for tiny-llama (512 ids); the command knows nothing of its
    # model: 510 (outside the bundled reference vocabulary) goes out as it is.
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    cli = subprocess.Popen(
        [*CLI, "--connect", address, "--prompt-token-ids", "510,3,7", "--max-tokens", "6",
         "--ready-timeout", "90"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    engine = subprocess.Popen(
        [sys.executable, "-m", "trio_vllm.reference_engine", "--handshake-address", address,
         "--model", "echo", "--model-dir", TINY_LLAMA_DIR],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        out, err = cli.communicate(timeout=100)
    finally:
        for p in (cli, engine):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert cli.returncode == 0, err
    assert out == "510 3 7 510 3 7\n"  # the echo model's ids, not text
    assert "6 tokens, finish_reason=length" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("hello",), "text prompts need a tokenizer; with --connect and no --model"),
        (("--chat", "hi"), "give --model DIR"),
        (("--prompt-token-ids", "1", "--stop", "x"), "--stop needs a tokenizer"),
        (("--prompt-token-ids", "1", "--n", "2"), "--n > 1 needs a tokenizer"),
        (("--prompt-token-ids", "510", "--vocab-size", "500"),
         "token id 510 is out of vocabulary (--vocab-size 500)"),
    ],
)  # fmt: skip
def test_connect_without_model_refuses_what_needs_a_tokenizer(
    args: tuple[str, ...], message: str
) -> None:
    result = run("--connect", "tcp://127.0.0.1:1", *args, timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "connected" not in result.stderr  # refused before waiting for engines


def test_vocab_size_goes_with_connect_and_no_model() -> None:
    result = run("--prompt-token-ids", "1", "--vocab-size", "5", timeout=60)
    assert result.returncode == 2
    assert "--vocab-size goes with --connect and no --model" in result.stderr


def test_prompts_from_standard_input_one_per_line() -> None:
    result = run("first", "-", "last", "--max-tokens", "2", "--json", "-q", stdin="ab\n\ncd\n")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(d["prompt_index"], d["text"]) for d in lines] == [
        (0, "fi"), (1, "ab"), (2, "cd"), (3, "la"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("prompts", "ids", "tty", "text", "expected"),
    [
        ([], [], False, "a\n\nb\n", ["a", "b"]),  # no prompt, a pipe: read it
        ([], [], True, "a\n", []),  # a terminal: no waiting for typed input
        ([], ["1"], False, "a\n", []),  # ids given: standard input left alone
        (["x", "-"], [], True, "a\nb", ["x", "a", "b"]),  # '-' reads even a terminal
        (["x"], [], False, "a\n", ["x"]),
    ],
)
def test_which_prompts_come_from_standard_input(
    monkeypatch: pytest.MonkeyPatch,
    prompts: list[str],
    ids: list[str],
    tty: bool,
    text: str,
    expected: list[str],
) -> None:
    import argparse
    import io

    from trio_vllm.cli._generate import _text_prompts

    class _Stdin(io.StringIO):
        def isatty(self) -> bool:
            return tty

    monkeypatch.setattr(sys, "stdin", _Stdin(text))
    args = argparse.Namespace(prompts=prompts, prompt_token_ids=ids)
    assert _text_prompts(args) == expected
