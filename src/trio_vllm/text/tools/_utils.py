"""Helpers shared by the tool parsers: vLLM 0.32's ``vllm.tool_parsers.utils``, the parts
the ported parsers use, with the same results.

``partial_json_loads`` needs the optional ``partial-json-parser`` package (the
``tools`` extra, as vLLM itself depends on it); it is imported on first use.
"""

from __future__ import annotations

import ast
import json
from json import JSONDecodeError, JSONDecoder
from typing import Any

from ._types import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall

__all__ = [
    "UnexpectedAstError",
    "compute_tool_delta",
    "find_common_prefix",
    "handle_single_tool",
    "is_complete_json",
    "make_valid_python",
    "partial_json_loads",
    "partial_tag_overlap",
]


class UnexpectedAstError(Exception):
    """The AST is not a list of calls with literal keyword arguments (pythonic)."""


def partial_tag_overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ends ``text`` (0 if none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def find_common_prefix(s1: str, s2: str) -> str:
    """The longest common prefix of two strings."""
    n = 0
    for a, b in zip(s1, s2, strict=False):
        if a != b:
            break
        n += 1
    return s1[:n]


def is_complete_json(input_str: str) -> bool:
    """Whether the whole string is one JSON document."""
    try:
        json.loads(input_str)
    except JSONDecodeError:
        return False
    return True


def _partial_json_parser() -> Any:
    try:
        import partial_json_parser  # type: ignore[import-untyped]
    except ImportError as exc:  # pragma: no cover - the dev install has it
        raise ImportError(
            "streaming llama3_json tool calls need partial-json-parser: "
            "pip install 'trio-vllm[tools]'"
        ) from exc
    return partial_json_parser


def allow_flags(*, strings: bool) -> int:
    """partial_json_parser's ``Allow.ALL``, without ``Allow.STR`` unless ``strings``."""
    allow = _partial_json_parser().core.options.Allow
    return int(allow.ALL if strings else allow.ALL & ~allow.STR)


def malformed_json_error() -> type[Exception]:
    """partial_json_parser's ``MalformedJSON`` (raised when nothing can be completed)."""
    return _partial_json_parser().core.exceptions.MalformedJSON  # type: ignore[no-any-return]


def partial_json_loads(input_str: str, flags: int) -> tuple[Any, int]:
    """Parse a possibly incomplete JSON prefix (partial_json_parser), or the first
    complete document of a longer text (``raw_decode``): the value and the characters
    it used."""
    try:
        return (_partial_json_parser().loads(input_str, flags), len(input_str))
    except JSONDecodeError as e:
        if "Extra data" in e.msg:
            return JSONDecoder().raw_decode(input_str)
        raise


_JSON_NAME_LITERALS: dict[str, object] = {"null": None, "true": True, "false": False}


def _parameter_value(val: ast.expr) -> object:
    """A literal argument's value (vLLM's ``get_parameter_value``)."""
    if isinstance(val, ast.Constant):
        if val.value is None or isinstance(val.value, (str, int, float)):
            return val.value
        raise UnexpectedAstError("Tool call arguments must be JSON values")
    if isinstance(val, ast.Dict):
        if not all(isinstance(k, ast.Constant) for k in val.keys):
            raise UnexpectedAstError("Dict tool call arguments must have literal keys")
        return {
            k.value: _parameter_value(v)  # type: ignore[union-attr]
            for k, v in zip(val.keys, val.values, strict=False)
        }
    if isinstance(val, (ast.List, ast.Tuple, ast.Set)):
        return [_parameter_value(v) for v in val.elts]
    if isinstance(val, ast.JoinedStr) and all(isinstance(p, ast.Constant) for p in val.values):
        return "".join(str(p.value) for p in val.values)  # type: ignore[attr-defined]
    if isinstance(val, ast.Name) and val.id in _JSON_NAME_LITERALS:
        return _JSON_NAME_LITERALS[val.id]
    if isinstance(val, ast.UnaryOp) and isinstance(val.op, (ast.USub, ast.UAdd)):
        operand = _parameter_value(val.operand)
        if isinstance(operand, (int, float)) and not isinstance(operand, bool):
            return -operand if isinstance(val.op, ast.USub) else operand
        raise UnexpectedAstError("Tool call arguments must be literals")
    raise UnexpectedAstError("Tool call arguments must be literals")


def _dotted_name(node: ast.expr) -> str:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        raise UnexpectedAstError("Invalid tool call name")
    parts.append(node.id)
    return ".".join(reversed(parts))


def handle_single_tool(call: ast.Call) -> ToolCall:
    """A pythonic call node as a `ToolCall` (keyword arguments as a JSON object)."""
    if not isinstance(call.func, (ast.Name, ast.Attribute)):
        raise UnexpectedAstError("Invalid tool call name")
    name = _dotted_name(call.func)
    arguments = {keyword.arg: _parameter_value(keyword.value) for keyword in call.keywords}
    return ToolCall(
        function=FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))
    )


def _is_escaped(text: str, index: int) -> bool:
    backslashes = 0
    j = index - 1
    while j >= 0 and text[j] == "\\":
        backslashes += 1
        j -= 1
    return backslashes % 2 == 1


_CLOSING = {"[": "]", "(": ")", "{": "}", "'": "'", '"': '"'}


def make_valid_python(text: str) -> tuple[str, str] | None:
    """Close the open brackets and quotes of partial pythonic text: ``(completed,
    added)``, or ``None`` when it is too incomplete (mid-name, mid-key). Raises
    `UnexpectedAstError` on mismatched brackets (vLLM's ``make_valid_python``)."""
    stack: list[str] = []
    for index, char in enumerate(text):
        if stack and stack[-1] in {"'", '"'}:
            if char == stack[-1] and not _is_escaped(text, index):
                stack.pop()
            continue
        if char in {"[", "(", "{"}:
            stack.append(char)
        elif char == "]":
            if not stack or stack.pop() != "[":
                raise UnexpectedAstError("Mismatched square brackets")
        elif char == ")":
            if not stack or stack.pop() != "(":
                raise UnexpectedAstError("Mismatched parentheses")
        elif char == "}":
            if not stack or stack.pop() != "{":
                raise UnexpectedAstError("Mismatched curly braces")
        elif char in {"'", '"'}:
            stack.append(char)

    text = text.rstrip()
    if text.endswith("=") or text.endswith(":"):
        return None
    if stack and stack[-1] == "{":
        trailing = text[: text.rfind("{")]
        if trailing.count(":") <= trailing.count(","):
            return None
    if stack and stack[-1] == "(":
        trailing = text[: text.rfind("(")]
        if trailing.count("=") <= trailing.count(","):
            return None
    if text.endswith(","):
        text = text[:-1]
    if stack and stack[-1] == "[" and not text.endswith("[") and not text.endswith(")"):
        return None

    added = "".join(_CLOSING[char] for char in reversed(stack))
    candidate = text + added
    # Partial text can close into something the counting above misses (a mid-key
    # dict, a bare string read as a set): only a parse tells.
    try:
        module = ast.parse(candidate)
    except SyntaxError:
        return None
    if not module.body:
        return None
    if "}" in added and any(isinstance(node, ast.Set) for node in ast.walk(module)):
        return None
    return candidate, added


def compute_tool_delta(
    previously_sent_args: str, new_call: ToolCall, index: int, withheld_suffix: str
) -> DeltaToolCall | None:
    """The new part of a pythonic call's arguments since ``previously_sent_args``
    (the whole first piece, with id and name, when nothing was sent yet)."""
    new_args = new_call.function.arguments
    if withheld_suffix:
        if not new_args.endswith(withheld_suffix):
            raise ValueError(
                f"Tool call arguments '{new_args}' do not end with "
                f"expected withheld suffix '{withheld_suffix}'"
            )
        new_args = new_args[: -len(withheld_suffix)]
    if not previously_sent_args:
        return DeltaToolCall(
            id=new_call.id,
            type="function",
            index=index,
            function=DeltaFunctionCall(name=new_call.function.name, arguments=new_args),
        )
    diff = new_args[len(previously_sent_args) :]
    # vLLM passes id=None here: the chunk carries "id": null
    return (
        DeltaToolCall(id=None, index=index, function=DeltaFunctionCall(arguments=diff))
        if diff
        else None
    )
