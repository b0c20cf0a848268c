"""``trio-vllm generate --connect`` without ``--model`` against a stock vLLM engine core.

The engine is tiny-llama (512 ids, dummy weights), started headless the way ``vllm
serve MODEL --headless`` starts it; the command knows nothing of its model, so it
applies no tokenizer: id 510 (valid there, out of the bundled reference vocabulary) is
sent as it is and the output is token ids, the same ids vLLM's own frontend gives.
Run under ``flock /work/locks/vllm.lock`` on a small machine (one stock engine at a time).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from .conftest import ENGINE_ARGS, ENGINE_ENV, EXPECTED_GREEDY, REPO, TINY_MODEL, vllm_python

HEADLESS = REPO.parent / "shared" / "interop" / "run-headless-engine.py"

pytestmark = pytest.mark.timeout(600)


def test_connect_without_model_sends_any_id_below_the_engines_vocabulary() -> None:
    python = vllm_python()
    if not HEADLESS.exists():
        pytest.skip(f"missing {HEADLESS}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cli = subprocess.Popen(
        [sys.executable, "-m", "trio_vllm.cli", "generate", "--connect",
         f"tcp://127.0.0.1:{port}", "--engines", "1", "--prompt-token-ids", "510,511,1",
         "--prompt-token-ids", "1,5,7,9", "--max-tokens", "8", "--json", "-q",
         "--ready-timeout", "400"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    engine = subprocess.Popen(
        [python, str(HEADLESS), "--model", str(TINY_MODEL), "--data-parallel-address",
         "127.0.0.1", "--data-parallel-rpc-port", str(port), *ENGINE_ARGS],
        env={**os.environ, **ENGINE_ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = cli.communicate(timeout=500)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        # SIGTERM to the launcher's group, with time to unlink its shared memory (the
        # tier's fixture checks /dev/shm); SIGKILL only if it does not exit.
        if engine.poll() is None:
            os.killpg(engine.pid, signal.SIGTERM)
            try:
                engine.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(engine.pid, signal.SIGKILL)
        engine.wait()
    assert cli.returncode == 0, err
    first, second = (json.loads(line) for line in out.splitlines())
    assert (first["prompt_index"], first["text"]) == (0, None)
    assert len(first["token_ids"]) == 8
    assert all(0 <= t < 512 for t in first["token_ids"])
    assert first["finish_reason"] == "length"
    assert second["token_ids"] == EXPECTED_GREEDY  # vLLM's own frontend's ids
