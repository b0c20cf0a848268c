"""Structured outputs against stock vLLM 0.32.0 (the engine core does the constrained
decoding; trio-vllm does the frontend's part).

- A stock engine core given a bad grammar directly (no frontend checks) fails just that
  request (finish reason ERROR, no tokens) and keeps serving.
- ``trio-vllm serve`` (a spawned stock engine) answers every case of `CASES` as ``vllm
  serve`` does: text, finish and stop reasons, usage, streamed and not; the bad schema,
  regex and grammar cases with the same HTTP 400 error object.
- ``resolve_structured_outputs`` (the frontend's backend choice, grammar rewrite and
  grammar check) gives what vLLM's own ``_validate_structured_outputs`` gives.
- ``open_llm`` gives what ``LLM.generate`` / ``LLM.chat`` give for the same constraints.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import msgspec
import pytest

import trio_vllm as tv
from trio_vllm import InvalidRequestError
from trio_vllm.client import VllmEngines, make_request
from trio_vllm.protocol import StructuredOutputsParams
from trio_vllm.protocol.structured import resolve_structured_outputs
from trio_vllm.sync import SyncClient

from ._servers import SERVED, serve_pair, vllm_lock
from .conftest import ENGINE_ARGS, ENGINE_ENV, EXPECTED_GREEDY, TINY_MODEL, vllm_python
from .llm_reference import request_output_json
from .test_serve_parity import _summary
from .test_text_frontend_parity import _json, _vllm_side

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(autouse=True)
def _one_stock_vllm_at_a_time() -> Iterator[None]:
    with vllm_lock():  # every test here starts a stock engine or server
        yield


OUR_ENGINE_ARGS = [a for a in ENGINE_ARGS if a != "--skip-tokenizer-init"]
_P = "/v1/completions"
_C = "/v1/chat/completions"
_MSG = [{"role": "user", "content": "Give me a number"}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
_RF_SCHEMA = {"type": "json_schema", "json_schema": {"name": "num", "schema": SCHEMA}}

# Answered (200): each form of structured output, streamed and not.
CASES: list[tuple[str, dict[str, Any]]] = [
    (_P, {"prompt": "The answer:", "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}),
    (_P, {"prompt": "The answer:", "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"},
          "stream": True, "stream_options": {"include_usage": True}}),
    (_P, {"prompt": "Yes or no?", "structured_outputs": {"choice": ["yes", "no", "maybe"]}}),
    (_P, {"prompt": "Grammar", "structured_outputs": {"grammar": 'root ::= "a" ("b" | "c")*'},
          "max_tokens": 6}),
    (_P, {"prompt": "JSON:", "structured_outputs": {"json": SCHEMA}, "max_tokens": 30}),
    (_P, {"prompt": "JSON:", "response_format": {"type": "json_object"}, "max_tokens": 30}),
    (_C, {"messages": _MSG, "response_format": _RF_SCHEMA, "max_tokens": 30}),
    (_C, {"messages": _MSG, "response_format": _RF_SCHEMA, "max_tokens": 30, "stream": True,
          "stream_options": {"include_usage": True}}),
    (_C, {"messages": _MSG, "response_format": {"type": "json_object"}, "max_tokens": 30}),
    (_C, {"messages": _MSG, "structured_outputs": {"choice": ["red", "green"]}, "stream": True,
          "stream_options": {"include_usage": True}}),
    (_C, {"messages": _MSG, "response_format": {"type": "text"}, "max_tokens": 8}),
    (_P, {"prompt": "Unconstrained", "guided_regex": "[0-9]+", "max_tokens": 8}),
]  # fmt: skip

# Refused (400): the same error object from both servers.
BAD: list[tuple[str, dict[str, Any]]] = [
    (_P, {"prompt": "x", "structured_outputs": {"regex": "a+("}}),
    (_C, {"messages": _MSG, "structured_outputs": {"regex": "(["}}),
    (_P, {"prompt": "x", "structured_outputs": {"json": {"type": "objectx"}}}),
    (_C, {"messages": _MSG, "response_format": {"type": "json_schema",
          "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}),
    (_P, {"prompt": "x", "structured_outputs": {"json": "{not json"}}),
    (_P, {"prompt": "x", "structured_outputs": {"grammar": 'root ::= "a'}}),
    (_C, {"messages": _MSG, "structured_outputs": {"grammar": "root ::= undefined_rule"}}),
    (_P, {"prompt": "x", "structured_outputs": {"choice": []}}),
    (_P, {"prompt": "x", "structured_outputs": {"json": SCHEMA, "regex": "a"}}),
    (_C, {"messages": _MSG, "structured_outputs": {"choice": ["a"], "regex": "a"}}),
    (_P, {"prompt": "x", "response_format": {"type": "json_schema"}}),
    (_C, {"messages": _MSG, "structured_outputs": {"json_object": False}}),
]  # fmt: skip


def test_stock_engine_fails_only_the_bad_grammar_request() -> None:
    engines = VllmEngines(
        str(TINY_MODEL), python=vllm_python(), extra_args=OUR_ENGINE_ARGS, env=ENGINE_ENV
    )
    with SyncClient(engines, ready_timeout=500) as client:
        for bad in (
            StructuredOutputsParams(regex="a+(", _backend="xgrammar"),
            StructuredOutputsParams(grammar='root ::= "a', _backend="xgrammar"),
            StructuredOutputsParams(json='{"type": "objectx"}', _backend="xgrammar"),
        ):
            request = make_request([1, 5, 7, 9], max_tokens=8, temperature=0.0)
            request.sampling_params.structured_outputs = bad  # type: ignore[union-attr]
            outputs = list(client.generate(request))
            assert [t for o in outputs for t in o.new_token_ids] == [], bad
            assert str(outputs[-1].finish_reason) == "error", bad
        # ... and it keeps serving, unconstrained and constrained.
        plain = list(client.generate(make_request([1, 5, 7, 9], max_tokens=8, temperature=0.0)))
        assert [t for o in plain for t in o.new_token_ids] == EXPECTED_GREEDY
        good = make_request([1, 5, 7, 9], max_tokens=8, temperature=0.0)
        good.sampling_params.structured_outputs = StructuredOutputsParams(  # type: ignore[union-attr]
            choice=None, grammar='root ::= "yes" | "no"', _backend="xgrammar"
        )
        good.sampling_params._eos_token_id = 2  # type: ignore[union-attr]  # tiny-llama's
        out = list(client.generate(good))
        # The grammar ends after a word; then only EOS is allowed, and it stops there.
        assert str(out[-1].finish_reason) == "stop"
        assert 2 <= sum(len(o.new_token_ids) for o in out) <= 4


def _run(port: int) -> list[Any]:
    results: list[Any] = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
        for path, body in CASES:
            full = {"model": SERVED, "temperature": 0, "max_tokens": 12, **body}
            results.append(_summary(path, full, http.post(path, json=full)))
        for path, body in BAD:
            response = http.post(path, json={"model": SERVED, "max_tokens": 4, **body})
            try:
                error = response.json().get("error")
            except ValueError:
                error = response.text
            results.append([response.status_code, error])
    return results


def test_serve_structured_outputs_match_vllm_serve() -> None:
    expected, got = serve_pair(_run)
    mismatches = [
        (json.dumps(case)[:160], want, have)
        for case, want, have in zip(CASES + BAD, expected, got, strict=True)
        if want != have
    ]
    assert mismatches == [], "\n".join(map(repr, mismatches))
    answered, refused = expected[: len(CASES)], expected[len(CASES) :]
    assert [status for status, _ in refused] == [400] * len(BAD)
    texts = [c["text"] for r in answered for c in r["choices"]]
    assert all(texts), texts
    assert texts[2] in ("yes", "no", "maybe")  # constrained, not vacuous


_SO_CASES: list[dict[str, Any]] = [
    {"kind": "generate", "prompt": "The answer:",
     "params": {"temperature": 0, "max_tokens": 12,
                "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}},
    {"kind": "generate", "prompt": "Yes or no?",
     "params": {"temperature": 0, "max_tokens": 12,
                "structured_outputs": {"choice": ["yes", "no"]}}},
    {"kind": "generate", "prompt": "JSON:",
     "params": {"temperature": 0, "max_tokens": 30, "structured_outputs": {"json": SCHEMA}}},
    {"kind": "generate", "prompt": "JSON:",
     "params": {"temperature": 0.8, "seed": 7, "max_tokens": 30,
                "structured_outputs": {"json_object": True}}},
    {"kind": "chat", "messages": _MSG,
     "params": {"temperature": 0, "max_tokens": 12,
                "structured_outputs": {"grammar": 'root ::= "a" ("b" | "c")*'}}},
]  # fmt: skip


async def _open_llm_side(python: str) -> list[Any]:
    engines = VllmEngines(str(TINY_MODEL), python=python, extra_args=OUR_ENGINE_ARGS,
                          env=ENGINE_ENV)  # fmt: skip
    ours: list[Any] = []
    async with tv.open_llm(engines, model=TINY_MODEL, ready_timeout=500, shutdown_grace=60) as llm:
        for case in _SO_CASES:
            fields = dict(case["params"])
            fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
            params = tv.SamplingParams(**fields)
            with anyio.fail_after(300):
                if case["kind"] == "chat":
                    out = await llm.chat_final(case["messages"], params)
                else:
                    out = await llm.generate_final(case["prompt"], params)
            ours.append(_json(request_output_json(out)))
    return ours


def test_open_llm_structured_outputs_match_llm_generate() -> None:
    python = vllm_python()
    ours = anyio.run(_open_llm_side, python, backend="trio")
    theirs = _vllm_side(python, _SO_CASES)
    for case, mine, expected in zip(_SO_CASES, ours, theirs, strict=True):
        assert mine == expected, f"case {case}:\nours   {mine}\nvLLM's {expected}"
    assert theirs[1]["outputs"][0]["text"] in ("yes", "no")


RESOLUTIONS: list[dict[str, Any]] = [
    {"regex": "a+("}, {"regex": "(["}, {"regex": r"\d+"}, {"json": {"type": "objectx"}},
    {"json": '{"type": "objectx"}'}, {"json": "{not json"}, {"grammar": 'root ::= "a'},
    {"grammar": "root ::= undefined_rule"}, {"grammar": 'start: "a" | "b"'},
    {"choice": ["a", 'b"', "c\nd"]}, {"json_object": True}, {"json": SCHEMA},
    {"json": {"type": "integer", "multipleOf": 3}},
    {"json": {"type": "array", "uniqueItems": True}},
    {"json": {"type": "string", "format": "color"}},
    {"json": {"type": "string", "pattern": "a+", "maxLength": 3}},
    {"json": {"type": "object", "patternProperties": {"^a": {"type": "integer"}},
              "properties": {"b": {}}}},
    {"json": {"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]}},
    {"json": {"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.5}}}},
    {"json": {"type": "object", "propertyNames": {"pattern": "^a"}, "properties": {"a": {}}}},
    {"json": SCHEMA, "disable_any_whitespace": True},
]  # fmt: skip


def test_resolution_matches_vllms_frontend() -> None:
    proc = subprocess.run(
        [vllm_python(), str(Path(__file__).with_name("structured_reference.py")),
         str(TINY_MODEL)],
        input=json.dumps(RESOLUTIONS), capture_output=True, text=True, timeout=600,
        check=False, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    theirs = json.loads(proc.stdout[proc.stdout.rindex("@@RESULT@@") + len("@@RESULT@@") :])
    ours: list[Any] = []
    for case in RESOLUTIONS:
        try:
            so = resolve_structured_outputs(StructuredOutputsParams(**case))
            ours.append(["ok", msgspec.structs.asdict(so)])
        except InvalidRequestError as exc:
            ours.append(["err", str(exc)])
    diffs = [(c, t, o) for c, t, o in zip(RESOLUTIONS, theirs, ours, strict=True) if t != o]
    assert diffs == [], "\n".join(map(repr, diffs))
    assert sum(r[0] == "err" for r in theirs) >= 6  # not vacuous: refusals and answers
    assert {r[1]["_backend"] for r in theirs if r[0] == "ok"} >= {"xgrammar", "guidance"}
