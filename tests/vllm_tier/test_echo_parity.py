"""``echo`` with ``logprobs`` on ``/v1/completions``: ``trio-vllm serve`` answers what
``vllm serve`` 0.32.0 answers (the echoed prompt's logprobs are its prompt logprobs,
``null`` first, then the generated tokens'; text, tokens, offsets exactly, logprob values
to 1e-5), streaming (the chunks concatenated) and not, and refuses alike.

Both servers run the tiny model (dummy weights) in turn, each under the machine's
stock-vLLM lock held in-process (`serve_pair`).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from ._servers import SERVED, serve_pair
from .test_tokens_parity import _assert_close, _error, _plp

pytestmark = pytest.mark.timeout(1500)

BASE: dict[str, Any] = {"echo": True, "temperature": 0}
CASES: list[dict[str, Any]] = [
    {"prompt": "The quick brown fox", "max_tokens": 4, "logprobs": 2},
    {"prompt": "Once upon a time 日本", "max_tokens": 0, "logprobs": 0},
    {"prompt": [1, 5, 7, 9, 11], "max_tokens": 3, "logprobs": 1},
    {"prompt": ["a b c", "日本語 🎉"], "max_tokens": 2, "logprobs": 1, "n": 2},
    {"prompt": "Hello world", "max_tokens": 2, "logprobs": 3, "prompt_logprobs": 1},
    {"prompt": "Hello world", "max_tokens": 2, "logprobs": 1, "return_token_ids": True},
    {"prompt": "The quick brown fox", "max_tokens": 4, "logprobs": 2, "stream": True},
    {"prompt": "Once upon a time 日本", "max_tokens": 0, "logprobs": 0, "stream": True},
    {"prompt": ["a b c", "日本語 🎉"], "max_tokens": 2, "logprobs": 1, "stream": True,
     "stream_options": {"include_usage": True}},
    {"prompt": "Hello world", "max_tokens": 2, "logprobs": 1, "return_token_ids": True,
     "stream": True},
    {"prompt": "x", "max_tokens": 2, "logprobs": 21},
    {"prompt": "x", "max_tokens": 2, "logprobs": 1, "prompt_logprobs": 1, "stream": True},
]  # fmt: skip


def _choice(c: dict[str, Any]) -> dict[str, Any]:
    return {k: c.get(k) for k in ("index", "text", "logprobs", "finish_reason",
                                  "token_ids", "prompt_token_ids")} | {
        "prompt_logprobs": _plp(c.get("prompt_logprobs"))}  # fmt: skip


def _streamed(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The chunks of a stream per choice: text, logprobs lists, token ids concatenated;
    the last finish_reason; the usage chunk."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for event in events:
        usage = event.get("usage") or usage
        for c in event["choices"]:
            acc = choices.setdefault(c["index"], {
                "text": "", "logprobs": {"tokens": [], "token_logprobs": [],
                                         "top_logprobs": [], "text_offset": []},
                "token_ids": [], "prompt_token_ids": None, "finish_reason": None})  # fmt: skip
            acc["text"] += c["text"]
            for key, values in (c.get("logprobs") or {}).items():
                acc["logprobs"][key].extend(values)
            acc["token_ids"].extend(c.get("token_ids") or [])
            acc["prompt_token_ids"] = acc["prompt_token_ids"] or c.get("prompt_token_ids")
            acc["finish_reason"] = c.get("finish_reason") or acc["finish_reason"]
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


def _run(port: int) -> list[Any]:
    out: list[Any] = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
        for case in CASES:
            body = {"model": SERVED, **BASE, **case}
            if not case.get("stream"):
                r = http.post("/v1/completions", json=body)
                if r.status_code != 200:
                    out.append(_error(r))
                    continue
                data = r.json()
                out.append({"choices": [_choice(c) for c in data["choices"]],
                            "usage": data["usage"]})  # fmt: skip
                continue
            with http.stream("POST", "/v1/completions", json=body) as s:
                if s.status_code != 200:
                    s.read()
                    out.append(_error(s))
                    continue
                events = [json.loads(line[6:]) for line in s.iter_lines()
                          if line.startswith("data: {")]  # fmt: skip
            out.append(_streamed(events))
    return out


def test_echo_with_logprobs_matches_vllm_serve() -> None:
    expected, got = serve_pair(_run)
    mismatches: list[str] = []  # every case checked, all differences reported at once
    for case, want, have in zip(CASES, expected, got, strict=True):
        try:
            _assert_close(want, have, case)
        except AssertionError as exc:
            mismatches.append(str(exc))
    assert not mismatches, "\n\n".join(mismatches)
    # not vacuous: the echo carried prompt logprobs (null first, then values)
    first = expected[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None
    assert all(isinstance(v, float) for v in first["token_logprobs"][1:])
    assert expected[6]["choices"][0]["logprobs"]["token_logprobs"][1:]
    assert expected[-2]["status"] == 400
    assert expected[-1]["status"] == 400
