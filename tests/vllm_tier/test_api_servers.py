"""``trio-vllm serve --engine vllm --api-server-count 2``: two frontends on one stock engine.

A stock vLLM 0.32 engine core told about two frontends (two input and two output
addresses in its init metadata) sends its ready response to both, routes each request's
outputs by ``client_index``, and both servers answer; the group stops on SIGTERM with
nothing left, and exits 1 when the engine dies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import httpx
import pytest

from _procs import alive, descendants

from ._servers import SERVE_ARGS, free_port, vllm_lock, wait_healthy
from .conftest import ENGINE_ENV, TINY_MODEL, vllm_python

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

_HEADER = "x-trio-vllm-server"
_BODY = {"model": "tiny", "prompt": [1, 5, 7, 9], "max_tokens": 8, "temperature": 0}


@pytest.fixture(autouse=True)
def _stock_vllm_lock() -> Iterator[None]:
    # each test starts a stock engine: the machine's lock, held in-process
    with vllm_lock():
        yield


def _start(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "trio_vllm.cli", "serve", "--engine", "vllm",
         "--vllm-python", vllm_python(), "--model", str(TINY_MODEL),
         "--served-model-name", "tiny", "--port", str(port), "--api-server-count", "2",
         f"--engine-args={' '.join(SERVE_ARGS)}", "--ready-timeout", "800"],
        env={**os.environ, **ENGINE_ENV}, stdout=subprocess.DEVNULL,
    )  # fmt: skip


def _both_serving(port: int, deadline: float) -> None:
    # /health answers once one server listens; the other may still be loading.
    seen: set[str] = set()
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"only servers {seen} answered"
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as fresh:
            seen.add(fresh.get("/health").headers[_HEADER])


def test_two_servers_on_a_stock_engine() -> None:
    port = free_port()
    group = _start(port)
    everything: list[int] = []
    try:
        wait_healthy(group, port, 900)
        _both_serving(port, time.monotonic() + 300)
        everything = descendants(group.pid)
        texts: dict[str, set[str]] = {}
        for _ in range(40):
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as fresh:
                response = fresh.post("/v1/completions", json=_BODY)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            assert choice["finish_reason"] == "length"
            texts.setdefault(response.headers[_HEADER], set()).add(choice["text"])
            if len(texts) == 2 and sum(len(t) for t in texts.values()) >= 2:
                break
        assert sorted(texts) == ["0", "1"]  # both serve
        # Greedy on dummy weights: every answer, from either server, is the same text.
        assert len(set().union(*texts.values())) == 1, texts
        assert next(iter(texts["0"]))
        assert group.poll() is None
        group.send_signal(signal.SIGTERM)
        assert group.wait(180) == 0
        deadline = time.monotonic() + 60
        while any(alive(p) for p in everything):
            assert time.monotonic() < deadline, [p for p in everything if alive(p)]
            time.sleep(0.2)
    finally:
        if group.poll() is None:
            group.kill()
            group.wait()


def test_stock_engine_death_exits_1() -> None:
    port = free_port()
    group = _start(port)
    try:
        wait_healthy(group, port, 900)
        _both_serving(port, time.monotonic() + 300)
        everything = descendants(group.pid)
        # The engine core only: its launcher then stops the workers, which unlink their
        # shared memory (the tier's teardown check; SIGKILLing those leaves it).
        cores = [p for p in everything if b"EngineCore" in _cmdline(p)]
        assert len(cores) == 1, everything
        os.kill(cores[0], signal.SIGKILL)
        assert group.wait(180) == 1
        deadline = time.monotonic() + 60
        while any(alive(p) for p in everything):
            assert time.monotonic() < deadline, [p for p in everything if alive(p)]
            time.sleep(0.2)
    finally:
        if group.poll() is None:
            group.kill()
            group.wait()


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""
