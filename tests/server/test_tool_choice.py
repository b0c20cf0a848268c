"""tool_choice required / named (and auto with strict tools or a single-call limit):
the structured output sent to the engine, against vLLM 0.32's own answer for each case
of tool_constraint_cases.py (recorded in data/tool_constraints.json by
tool_constraints_vllm.py in vLLM's python; re-run live in the vllm tier)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trio_vllm import InvalidRequestError, StructuredOutputsParams
from trio_vllm.text.tools import tool_choice_constraint

from . import tool_constraint_cases as cases

RECORDED: dict[str, Any] = json.loads(
    Path(__file__).with_name("data").joinpath("tool_constraints.json").read_text("utf-8")
)


def ours(parser: str, fields: dict[str, Any]) -> dict[str, Any]:
    """What we send, in the recording's shape (set fields; skip_special_tokens)."""
    from trio_vllm.server._schemas import ChatCompletionRequest
    from trio_vllm.server._structured import structured_outputs_for
    from trio_vllm.server._tools import ToolOptions, skip_special_tokens, tool_choice_of

    req = ChatCompletionRequest(messages=[{"role": "user", "content": "q"}], **fields)
    options = ToolOptions(enable_auto_tool_choice=True, tool_call_parser=parser)
    choice = tool_choice_of(req)
    so = structured_outputs_for(
        req.response_format, req.structured_outputs, chat=True, tool_choice=req.tool_choice
    )
    so = tool_choice_constraint(
        parser,
        req.tools,
        choice,
        parallel_tool_calls=req.parallel_tool_calls,
        structured_outputs=so,
    )
    return {
        "structured_outputs": None
        if so is None
        else {
            name: getattr(so, name)
            for name in StructuredOutputsParams.__struct_fields__
            if not name.startswith("_") and getattr(so, name) not in (None, False)
        },
        "skip_special_tokens": skip_special_tokens(req, options, choice),
    }


KEYS = [(p, n, f) for p in cases.PARSERS for n, f in cases.CASES]


@pytest.mark.parametrize(("parser", "case", "fields"), KEYS, ids=[f"{p}/{n}" for p, n, _ in KEYS])
def test_constraint_is_vllms(parser: str, case: str, fields: dict[str, Any]) -> None:
    want = RECORDED[f"{parser}/{case}"]
    got = ours(parser, fields)
    assert got == want
    # the same bytes: key order inside schemas and tags too
    assert json.dumps(got) == json.dumps(want)


def test_the_recording_covers_every_case_and_constrains() -> None:
    assert sorted(RECORDED) == sorted(f"{p}/{n}" for p, n, _ in KEYS)
    tags = [k for k, v in RECORDED.items() if "structural_tag" in (v["structured_outputs"] or {})]
    schemas = [k for k, v in RECORDED.items() if "json" in (v["structured_outputs"] or {})]
    assert "hermes/required" in tags
    assert "llama3_json/named" in tags
    assert "pythonic/required" in schemas
    assert "pythonic/named" in schemas


def test_the_request_is_left_alone() -> None:
    tools = [json.loads(json.dumps(cases.DEFS))]
    before = json.dumps(tools)
    tool_choice_constraint("pythonic", tools, "required")
    assert json.dumps(tools) == before  # vLLM pops $defs from its request; we copy


def test_refusals() -> None:
    bad_defs = {"type": "function", "function": {"name": "f", "parameters": {"$defs": 1}}}
    with pytest.raises(InvalidRequestError, match="must be an object") as info:
        tool_choice_constraint("pythonic", [bad_defs], "required")
    assert info.value.param == "tools"
    with pytest.raises(InvalidRequestError, match="not supported by trio-vllm"):
        tool_choice_constraint(
            "hermes",
            [cases.STRICT],
            "auto",
            structured_outputs=StructuredOutputsParams(json_object=True),
        )
