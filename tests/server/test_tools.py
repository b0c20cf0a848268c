"""Tool calling and reasoning in /v1/chat/completions (server/_tools.py): vLLM's checks
and messages, and responses built through the per-choice parsers, streamed and not.

Sans-I/O: plans from `plan_chat` over a stand-in frontend, responders fed outputs made
here (deltas a model could produce); no engine, no socket.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import pytest

from trio_vllm.server import OpenAIServer, ToolOptions
from trio_vllm.server._http import HTTPError
from trio_vllm.server._openai import ChatResponder, plan_chat
from trio_vllm.server._schemas import ChatCompletionRequest
from trio_vllm.text import CompletionOutput, RequestOutput

from .test_declared_fields import _Frontend

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
HERMES = ToolOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
MESSAGES = [{"role": "user", "content": "weather?"}]


def _plan(options: ToolOptions, stream: bool = False, **fields: Any) -> Any:
    req = ChatCompletionRequest(messages=MESSAGES, stream=stream, **fields)
    return plan_chat(
        req, _Frontend(), model="m", header_request_id="x", extra={}, tool_options=options
    )  # type: ignore[arg-type]


def _error(options: ToolOptions, **fields: Any) -> HTTPError:
    with pytest.raises(HTTPError) as info:
        _plan(options, **fields)
    return info.value


@pytest.mark.parametrize(
    ("options", "fields", "message"),
    [
        (ToolOptions(), {"tools": [TOOL]}, '"auto" tool choice requires --enable-auto-tool-choice'),
        (ToolOptions(), {"tools": [TOOL], "tool_choice": "required"},
         'tool_choice="required" requires --tool-call-parser to be set'),
        (ToolOptions(), {"tools": [TOOL], "tool_choice": {"type": "function", "function":
         {"name": "get_weather"}}}, 'tool_choice=function "get_weather" requires'),
        (HERMES, {"tools": []}, "`tools` must not be an empty array."),
        (HERMES, {"tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set."),
        (HERMES, {"tools": [TOOL], "tool_choice": "sometimes"},
         "Invalid value for `tool_choice`: sometimes!"),
        (HERMES, {"tools": [TOOL], "tool_choice": {"type": "function", "function":
         {"name": "nope"}}}, "The tool specified in `tool_choice` does not match any"),
        (HERMES, {"tools": [TOOL], "tool_choice": {"type": "function"}},
         "Invalid value for `function`: `None`"),
    ],
)  # fmt: skip
def test_tool_requests_are_checked_as_vllm(
    options: ToolOptions, fields: dict[str, Any], message: str
) -> None:
    assert message in str(_error(options, **fields))


NAMED = {"type": "function", "function": {"name": "get_weather"}}
PYTHONIC = ToolOptions(enable_auto_tool_choice=True, tool_call_parser="pythonic")


def test_required_and_named_send_the_tools_grammar() -> None:
    """The plan carries the constraint (test_tool_choice.py checks its every byte
    against vLLM's), over any response_format of the request."""
    for choice in ("required", NAMED):
        (params,) = _plan(
            HERMES, tools=[TOOL], tool_choice=choice, response_format={"type": "json_object"}
        ).params
        so = params.structured_outputs
        assert so is not None
        assert so.json_object is None
        assert json.loads(so.structural_tag or "")["format"]["type"] == "tags_with_separator"
    (params,) = _plan(PYTHONIC, tools=[TOOL], tool_choice=NAMED).params
    assert params.structured_outputs is not None
    assert params.structured_outputs.json == {"type": "object", "properties": {}}
    # auto and none leave the request's own constraint alone
    for choice in ("auto", "none"):
        (params,) = _plan(
            HERMES, tools=[TOOL], tool_choice=choice, response_format={"type": "json_object"}
        ).params
        assert params.structured_outputs is not None
        assert params.structured_outputs.json_object is True
    assert "not supported by trio-vllm" in str(
        _error(
            HERMES,
            tools=[TOOL],
            parallel_tool_calls=False,
            response_format={"type": "json_object"},
        )
    )


def _full(plan: Any, texts: list[str], finish: str = "stop") -> dict[str, Any]:
    responder = ChatResponder(plan, _Frontend.tokenizer, None)
    for out in _outputs(texts, finish):
        responder.on_output(0, out)
    (choice,) = json.loads(responder.finish())["choices"]
    return choice  # type: ignore[no-any-return]


def test_required_and_named_responses_in_vllms_shapes() -> None:
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # required: the calls, content "" (not null), finish reason tool_calls on a stop
    choice = _full(_plan(HERMES, tools=[TOOL], tool_choice="required"), [CALL])
    assert choice["message"]["content"] == ""
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [call]
    assert choice["finish_reason"] == "tool_calls"
    # cut short: hermes reads no call, the text stays content (vLLM's)
    choice = _full(_plan(HERMES, tools=[TOOL], tool_choice="required"), [CALL[:20]], "length")
    assert choice["message"]["content"] == CALL[:20]
    assert "tool_calls" not in choice["message"]  # vLLM drops an empty list
    choice = _full(_plan(HERMES, tools=[TOOL], tool_choice="required"), [" "], "length")
    assert choice["message"]["content"] == ""
    assert choice["finish_reason"] == "length"
    # named: the engine's finish reason
    choice = _full(_plan(HERMES, tools=[TOOL], tool_choice=NAMED), [CALL])
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [call]
    assert choice["finish_reason"] == "stop"
    # pythonic reads the schema's shapes: a named tool's arguments, a required array
    choice = _full(_plan(PYTHONIC, tools=[TOOL], tool_choice=NAMED), ['{"city": "Paris"}'])
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [call]
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    two = f"[{one}, {one}]"
    choice = _full(_plan(PYTHONIC, tools=[TOOL], tool_choice="required"), [two])
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [call, call]
    # parallel_tool_calls false keeps the first call only
    plan = _plan(PYTHONIC, tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    assert [c["function"] for c in _full(plan, [two])["message"]["tool_calls"]] == [call]


def _streamed(plan: Any, texts: list[str]) -> list[dict[str, Any]]:
    responder = ChatResponder(plan, _Frontend.tokenizer, None)
    body = b"".join(responder.on_output(0, o) for o in _outputs(texts)) + responder.finish()
    return [e["choices"][0] for e in _events(body)]


def test_required_and_named_streamed() -> None:
    choices = _streamed(
        _plan(PYTHONIC, stream=True, tools=[TOOL], tool_choice=NAMED), ['{"city"', ': "Paris"}']
    )
    first, second = (c["delta"]["tool_calls"] for c in choices[1:3])
    assert first[0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert first[0]["id"].startswith("chatcmpl-tool-")
    assert second == [{"index": 0, "function": {"arguments": ': "Paris"}'}}]
    assert choices[-1]["finish_reason"] == "stop"  # named: not tool_calls
    texts = ['[{"name": "get_weather", "parameters": ', '{"city": "Paris"}}, ', '{"name": "get_',
             'weather", "parameters": {}}]']  # fmt: skip
    choices = _streamed(_plan(PYTHONIC, stream=True, tools=[TOOL], tool_choice="required"), texts)
    calls = [c for ch in choices for c in ch["delta"].get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1]  # each announced once its value began
    assert "".join(c["function"]["arguments"] for c in calls if c["index"] == 0) == (
        '{"city": "Paris"}'
    )
    assert choices[-1]["finish_reason"] == "tool_calls"
    plan = _plan(
        PYTHONIC, stream=True, tools=[TOOL], tool_choice="required", parallel_tool_calls=False
    )
    calls = [c for ch in _streamed(plan, texts) for c in ch["delta"].get("tool_calls", [])]
    assert {c["index"] for c in calls} == {0}


def test_validator_errors_name_their_parameter_as_vllm_prints_them() -> None:
    """vLLM's request model raises VLLMValidationError(parameter=...): its str() ends
    with " (parameter=...)", and the 400's param is that parameter."""
    for fields, param in (
        ({"tools": []}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice.function"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
    ):  # fmt: skip
        error = _error(HERMES, **fields)
        assert error.message.endswith(f" (parameter={param})"), error.message
        assert error.param == param
    # the renderer's checks name none
    error = _error(ToolOptions(), tools=[TOOL])
    assert "(parameter=" not in error.message
    assert error.param is None


def test_flags_are_checked_as_vllm_serve_does() -> None:
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ToolOptions(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="invalid tool call parser: nope"):
        ToolOptions(tool_call_parser="nope")
    with pytest.raises(ValueError, match="invalid reasoning parser"):
        ToolOptions(reasoning_parser="nope")


def test_tools_reach_the_template_and_keep_special_tokens() -> None:
    plan = _plan(HERMES, tools=[TOOL])
    assert json.loads(plan.prompts[0]["prompt"])[-1] == [TOOL]
    assert plan.params[0].skip_special_tokens is False  # hermes' adjust_request
    assert _plan(HERMES, tools=[TOOL], tool_choice="none").params[0].skip_special_tokens
    assert _plan(ToolOptions()).parsers is None  # no flags: no parser, as vLLM


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
DELTAS = ["Let me check.", "<tool_call>", "\n", '{"name": "get_weather", ', '"arguments": ',
          '{"city": "Paris"}}', "\n", "</tool_call>"]  # fmt: skip


def _outputs(deltas: list[str], finish: str = "stop") -> list[RequestOutput]:
    outs = []
    for k, text in enumerate(deltas):
        last = k == len(deltas) - 1
        completion = CompletionOutput(0, text, [1000 + k], None, None, finish if last else None)
        outs.append(RequestOutput("e", None, [1, 2, 3], None, [completion], last, 0))
    return outs


def _events(body: bytes) -> list[dict[str, Any]]:
    return [
        json.loads(e[len(b"data: ") :]) for e in body.split(b"\n\n") if e.startswith(b"data: {")
    ]


def test_a_tool_call_in_the_full_response() -> None:
    plan = _plan(HERMES, tools=[TOOL])
    responder = ChatResponder(plan, _Frontend.tokenizer, None)
    for out in _outputs(["Let me check.", CALL]):
        responder.on_output(0, out)
    (choice,) = json.loads(responder.finish())["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me check."
    (call,) = message["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # tool_choice none: the same text is content, finish reason as the engine's
    plan = _plan(HERMES, tools=[TOOL], tool_choice="none")
    responder = ChatResponder(plan, _Frontend.tokenizer, None)
    for out in _outputs(["Let me check.", CALL]):
        responder.on_output(0, out)
    (choice,) = json.loads(responder.finish())["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == "Let me check." + CALL
    assert "tool_calls" not in choice["message"]  # vLLM drops an empty list


def test_streamed_tool_call_deltas_in_vllms_shapes() -> None:
    plan = _plan(HERMES, stream=True, tools=[TOOL])
    responder = ChatResponder(plan, _Frontend.tokenizer, None)
    body = b"".join(responder.on_output(0, o) for o in _outputs(DELTAS)) + responder.finish()
    events = _events(body)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"content": "Let me check."}
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    # hermes sets content (None while in a call): vLLM's exclude_unset sends the null
    assert all(d["content"] is None for d in deltas if "tool_calls" in d)
    assert calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather"}
    assert calls[0]["index"] == 0
    args = "".join(c["function"].get("arguments", "") for c in calls)
    assert json.loads(args) == {"city": "Paris"}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


class _ThinkTokenizer:
    """tiny-llama's tokenizer with ``<think>``/``</think>`` as tokens 900/901."""

    ids: ClassVar[dict[str, int]] = {"<think>": 900, "</think>": 901}

    def __getattr__(self, name: str) -> Any:
        return getattr(_Frontend.tokenizer, name)

    def token_to_id(self, token: str) -> int | None:
        return self.ids.get(token)


class _ThinkFrontend(_Frontend):
    tokenizer = _ThinkTokenizer()  # type: ignore[assignment]


def _think_outputs(deltas: list[str]) -> list[RequestOutput]:
    outs = _outputs(deltas)
    for out, text in zip(outs, deltas, strict=True):
        if text in _ThinkTokenizer.ids:
            out.outputs[0].token_ids = [_ThinkTokenizer.ids[text]]
    return outs


def test_reasoning_streamed_and_not() -> None:
    options = ToolOptions(reasoning_parser="deepseek_r1")
    deltas = ["<think>", "Hmm", " ok", "</think>", "Answer", "."]
    req = ChatCompletionRequest(messages=MESSAGES)
    plan = plan_chat(
        req, _ThinkFrontend(), model="m", header_request_id="x", extra={}, tool_options=options
    )  # type: ignore[arg-type]
    responder = ChatResponder(plan, _Frontend.tokenizer, None)
    for out in _think_outputs(deltas):
        responder.on_output(0, out)
    (choice,) = json.loads(responder.finish())["choices"]
    assert choice["message"]["reasoning"] == "Hmm ok"
    assert choice["message"]["content"] == "Answer."
    assert choice["finish_reason"] == "stop"

    req = ChatCompletionRequest(messages=MESSAGES, stream=True)
    plan = plan_chat(
        req, _ThinkFrontend(), model="m", header_request_id="x", extra={}, tool_options=options
    )  # type: ignore[arg-type]
    responder = ChatResponder(plan, _Frontend.tokenizer, None)
    body = b"".join(responder.on_output(0, o) for o in _think_outputs(deltas))
    deltas_out = [e["choices"][0]["delta"] for e in _events(body)]
    assert deltas_out[1:] == [
        {"reasoning": "Hmm"},
        {"reasoning": " ok"},
        {"content": "Answer"},
        {"content": "."},
    ]


def test_a_model_without_the_markers_gets_a_clear_400() -> None:
    message = str(_error(ToolOptions(reasoning_parser="deepseek_r1")))
    assert "could not locate think start/end tokens" in message


def test_a_tool_parser_without_auto_tool_choice_is_inactive_as_in_vllm() -> None:
    """vLLM builds no tool parser without --enable-auto-tool-choice: auto is refused and
    required asks for the parser, even with --tool-call-parser given."""
    options = ToolOptions(tool_call_parser="hermes")
    assert '"auto" tool choice requires' in str(_error(options, tools=[TOOL]))
    assert 'tool_choice="required" requires --tool-call-parser' in str(
        _error(options, tools=[TOOL], tool_choice="required")
    )
    plan = _plan(options, tools=[TOOL], tool_choice="none")
    assert plan.parsers is None
    assert plan.params[0].skip_special_tokens


# vllm serve's startup errors on tiny-llama's tokenizer, as vLLM 0.32's
# ParserManager.get_parser(..., tokenizer=...) words them (run in vLLM's python).
_VLLM_STARTUP = {
    ("mistral", None): "--tool-call-parser mistral cannot be used with the tokenizer of '/m': "
    "Mistral parser could not locate the tool call token in the tokenizer!",
    ("llama3_json", None): "--tool-call-parser llama3_json cannot be used with the tokenizer "
    "of '/m': Llama3JsonToolParser could not locate the bot token '<|python_tag|>' in the "
    "tokenizer.",
    (None, "deepseek_r1"): "--reasoning-parser deepseek_r1 cannot be used with the tokenizer "
    "of '/m': DeepSeekR1ReasoningParser reasoning parser could not locate think start/end "
    "tokens in the tokenizer!",
    ("llama3_json", "deepseek_r1"): "--tool-call-parser llama3_json and --reasoning-parser "
    "deepseek_r1 cannot be used with the tokenizer of '/m': DeepSeekR1ReasoningParser "
    "reasoning parser could not locate think start/end tokens in the tokenizer!",
}


@pytest.mark.parametrize(("tool", "reasoning"), sorted(_VLLM_STARTUP, key=str))
def test_a_parser_the_tokenizer_cannot_serve_stops_startup_as_vllm(
    tool: str | None, reasoning: str | None
) -> None:
    options = ToolOptions(
        enable_auto_tool_choice=tool is not None, tool_call_parser=tool, reasoning_parser=reasoning
    )
    with pytest.raises(ValueError, match="cannot be used with the tokenizer") as info:
        options.check_tokenizer(_Frontend.tokenizer, "/m")
    assert str(info.value) == _VLLM_STARTUP[tool, reasoning]
    with pytest.raises(ValueError, match="cannot be used with the tokenizer"):
        OpenAIServer(_Frontend(), tool_options=options)  # type: ignore[arg-type]


def test_mistral_is_known_but_not_ported() -> None:
    """A tokenizer with Mistral's [TOOL_CALLS] token: vLLM would run its mistral parser;
    trio-vllm has not ported it and refuses to start, saying so. Without
    --enable-auto-tool-choice vLLM builds no tool parser, and neither do we."""

    class _MistralTokenizer(_ThinkTokenizer):
        ids: ClassVar[dict[str, int]] = {"[TOOL_CALLS]": 5}

    options = ToolOptions(enable_auto_tool_choice=True, tool_call_parser="mistral")
    with pytest.raises(ValueError, match=r"mistral is not supported by trio-vllm: vLLM 0\.32"):
        options.check_tokenizer(_MistralTokenizer(), "/m")
    ToolOptions(tool_call_parser="mistral").check_tokenizer(_Frontend.tokenizer, "/m")
    HERMES.check_tokenizer(_Frontend.tokenizer, "/m")  # hermes needs no marker token
