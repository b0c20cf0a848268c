"""Chat requests whose tools and tool_choice constrain the output, shared by our tests
and vLLM's interpreter (standard library only).

``tool_constraints_vllm.py`` runs each case through vLLM 0.32's own request model and
parser (``ParserManager.get_parser(...)(...).adjust_request``, then
``to_sampling_params``) and records what the engine is sent
(data/tool_constraints.json); tests/server/test_tool_choice.py checks ours against it.
"""

from __future__ import annotations

from typing import Any

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
NOARGS: dict[str, Any] = {"type": "function", "function": {"name": "ping"}}
STRICT: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
DEFS: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "place",
        "parameters": {
            "type": "object",
            "properties": {"at": {"$ref": "#/$defs/point"}},
            "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}},
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
NAMED_STRICT = {"type": "function", "function": {"name": "add"}}
JSON_OBJECT = {"type": "json_object"}

# (case name, request fields beyond model/messages)
CASES: list[tuple[str, dict[str, Any]]] = [
    ("required", {"tools": [WEATHER, NOARGS], "tool_choice": "required"}),
    ("named", {"tools": [WEATHER, NOARGS], "tool_choice": NAMED}),
    ("named-strict", {"tools": [WEATHER, STRICT], "tool_choice": NAMED_STRICT}),
    ("required-strict", {"tools": [STRICT, WEATHER], "tool_choice": "required"}),
    ("required-single", {"tools": [WEATHER, NOARGS], "tool_choice": "required",
                         "parallel_tool_calls": False}),
    ("required-defs", {"tools": [DEFS, WEATHER], "tool_choice": "required"}),
    ("named-over-response-format", {"tools": [WEATHER], "tool_choice": NAMED,
                                    "response_format": JSON_OBJECT}),
    ("auto", {"tools": [WEATHER, NOARGS]}),
    ("auto-explicit", {"tools": [WEATHER], "tool_choice": "auto"}),
    ("auto-strict", {"tools": [WEATHER, STRICT], "tool_choice": "auto"}),
    ("auto-single", {"tools": [WEATHER, NOARGS], "parallel_tool_calls": False}),
    ("auto-with-response-format", {"tools": [WEATHER], "response_format": JSON_OBJECT}),
    ("none", {"tools": [WEATHER], "tool_choice": "none"}),
    ("no-tools", {}),
]  # fmt: skip

PARSERS = ("hermes", "llama3_json", "pythonic")
