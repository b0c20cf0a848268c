"""The structured output a chat request's tools impose, as vLLM 0.32 derives it.

vLLM's chat renderer runs the parser's ``adjust_request`` (``vllm/parser/
abstract_parser.py`` ``DelegatingParser._apply_structural_tag``, then ``ToolParser.
adjust_request``) before it builds the sampling parameters:

- A tool parser with a *structural-tag model* (``hermes``: vLLM's own builder;
  ``llama3_json``: xgrammar's builtin ``llama``) gets a structural tag for
  ``tool_choice`` ``required`` and named, and for ``auto`` when a tool is ``strict``
  or ``parallel_tool_calls`` is ``false``: the call envelope of every tool, the
  arguments pinned to a tool's schema only when the tool is strict. It replaces the
  request's structured outputs (``response_format`` included).
- Any other parser (``pythonic``) gets a JSON schema for ``required`` (an array of
  ``{"name", "parameters"}`` objects, ``maxItems: 1`` without parallel calls, every
  tool's ``$defs`` lifted to the top) and for a named tool (its parameters).
- ``none``, and ``auto`` without a strict tool or a single-call limit, leave the
  request's structured outputs as they are.

The tag is sent as vLLM sends it, ``json.dumps`` of xgrammar's ``StructuralTag``
model (every field, in the model's order), so the engine compiles the very grammar
``vllm serve`` would give it. Sans-I/O; `InvalidRequestError` (HTTP 400) where vLLM
refuses the request, and for the one combination not ported (``auto`` with a
structural tag *and* the request's own structured outputs, which vLLM ORs together
through xgrammar's format models).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from ..._exceptions import InvalidRequestError
from ...protocol import StructuredOutputsParams

__all__ = ["STRUCTURAL_TAG_MODELS", "tool_choice_constraint"]

#: ``--tool-call-parser`` name -> the structural-tag model of vLLM's parser class.
STRUCTURAL_TAG_MODELS: Final[dict[str, str]] = {"hermes": "hermes", "llama3_json": "llama"}
_THINK: Final = ["<think>", "</think>"]


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    function = tool.get("function")
    return function if isinstance(function, Mapping) else {}


def _is_strict(tool: Mapping[str, Any]) -> bool:
    return _function(tool).get("strict") is True


def _named(choice: object) -> str | None:
    if isinstance(choice, Mapping):
        name = _function(choice).get("name")
        return name if isinstance(name, str) else None
    return None


def _arguments_schema(function: Mapping[str, Any], strict: bool) -> object:
    # xgrammar's / vLLM's get_function_parameters after resolve_tool_strictness pinned
    # ``strict``: a non-strict tool's arguments are any JSON value.
    if not strict:
        return True
    parameters = function.get("parameters")
    return True if parameters is None else parameters


def _json_schema_format(schema: object) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": schema,
        "style": "json",
        "any_order": False,
        "max_whitespace_cnt": None,
        "excludes": [],
    }


def _tag(begin: str, schema: object, end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": _json_schema_format(schema), "end": end}


def _hermes_format(tools: list[tuple[str, object]], mode: str) -> dict[str, Any]:
    """vLLM's ``get_hermes_structural_tag`` (``_hermes_style_structural_tag``)."""
    tags = [
        _tag(begin + name + '", "arguments": ', schema, end)
        for name, schema in tools
        for begin, end in (
            ('<tool_call>\n{"name": "', "}\n</tool_call>"),
            ('<tool_call>{"name": "', "}</tool_call>"),
        )
    ]
    if mode == "auto":
        return {
            "type": "triggered_tags",
            "triggers": ["<tool_call>"],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": False,
            "excludes": [],
        }
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "",
        "at_least_one": True,
        "stop_after_first": mode == "forced",
    }


def _llama_format(tools: list[tuple[str, object]], mode: str) -> dict[str, Any]:
    """xgrammar's builtin ``get_llama_structural_tag`` (parallel calls allowed)."""
    tags = [_tag('{"name": "' + name + '", "parameters": ', schema, "}") for name, schema in tools]
    if mode == "forced":
        return tags[0]
    return {
        "type": "triggered_tags",
        "triggers": ['{"name": '],
        "tags": tags,
        "at_least_one": mode == "required",
        "stop_after_first": False,
        "excludes": list(_THINK),
    }


def _limit_to_single_call(node: object) -> None:
    """vLLM's ``limit_to_single_tool_call``: every call list stops after one call."""
    if isinstance(node, dict):
        if node.get("type") in ("triggered_tags", "token_triggered_tags", "tags_with_separator"):
            node["stop_after_first"] = True
        for value in node.values():
            _limit_to_single_call(value)
    elif isinstance(node, list):
        for item in node:
            _limit_to_single_call(item)


def _structural_tag(
    model: str,
    tools: Sequence[Mapping[str, Any]],
    choice: object,
    parallel_tool_calls: bool | None,
) -> str | None:
    """The tag vLLM's ``_apply_structural_tag`` sends, or ``None`` for none."""
    mode = "auto" if choice in (None, "auto") else "required" if choice == "required" else "forced"
    single = parallel_tool_calls is False
    # resolve_tool_strictness: auto at the default level with no strict tool gets no
    # tag; a single-call limit raises the level to FUNCTION (the envelope only).
    if mode == "auto" and not single and not any(_is_strict(t) for t in tools):
        return None
    chosen = list(tools)
    if mode == "forced":
        name = _named(choice)
        chosen = [t for t in tools if _function(t).get("name") == name]
        if not chosen:  # the request checks caught this first; xgrammar's words
            raise InvalidRequestError(
                f"The tool with name '{name}' is not found in the tools list.",
                field="tool_choice",
            )
    pinned = [
        (str(_function(t).get("name")), _arguments_schema(_function(t), _is_strict(t)))
        for t in chosen
    ]
    fmt = _hermes_format(pinned, mode) if model == "hermes" else _llama_format(pinned, mode)
    if single:
        _limit_to_single_call(fmt)
    return json.dumps({"type": "structural_tag", "format": fmt})


def _params_or_empty_object(params: object) -> object:
    return params if params else {"type": "object", "properties": {}}


def _required_schema(
    tools: Sequence[Mapping[str, Any]], parallel_tool_calls: bool | None
) -> dict[str, Any]:
    """vLLM's ``_get_json_schema_from_tools`` (``tool_choice="required"``)."""
    functions = [copy.deepcopy(dict(_function(t))) for t in tools]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [f.get("name")]},
                        "parameters": _params_or_empty_object(f.get("parameters")),
                    },
                    "required": ["name", "parameters"],
                }
                for f in functions
            ],
        },
    }
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    defs: dict[str, Any] = {}
    for f in functions:  # vLLM pops each tool's $defs (the schemas above share them)
        params = f.get("parameters")
        if not isinstance(params, dict):
            continue
        found = params.pop("$defs", {})
        if not isinstance(found, dict):
            raise InvalidRequestError(
                f"`$defs` in the parameters of tool '{f.get('name')}' must be an object, "
                f"got {type(found).__name__}. (parameter=tools)",
                param="tools",
            )
        for def_name, def_schema in found.items():
            if def_name in defs and defs[def_name] != def_schema:
                raise InvalidRequestError(
                    f"Tool definition '{def_name}' has multiple schemas, which is not "
                    "supported. (parameter=tools)",
                    param="tools",
                )
            defs[def_name] = def_schema
    if defs:
        schema["$defs"] = defs
    return schema


def tool_choice_constraint(
    tool_parser: str,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: object,
    *,
    parallel_tool_calls: bool | None = True,
    structured_outputs: StructuredOutputsParams | None = None,
) -> StructuredOutputsParams | None:
    """The structured outputs vLLM sends for a chat request run through
    ``tool_parser`` (its ``--tool-call-parser`` name, auto tool choice on).

    ``tool_choice`` is the request's, with vLLM's default (``"auto"`` when tools come
    without one); ``structured_outputs`` is what the request's own
    ``response_format`` / ``structured_outputs`` give. Returns those unchanged when
    the tools impose nothing. Raises `InvalidRequestError` (see the module).
    """
    if not tools or tool_choice == "none":
        return structured_outputs
    model = STRUCTURAL_TAG_MODELS.get(tool_parser)
    if model is not None:
        tag = _structural_tag(model, tools, tool_choice, parallel_tool_calls)
        if tag is None:
            return structured_outputs
        if tool_choice in (None, "auto") and structured_outputs is not None:
            raise InvalidRequestError(
                "tool_choice 'auto' with a strict tool or parallel_tool_calls=false, "
                "together with response_format or structured_outputs, is not supported "
                "by trio-vllm (vLLM combines both constraints with xgrammar's format "
                "models).",
                field="tool_choice",
            )
        return StructuredOutputsParams(structural_tag=tag)
    if tool_choice == "required":
        return StructuredOutputsParams(json=_required_schema(tools, parallel_tool_calls))
    name = _named(tool_choice)
    if name is not None:
        for tool in tools:
            if _function(tool).get("name") == name:
                params = _params_or_empty_object(_function(tool).get("parameters"))
                return StructuredOutputsParams(json=params)  # type: ignore[arg-type]
        raise InvalidRequestError(  # the request checks caught this first
            f"Tool '{name}' has not been passed in `tools`.", field="tool_choice"
        )
    return structured_outputs
