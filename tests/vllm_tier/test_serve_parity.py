"""``trio-vllm serve`` answers what ``vllm serve`` answers, on the same model and engine.

Both servers run the tiny model (dummy weights: seeded, so deterministic) in turn, the
stock one with ``vllm serve`` (``../shared/interop/vllm_cli.py``), ours with a stock
headless engine core under ``trio-vllm serve --engine vllm``. The same greedy and seeded
requests go to each, through the HTTP API; text, finish and stop reasons and ``usage``
must be equal, streamed and not.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

from ._servers import SERVED, serve_pair

pytestmark = pytest.mark.timeout(1500)

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


def test_trio_vllm_serve_matches_vllm_serve() -> None:
    expected, got = serve_pair(_run_cases)
    for (path, body), want, have in zip(CASES, expected, got, strict=False):
        assert have == want, (path, body)
    assert got[-1] == expected[-1]
    # the cases are not vacuous: text came out, and something stopped on length
    assert all(c["text"] for r in expected[:-1] for c in r["choices"])
    assert re.search("length", str(expected))
