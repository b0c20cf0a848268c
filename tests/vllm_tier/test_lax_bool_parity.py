"""Lax booleans (``"stream": "yes"``, ``"echo": "on"``, ``1.0``, ...): ``trio-vllm serve``
accepts and refuses the values ``vllm serve`` 0.32 does (pydantic's lax mode), and
reads them as the same booleans: a stream or not, an echo or not, a usage chunk or not.
The table is tests/server/test_lax_bools.py's (its sans-I/O test runs in CI); here both
servers answer it, and vLLM's answers must be the table's.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from server.test_lax_bools import LAX_BOOLS

from ._servers import SERVED, serve_pair

pytestmark = pytest.mark.timeout(1500)

PROMPT = "The quick brown fox"  # longer than any one token: an echo shows
FIELDS = ("stream", "echo", "include_usage")


def _stream(http: httpx.Client, body: dict[str, Any]) -> list[Any]:
    with http.stream("POST", "/v1/completions", json=body) as r:
        r.read()
        if r.status_code != 200:
            return [r.status_code, r.json()["error"]["type"]]
        if not r.headers["content-type"].startswith("text/event-stream"):
            return [200, "json", r.json()["choices"][0]["text"].startswith(PROMPT)]
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        return [200, "sse", any(e.get("usage") for e in events)]


def _run(port: int) -> list[Any]:
    out: list[Any] = []
    base = {"model": SERVED, "prompt": PROMPT, "max_tokens": 1}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
        for value, _ in LAX_BOOLS:
            out.append(_stream(http, {**base, "stream": value}))
            out.append(_stream(http, {**base, "echo": value}))
            out.append(_stream(http, {**base, "stream": True,
                                      "stream_options": {"include_usage": value}}))  # fmt: skip
    return out


def test_lax_bools_as_vllm_serve() -> None:
    expected, got = serve_pair(_run)
    mismatches = [
        (LAX_BOOLS[i // 3][0], FIELDS[i % 3], want, have)
        for i, (want, have) in enumerate(zip(expected, got, strict=True))
        if want != have
    ]
    assert not mismatches, "\n".join(map(repr, mismatches))
    # vllm serve's answers are the table's (so the sans-I/O table test is vLLM's)
    for i, (value, want) in enumerate(LAX_BOOLS):
        stream, echo, usage = expected[3 * i : 3 * i + 3]
        if want is None:
            assert stream[0] == echo[0] == usage[0] == 400, value
        else:
            assert stream[:2] == [200, "sse" if want else "json"], value
            assert echo == [200, "json", want], value
            assert usage == [200, "sse", want], value
