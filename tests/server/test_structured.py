"""``response_format`` / ``structured_outputs`` on the server: vLLM's mapping (sans-I/O)
and its HTTP answers. The reference engine cannot constrain its output: a structured
request that passes every check fails at the engine (finish reason ERROR, HTTP 500 as
``vllm serve`` answers an engine error) and the engine keeps serving."""

from __future__ import annotations

import json
import logging

import pytest

from trio_vllm import StructuredOutputsParams
from trio_vllm.protocol import structured
from trio_vllm.server import _structured as server_structured
from trio_vllm.server._http import HTTPError
from trio_vllm.server._structured import structured_outputs_for

from ._util import Served, raw_request

S = StructuredOutputsParams
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize("chat", [False, True])
def test_response_format_maps_as_vllm(chat: bool) -> None:
    assert structured_outputs_for(None, None, chat=chat) is None
    assert structured_outputs_for({"type": "text"}, None, chat=chat) is None
    assert structured_outputs_for({"type": "text"}, {"regex": "a"}, chat=chat) == S(regex="a")
    assert structured_outputs_for({"type": "json_object"}, None, chat=chat) == S(json_object=True)
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}
    assert structured_outputs_for(rf, None, chat=chat) == S(json=SCHEMA)
    # response_format is laid over structured_outputs (vLLM's dataclasses.replace).
    both = structured_outputs_for(rf, {"regex": "a", "disable_any_whitespace": True}, chat=chat)
    assert both == S(json=SCHEMA, regex="a", disable_any_whitespace=True)
    # the private fields are init=False in vLLM: a client cannot set them
    assert structured_outputs_for(None, {"choice": ["x"], "_backend": "outlines"}, chat=chat) == (
        S(choice=["x"])
    )


@pytest.mark.parametrize(
    ("rf", "so", "chat", "message", "param"),
    [
        (
            {"type": "json_schema"},
            None,
            False,
            "When response_format type is 'json_schema', the 'json_schema' field must be provided."
            " (parameter=response_format)",
            "response_format",
        ),
        (
            None,
            {"json": SCHEMA, "regex": "a"},
            False,
            "You can only use one kind of constraints for structured outputs ('json', "
            "'regex' or 'choice'). (parameter=structured_outputs)",
            "structured_outputs",
        ),
        (
            None,
            {"choice": ["a"], "regex": "a"},
            True,
            "You can only use one kind of constraints for structured outputs ('json', "
            "'regex' or 'choice').",  # the chat model names no parameter
            None,
        ),
        ({"type": "structural_tag", "format": {}}, None, True, "not supported", "response_format"),
        (None, {"structural_tag": "{}"}, False, "not supported", "structured_outputs"),
    ],
)
def test_bodies_vllm_refuses(
    rf: object, so: object, chat: bool, message: str, param: str | None
) -> None:
    with pytest.raises(HTTPError) as info:
        structured_outputs_for(rf, so, chat=chat)
    assert message in str(info.value)
    assert info.value.param == param
    if "constraints" in message:
        assert str(info.value) == message


def test_constraint_and_named_tool() -> None:
    named = {"type": "function", "function": {"name": "f"}}
    with pytest.raises(HTTPError, match="either use constraints for structured outputs or tools"):
        structured_outputs_for(None, {"regex": "a"}, chat=True, tool_choice=named)
    for choice in (None, "none", "auto", "required"):
        assert structured_outputs_for(None, {"regex": "a"}, chat=True, tool_choice=choice)


_JSON = {"content-type": "application/json"}


async def _post(served: Served, path: str, body: dict[str, object]) -> tuple[int, dict]:  # type: ignore[type-arg]
    status, _, data = await raw_request(served.port, "POST", path, json.dumps(body).encode(), _JSON)
    return status, json.loads(data)


@pytest.mark.anyio
async def test_http(
    served: Served, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    comp, chat = "/v1/completions", "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    bad: list[tuple[str, dict[str, object], str, str | None]] = [
        (comp, {"structured_outputs": {"choice": []}}, "Choice '[]' cannot be an empty list", None),
        (
            chat,
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 1}}},
            "1 validation error",
            None,
        ),
        (
            chat,
            {"structured_outputs": {"json_object": False}},
            "structured_outputs.json_object must be True if set",
            None,
        ),
        (
            comp,
            {"response_format": {"type": "json_schema"}},
            "When response_format type is 'json_schema', the 'json_schema' field",
            "response_format",
        ),
    ]
    if structured.grammar_checker_available():
        bad += [
            (
                comp,
                {"structured_outputs": {"regex": "a+("}},
                'Grammar error: at 1(8): invalid regex "a+("',
                None,
            ),
            (
                chat,
                {"structured_outputs": {"grammar": 'root ::= "a'}},
                "Invalid grammar specification: ",
                None,
            ),
            (
                chat,
                {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": {"type": "objectx"}},
                    }
                },
                "Grammar error: Invalid type: objectx",
                None,
            ),
        ]
    for path, fields, message, param in bad:
        body: dict[str, object] = {"max_tokens": 4, **fields}
        body.update({"prompt": "hi"} if path == comp else {"messages": msgs})
        status, data = await _post(served, path, body)
        assert status == 400, (fields, data)
        assert data["error"]["type"] in ("BadRequestError", "Bad Request")
        assert data["error"]["message"].startswith(message), (fields, data)
        # vLLM strips every error message (llguidance's end with a newline)
        assert data["error"]["message"] == data["error"]["message"].strip(), data
        if "validation error" not in message:
            assert data["error"]["param"] == param, data
    # A well-formed constraint reaches the reference engine, which cannot constrain: the
    # request fails there (vLLM's answer to an engine error) and nothing else does.
    for path in (comp, chat):
        body = {"max_tokens": 4, "response_format": {"type": "json_object"}}
        body.update({"prompt": "hi"} if path == comp else {"messages": msgs})
        status, data = await _post(served, path, body)
        assert status == 500, data
        assert data["error"]["message"] == "Internal server error"
    # The removed guided_* fields are ignored (unconstrained output), with vLLM's warning.
    monkeypatch.setattr(server_structured, "_WARNED", set())  # vLLM warns once per process
    with caplog.at_level(logging.WARNING, logger="trio_vllm.server"):
        status, data = await _post(
            served, comp, {"prompt": "ok", "max_tokens": 2, "guided_regex": "[0-9]+"}
        )
    assert status == 200, data
    assert data["choices"][0]["text"] == "ok"
    assert any(
        "removed guided-decoding field(s) ['guided_regex']" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
