"""Tool-call and reasoning parsers: every delta as vLLM 0.32's own parser classes give it.

``data/parser_parity.json`` holds what vLLM's classes returned for the cases of
``parser_cases.py`` (recorded with ``parsers_vllm.py`` in vLLM's python; the vllm tier's
``test_parsers_vllm.py`` re-runs vLLM live and checks the table is still its answer).
Here, in the default suite, our parsers must give the same for every case: the
non-streaming result, each streamed delta, and the state the server reads at the end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from trio_vllm.text.reasoning import reasoning_parser_class
from trio_vllm.text.tools import (
    ChatOutputParser,
    DeltaMessage,
    HermesToolParser,
    Llama3JsonToolParser,
    tool_parser_class,
)

from . import parser_cases

TABLE: dict[str, dict[str, Any]] = json.loads(
    Path(__file__).with_name("data").joinpath("parser_parity.json").read_text("utf-8")
)


def _to_data(result: object) -> object:
    # A streamed delta with its explicit nulls (UNSET fields are left out); anything
    # else without its None fields, as the vLLM side dumps them.
    if isinstance(result, DeltaMessage):
        return msgspec.to_builtins(result)
    return _without_none(msgspec.to_builtins(result))


def _without_none(value: object) -> object:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


def ours_tools(name: str, deltas: list[str]) -> dict[str, Any]:
    cls = tool_parser_class(name)
    tokenizer = parser_cases.FakeTokenizer()
    return parser_cases.drive_tool_parser(lambda: cls(tokenizer), _to_data, deltas)


def ours_reasoning(name: str, deltas: list[str]) -> dict[str, Any]:
    # "qwen3_nothink": qwen3 with the request's enable_thinking=False.
    kwargs = {"enable_thinking": False} if name == "qwen3_nothink" else None
    cls = reasoning_parser_class(name.removesuffix("_nothink"))
    tokenizer = parser_cases.FakeTokenizer()
    return parser_cases.drive_reasoning_parser(
        lambda: cls(tokenizer, chat_template_kwargs=kwargs), _to_data, deltas
    )


@pytest.mark.parametrize(
    ("name", "case", "deltas"),
    parser_cases.TOOL_CASES,
    ids=[f"{n}/{c}" for n, c, _ in parser_cases.TOOL_CASES],
)
def test_tool_parser_matches_vllm(name: str, case: str, deltas: list[str]) -> None:
    assert ours_tools(name, deltas) == TABLE["tools"][f"{name}/{case}"]


@pytest.mark.parametrize(
    ("name", "case", "deltas"),
    parser_cases.REASONING_CASES,
    ids=[f"{n}/{c}" for n, c, _ in parser_cases.REASONING_CASES],
)
def test_reasoning_parser_matches_vllm(name: str, case: str, deltas: list[str]) -> None:
    assert ours_reasoning(name, deltas) == TABLE["reasoning"][f"{name}/{case}"]


def ours_chain(reasoning: str, tool: str, choice: str, deltas: list[str]) -> dict[str, Any]:
    tokenizer = parser_cases.FakeTokenizer()

    def make() -> ChatOutputParser:
        return ChatOutputParser(
            reasoning_parser_class(reasoning)(tokenizer, chat_template_kwargs={})
            if reasoning
            else None,
            tool_parser_class(tool)(tokenizer, parser_cases.CHAIN_TOOLS) if tool else None,
            tool_choice=parser_cases.chain_choice(choice),
            enable_auto_tools=True,
        )

    return parser_cases.drive_chain(make, _to_data, deltas)


CHAIN_IDS = [f"{r}+{t}/{c}/{n}" for r, t, c, n, _ in parser_cases.CHAIN_CASES]


@pytest.mark.parametrize(("reasoning", "tool", "choice", "case", "deltas"),
                         parser_cases.CHAIN_CASES, ids=CHAIN_IDS)  # fmt: skip
def test_the_server_chain_matches_vllm(
    reasoning: str, tool: str, choice: str, case: str, deltas: list[str]
) -> None:
    """Reasoning, then tools, per choice: vLLM's DelegatingParser as its chat serving
    drives it (``parse``, ``parse_delta`` with the prompt ids, the last one finished)."""
    key = f"{reasoning}+{tool}/{choice}/{case}"
    assert ours_chain(reasoning, tool, choice, deltas) == TABLE["chain"][key]


def test_the_table_covers_every_case_and_says_something() -> None:
    """The recorded table has exactly the cases (no stale or missing entry), and the
    cases exercise what they claim: calls found, calls refused, deltas streamed."""
    tool_keys = {f"{n}/{c}" for n, c, _ in parser_cases.TOOL_CASES}
    reasoning_keys = {f"{n}/{c}" for n, c, _ in parser_cases.REASONING_CASES}
    assert set(TABLE["tools"]) == tool_keys
    assert set(TABLE["reasoning"]) == reasoning_keys
    assert set(TABLE["chain"]) == set(CHAIN_IDS)
    called = {k for k, v in TABLE["tools"].items() if v["extracted"]["tools_called"]}
    assert {"hermes/two-calls", "llama3_json/two-calls", "pythonic/two-calls"} <= called
    assert "hermes/bad-json" not in called
    two = TABLE["tools"]["hermes/two-calls"]["extracted"]["tool_calls"]
    assert [c["function"]["name"] for c in two] == ["get_weather", "get_time"]


def test_a_streamed_call_adds_up_to_the_extracted_one() -> None:
    """Concatenated argument deltas are the non-streaming arguments (hermes)."""
    deltas = dict((c, d) for n, c, d in parser_cases.TOOL_CASES if n == "hermes")["two-calls"]
    result = ours_tools("hermes", deltas)
    args: dict[int, str] = {}
    for delta in result["stream"]:
        for call in (delta or {}).get("tool_calls", []):
            args[call["index"]] = args.get(call["index"], "") + call["function"].get(
                "arguments", ""
            )
    extracted = result["extracted"]["tool_calls"]
    assert [json.loads(args[i]) for i in range(2)] == [
        json.loads(c["function"]["arguments"]) for c in extracted
    ]


def test_tool_call_ids_are_fresh_and_vllm_shaped() -> None:
    parser = HermesToolParser(parser_cases.FakeTokenizer())
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    first, second = (parser.extract_tool_calls(text).tool_calls[0].id for _ in range(2))
    assert first != second
    assert first.startswith("chatcmpl-tool-")
    assert len(first) == len("chatcmpl-tool-") + 16


def test_deltas_encode_as_vllm_sends_them() -> None:
    """None fields and an empty tool_calls are left out of the JSON, as vLLM's serializer."""
    assert msgspec.json.encode(DeltaMessage(content="x")) == b'{"content":"x"}'
    assert msgspec.json.encode(DeltaMessage(reasoning="")) == b'{"reasoning":""}'


def test_missing_marker_tokens_are_refused_as_vllm() -> None:
    class NoTokens:
        def token_to_id(self, token: str) -> int | None:
            return None

    with pytest.raises(RuntimeError, match="python_tag"):
        Llama3JsonToolParser(NoTokens())
    with pytest.raises(RuntimeError, match="think start/end tokens"):
        reasoning_parser_class("deepseek_r1")(NoTokens())


def test_unknown_parser_names_say_the_known_ones() -> None:
    with pytest.raises(KeyError, match="known: hermes, llama3_json, pythonic"):
        tool_parser_class("nope")
    with pytest.raises(KeyError, match="deepseek_r1"):
        reasoning_parser_class("nope")
