"""``trio-vllm serve --enable-auto-tool-choice --tool-call-parser hermes`` against
``vllm serve`` with the same flags, on tiny-llama (dummy weights).

The random weights never write a tool call unprompted, so for tool_choice auto and none
this checks the request side and the response shapes: the same content, tool calls
(none), finish reasons and token counts, streamed and not, a tool-result turn in the
history, and the same 400s (status and message) for bad tool requests. tool_choice
required and named (and auto with a strict tool or ``parallel_tool_calls: false``) are
constrained by the engine (xgrammar) with the structural tag (hermes) or JSON schema
(pythonic) the frontend derives from the tools, so there the model does write calls:
the same calls, arguments and finish reasons. Every response is also compared whole,
as JSON (ids and timestamps aside), chunk by chunk when streamed: the shapes
(``tool_calls`` left out when empty, ``null`` versus a missing field) are vLLM's.
Parsing of free tool-call text is the parser table's job (tests/text/test_parsers*.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from ._servers import SERVE_ARGS, SERVED, VLLM_CLI, serve_pair, vllm_lock
from .conftest import ENGINE_ENV, TINY_MODEL, vllm_python

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
LONG = {"temperature": 0, "max_tokens": 60}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
STRICT = {
    "type": "function",
    "function": {
        "name": "add",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}
USAGE = {"stream_options": {"include_usage": True}}
CASES: list[dict[str, Any]] = [
    {"messages": ASK, "tools": [TOOL], **GREEDY},
    {"messages": ASK, "tools": [TOOL], "stream": True, **GREEDY},
    {"messages": ASK, "tools": [TOOL], "tool_choice": "none", **GREEDY},
    {"messages": ASK, "tools": [TOOL], "tool_choice": "auto", "stream": True, "n": 2,
     "seed": 3, "temperature": 1.0, "max_tokens": 6},
    {"messages": HISTORY, "tools": [TOOL], **GREEDY},
    {"messages": HISTORY, "tools": [TOOL], "stream": True, **GREEDY},
    # constrained by the tools' structural tag
    {"messages": ASK, "tools": [TOOL, STRICT], "tool_choice": "required", **LONG},
    {"messages": ASK, "tools": [TOOL, STRICT], "tool_choice": "required", "stream": True,
     **USAGE, **LONG},
    {"messages": ASK, "tools": [TOOL], "tool_choice": NAMED, **LONG},
    {"messages": ASK, "tools": [TOOL], "tool_choice": NAMED, "stream": True, **LONG},
    {"messages": ASK, "tools": [STRICT, TOOL], "tool_choice": "required",
     "parallel_tool_calls": False, "stream": True, **LONG},
    {"messages": ASK, "tools": [TOOL], "tool_choice": NAMED,
     "response_format": {"type": "json_object"}, **LONG},
    {"messages": ASK, "tools": [STRICT], "tool_choice": "auto", **LONG},
    {"messages": ASK, "tools": [TOOL], "parallel_tool_calls": False, "stream": True, **LONG},
    # 400s
    {"messages": ASK, "tools": [TOOL], "tool_choice":
     {"type": "function", "function": {"name": "nope"}}, **GREEDY},
    {"messages": ASK, "tools": [], **GREEDY},
    {"messages": ASK, "tool_choice": "auto", **GREEDY},
    {"messages": ASK, "tools": [TOOL], "tool_choice": "sometimes", **GREEDY},
]  # fmt: skip


_OWN = {"id": "<id>", "created": "<t>", "system_fingerprint": "<server>"}


def _normalized(value: Any) -> Any:
    """A response (or chunk) as JSON, ids, timestamps and the server's fingerprint
    (``vllm-...`` / ``trio-vllm-...``, each server's own) replaced; an explicit
    ``null`` id stays ``null``."""
    if isinstance(value, dict):
        return {
            k: _OWN[k] if k in _OWN and v is not None else _normalized(v) for k, v in value.items()
        }
    if isinstance(value, list):
        return [_normalized(v) for v in value]
    return value


def _whole(body: dict[str, Any], response: httpx.Response) -> Any:
    if response.status_code != 200 or not body.get("stream"):
        return _normalized(response.json())
    chunks = [
        _normalized(json.loads(b.strip().removeprefix("data: ")))
        for b in response.text.split("\n\n")
        if b.strip() and b.strip() != "data: [DONE]"
    ]
    # With n > 1 the choices' chunks interleave as the engine's outputs came: compare
    # each choice's own sequence (a chunk carries one choice; the usage chunk none).
    return sorted(chunks, key=lambda c: c["choices"][0]["index"] if c["choices"] else 1 << 30)


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
                c["index"], {"content": "", "calls": {}, "finish_reason": None}
            )
            delta = c["delta"]
            entry["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                # a call's pieces joined: its name once, its arguments in order
                got = entry["calls"].setdefault(call["index"], {"name": None, "arguments": ""})
                function = call.get("function") or {}
                got["name"] = got["name"] or function.get("name")
                got["arguments"] += function.get("arguments") or ""
            if c.get("finish_reason"):
                entry["finish_reason"] = c["finish_reason"]
    choices = []
    for i in sorted(folded):
        entry = folded[i]
        calls = entry.pop("calls")
        choices.append({**entry, "tool_calls": [calls[k] for k in sorted(calls)]})
    return {"choices": choices}


def _run(port: int, cases: list[dict[str, Any]]) -> list[tuple[Any, Any]]:
    out = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
        for body in cases:
            response = http.post("/v1/chat/completions", json={"model": SERVED, **body})
            out.append((_summary(body, response), _whole(body, response)))
    return out


def _compare(cases: list[dict[str, Any]], expected: list[Any], got: list[Any]) -> None:
    """Every difference at once (a run costs minutes): summaries, then whole JSON."""
    bad = []
    for body, (want, want_whole), (have, have_whole) in zip(cases, expected, got, strict=True):
        if have != want:
            bad.append(("summary", json.dumps(body)[:200], want, have))
        elif have_whole != want_whole:
            bad.append(("json", json.dumps(body)[:200], want_whole, have_whole))
    assert bad == [], "\n\n".join(map(repr, bad))


def test_hermes_tool_requests_match_vllm_serve() -> None:
    expected, got = serve_pair(lambda port: _run(port, CASES), server_args=FLAGS)
    _compare(CASES, expected, got)
    summaries = [summary for summary, _ in expected]
    # not vacuous: text came out, calls were made, and the bad requests were refused
    assert all(c["content"] for r in summaries[:6] for c in r["choices"])
    assert any(c["tool_calls"] for r in summaries[6:14] for c in r["choices"])
    assert [r.get("status") for r in summaries[14:]] == [400] * 4


PYTHONIC_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic")
PYTHONIC_CASES: list[dict[str, Any]] = [
    {"messages": ASK, "tools": [TOOL, STRICT], "tool_choice": "required", **LONG},
    {"messages": ASK, "tools": [TOOL, STRICT], "tool_choice": "required", "stream": True,
     **USAGE, **LONG},
    {"messages": ASK, "tools": [TOOL], "tool_choice": NAMED, **LONG},
    {"messages": ASK, "tools": [TOOL], "tool_choice": NAMED, "stream": True, **LONG},
    {"messages": ASK, "tools": [TOOL, STRICT], "tool_choice": "required",
     "parallel_tool_calls": False, "stream": True, **LONG},
    {"messages": ASK, "tools": [TOOL], **GREEDY},
]  # fmt: skip


def test_pythonic_required_and_named_match_vllm_serve() -> None:
    """The JSON-schema path (a parser without a structural tag)."""
    expected, got = serve_pair(lambda port: _run(port, PYTHONIC_CASES), server_args=PYTHONIC_FLAGS)
    _compare(PYTHONIC_CASES, expected, got)
    summaries = [summary for summary, _ in expected]
    assert any(c["tool_calls"] for r in summaries[:5] for c in r["choices"])


def test_the_recorded_tool_constraints_are_vllms_answer() -> None:
    """tests/server/data/tool_constraints.json (what the default suite checks ours
    against) is what vLLM 0.32 answers now, in its own python (no engine)."""
    script = Path(__file__).parents[1] / "server" / "tool_constraints_vllm.py"
    proc = subprocess.run(
        [vllm_python(), str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout[proc.stdout.rindex("@@RESULT@@") + len("@@RESULT@@") :])
    recorded = json.loads(script.with_name("data").joinpath("tool_constraints.json").read_text())
    assert answer == recorded
    assert json.dumps(answer) == json.dumps(recorded)  # key order too


def _startup_error(command: list[str]) -> str:
    """The error a server that must not start prints (it exits by itself)."""
    proc = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, **ENGINE_ENV},
    )
    assert proc.returncode != 0, proc.stdout[-2000:]
    found = re.search(r"--tool-call-parser mistral cannot be used with the tokenizer of '[^']*': "
                      r"[^\n]*", proc.stderr)  # fmt: skip
    assert found, proc.stderr[-4000:]
    return found.group(0)


def test_mistral_on_a_tokenizer_without_its_token_stops_both_servers() -> None:
    """tiny-llama has no [TOOL_CALLS]: vllm serve refuses to start with
    --tool-call-parser mistral, and so does trio-vllm serve, with the same words (the
    model path aside)."""
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "mistral"]
    python = vllm_python()
    with vllm_lock():
        theirs = _startup_error(
            [python, str(VLLM_CLI), "serve", str(TINY_MODEL), "--port", "0", *SERVE_ARGS, *flags]
        )
        ours = _startup_error(
            [sys.executable, "-m", "trio_vllm.cli", "serve", "--engine", "vllm",
             "--vllm-python", python, "--model", str(TINY_MODEL), "--port", "0",
             f"--engine-args={' '.join(SERVE_ARGS)}", "--ready-timeout", "800", *flags]
        )  # fmt: skip
    strip = re.compile(r"tokenizer of '[^']*'")
    assert strip.sub("tokenizer of M", ours) == strip.sub("tokenizer of M", theirs)
    assert theirs.endswith("Mistral parser could not locate the tool call token in the tokenizer!")
