"""``trio-vllm serve --enable-auto-tool-choice --tool-call-parser hermes`` against
``vllm serve`` with the same flags, on tiny-llama (dummy weights).

The random weights never write a tool call, so what this checks is the request side and
the response shapes: the same content, tool calls (none), finish reasons and token
counts for tools with tool_choice auto and none, streamed and not, a tool-result turn in
the history, and the same 400s (status and message) for bad tool requests. Parsing of
real tool-call text is the parser table's job (tests/text/test_parsers*.py).
``tool_choice`` required/named are left out: vLLM constrains them with a JSON schema,
trio-vllm serve refuses them (400) for now.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from ._servers import SERVED, serve_pair

pytestmark = pytest.mark.timeout(1500)

FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "weather in Paris?"}]
HISTORY = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21}'},
]
GREEDY = {"temperature": 0, "max_tokens": 8}
CASES: list[dict[str, Any]] = [
    {"messages": ASK, "tools": [TOOL], **GREEDY},
    {"messages": ASK, "tools": [TOOL], "stream": True, **GREEDY},
    {"messages": ASK, "tools": [TOOL], "tool_choice": "none", **GREEDY},
    {"messages": ASK, "tools": [TOOL], "tool_choice": "auto", "stream": True, "n": 2,
     "seed": 3, "temperature": 1.0, "max_tokens": 6},
    {"messages": HISTORY, "tools": [TOOL], **GREEDY},
    {"messages": HISTORY, "tools": [TOOL], "stream": True, **GREEDY},
    # 400s
    {"messages": ASK, "tools": [TOOL], "tool_choice":
     {"type": "function", "function": {"name": "nope"}}, **GREEDY},
    {"messages": ASK, "tools": [], **GREEDY},
    {"messages": ASK, "tool_choice": "auto", **GREEDY},
    {"messages": ASK, "tools": [TOOL], "tool_choice": "sometimes", **GREEDY},
]  # fmt: skip


def _summary(body: dict[str, Any], response: httpx.Response) -> dict[str, Any]:
    if response.status_code != 200:
        error = response.json()["error"]
        return {"status": response.status_code, "message": error["message"]}
    if not body.get("stream"):
        data = response.json()
        return {
            "choices": [
                {
                    "index": c["index"],
                    "content": c["message"]["content"],
                    "reasoning": c["message"].get("reasoning"),
                    "tool_calls": [t["function"] for t in c["message"].get("tool_calls") or []],
                    "finish_reason": c["finish_reason"],
                }
                for c in data["choices"]
            ],
            "usage": {k: data["usage"][k] for k in ("prompt_tokens", "completion_tokens")},
        }
    folded: dict[int, dict[str, Any]] = {}
    for block in response.text.split("\n\n"):
        payload = block.strip().removeprefix("data: ")
        if not payload or payload == "[DONE]":
            continue
        for c in json.loads(payload)["choices"]:
            entry = folded.setdefault(
                c["index"], {"content": "", "tool_calls": [], "finish_reason": None}
            )
            delta = c["delta"]
            entry["content"] += delta.get("content") or ""
            entry["tool_calls"] += delta.get("tool_calls") or []
            if c.get("finish_reason"):
                entry["finish_reason"] = c["finish_reason"]
    return {"choices": [folded[i] for i in sorted(folded)]}


def _run(port: int) -> list[dict[str, Any]]:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
        return [
            _summary(body, http.post("/v1/chat/completions", json={"model": SERVED, **body}))
            for body in CASES
        ]


def test_hermes_tool_requests_match_vllm_serve() -> None:
    expected, got = serve_pair(_run, server_args=FLAGS)
    for body, want, have in zip(CASES, expected, got, strict=True):
        assert have == want, body
    # not vacuous: text came out, and the bad requests were refused
    assert all(c["content"] for r in expected[:6] for c in r["choices"])
    assert [r.get("status") for r in expected[6:]] == [400] * 4
