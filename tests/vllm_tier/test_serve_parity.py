"""``trio-vllm serve`` answers what ``vllm serve`` answers, on the same model and engine.

Both servers run the tiny model (dummy weights: seeded, so deterministic) in turn, the
stock one with ``vllm serve`` (``../shared/interop/vllm_cli.py``), ours with a stock
headless engine core under ``trio-vllm serve --engine vllm``. The same greedy and seeded
requests go to each, through the HTTP API; text, finish and stop reasons and ``usage``
must be equal, streamed and not.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

from .conftest import ENGINE_ARGS, ENGINE_ENV, REPO, TINY_MODEL, vllm_python

pytestmark = pytest.mark.timeout(1500)

VLLM_CLI = REPO.parent / "shared" / "interop" / "vllm_cli.py"
SERVE_ARGS = [a for a in ENGINE_ARGS if a != "--skip-tokenizer-init"]
SERVED = "tiny"

CASES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0}),
    ("/v1/completions", {"prompt": [1, 5, 7, 9], "max_tokens": 8, "temperature": 0}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 16, "temperature": 0.9, "seed": 42,
                         "n": 2}),
    ("/v1/completions", {"prompt": "Once upon", "max_tokens": 12, "temperature": 0,
                         "logprobs": 2}),
    ("/v1/completions", {"prompt": ["a b c", "日本語 🎉"], "max_tokens": 10, "temperature": 0}),
    ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0,
                         "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi there"}],
                              "max_tokens": 20, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be terse."},
                                           {"role": "user", "content": "Again? 🎉"}],
                              "max_completion_tokens": 16, "temperature": 0.7, "seed": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Stream it"}],
                              "max_tokens": 20, "temperature": 0, "stream": True,
                              "stream_options": {"include_usage": True}}),
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(process: subprocess.Popen[bytes], port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode} during startup")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"server on port {port} not healthy after {timeout} s")


def _stop(process: subprocess.Popen[bytes]) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(120)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def _summary(path: str, body: dict[str, Any], response: httpx.Response) -> dict[str, Any]:
    """What must match: per choice text, finish and stop reason (and logprob tokens);
    usage. Streams are folded into the same shape."""
    assert response.status_code == 200, response.text
    chat = path.endswith("chat/completions")
    if not body.get("stream"):
        data = response.json()
        choices = [
            {
                "index": c["index"],
                "text": c["message"]["content"] if chat else c["text"],
                "finish_reason": c["finish_reason"],
                "stop_reason": c["stop_reason"],
                "logprob_tokens": (c.get("logprobs") or {}).get("tokens"),
            }
            for c in data["choices"]
        ]
        return {"choices": choices, "usage": _usage(data["usage"])}
    folded: dict[int, dict[str, Any]] = {}
    usage = None
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        payload = block.removeprefix("data: ")
        if payload == "[DONE]":
            continue
        event = json.loads(payload)
        if event.get("usage") and not event["choices"]:
            usage = _usage(event["usage"])
        for c in event["choices"]:
            entry = folded.setdefault(
                c["index"],
                {"index": c["index"], "text": "", "finish_reason": None, "stop_reason": None,
                 "logprob_tokens": None},
            )  # fmt: skip
            entry["text"] += (c["delta"].get("content") or "") if chat else c["text"]
            if c.get("finish_reason"):
                entry["finish_reason"] = c["finish_reason"]
                entry["stop_reason"] = c.get("stop_reason")
    return {"choices": [folded[i] for i in sorted(folded)], "usage": usage}


def _usage(usage: dict[str, Any]) -> dict[str, int]:
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def _run_cases(port: int) -> list[dict[str, Any]]:
    results = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
        for path, body in CASES:
            results.append(_summary(path, body, http.post(path, json={"model": SERVED, **body})))
        models = http.get("/v1/models").json()
        results.append({"models": [(m["id"], m["max_model_len"]) for m in models["data"]]})
    return results


def serve_both(
    model: Path, run: Callable[[int], list[Any]], server_args: tuple[str, ...] = ()
) -> tuple[list[Any], list[Any]]:
    """``run(port)`` against ``vllm serve MODEL``, then against ``trio-vllm serve --engine
    vllm`` on the same model (which must exit 0 on SIGTERM): (vLLM's results, ours).
    ``server_args`` go to both servers' command lines."""
    python = vllm_python()
    env = {**os.environ, **ENGINE_ENV}
    port = _free_port()
    stock = subprocess.Popen(
        [python, str(VLLM_CLI), "serve", str(model), "--served-model-name", SERVED,
         "--host", "127.0.0.1", "--port", str(port), *SERVE_ARGS, *server_args],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_healthy(stock, port, 900)
        expected = run(port)
    finally:
        _stop(stock)
    port = _free_port()
    ours = subprocess.Popen(
        [sys.executable, "-m", "trio_vllm.cli", "serve", "--engine", "vllm",
         "--vllm-python", python, "--model", str(model), "--served-model-name", SERVED,
         "--port", str(port), f"--engine-args={' '.join(SERVE_ARGS)}",
         "--ready-timeout", "800", *server_args],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_healthy(ours, port, 900)
        got = run(port)
    finally:
        assert _stop(ours) == 0
    return expected, got


def test_trio_vllm_serve_matches_vllm_serve() -> None:
    expected, got = serve_both(TINY_MODEL, _run_cases)
    for (path, body), want, have in zip(CASES, expected, got, strict=False):
        assert have == want, (path, body)
    assert got[-1] == expected[-1]
    # the cases are not vacuous: text came out, and something stopped on length
    assert all(c["text"] for r in expected[:-1] for c in r["choices"])
    assert re.search("length", str(expected))
