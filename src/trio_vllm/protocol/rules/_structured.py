"""`STRUCTURED`: vLLM's frontend checks of a ``StructuredOutputsParams``.

vLLM 0.32.0 checks these in ``StructuredOutputsParams.__post_init__`` (exactly one
constraint) and ``SamplingParams._validate_structured_outputs`` (the rest), in this
order, before it picks a backend and compiles the grammar
(`trio_vllm.protocol.structured.resolve_structured_outputs` does that part).
"""

from __future__ import annotations

import json as json_mod
from typing import Any, Final

import msgspec

from ..structs import (
    StructuredOutputsParams,
)
from ._core import (
    Fail,
    Family,
    Limits,
    not_a,
)

#: vLLM's ``MAX_STRUCTURED_OUTPUT_JSON_NESTING`` and ``STRUCTURAL_TAG_WRAPPER_NESTING``.
MAX_JSON_NESTING: Final = 64
STRUCTURAL_TAG_WRAPPER_NESTING: Final = 16

_CONSTRAINTS: Final = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

# ------------------------------------------------------------------ structured outputs


STRUCTURED: Final[Family[StructuredOutputsParams]] = Family(
    "structured", lambda **kw: StructuredOutputsParams(**kw)
)
"""What vLLM's frontend refuses in a ``StructuredOutputsParams`` before compiling it
(one constraint, none empty, not nested too deep, the configured backend)."""


def _as_dict(so: StructuredOutputsParams) -> dict[str, Any]:
    # vLLM's message shows the dataclass's __dict__: every field, declaration order.
    return msgspec.structs.asdict(so)


@STRUCTURED.rule(
    "structured_outputs",
    example={"regex": "a", "choice": ["a"]},
)
def _one_constraint(so: StructuredOutputsParams, limits: Limits) -> Fail | None:
    given: object = so  # a caller's struct may hold anything
    if not isinstance(given, StructuredOutputsParams):
        return not_a("structured_outputs", "a StructuredOutputsParams", given)
    # vLLM counts `is not None`: json_object=False is a constraint here (refused below).
    count = sum(getattr(so, name) is not None for name in _CONSTRAINTS)
    if count > 1:
        return (
            "You can only use one kind of structured outputs constraint "
            f"but multiple are specified: {_as_dict(so)}",
            None,
        )
    if count < 1:
        return (
            "You must use one kind of structured outputs constraint "
            f"but none are specified: {_as_dict(so)}",
            None,
        )
    return None


@STRUCTURED.rule(
    "structured_outputs._backend",
    engine=False,
    example={"regex": "a+", "_backend": "guidance"},
    limits={"structured_output_backend": "auto"},
)
def _backend_selection(so: StructuredOutputsParams, limits: Limits) -> Fail | None:
    backend, given = limits.structured_output_backend, so._backend
    if backend is None or not given:
        return None  # the configured backend is unknown, or the frontend picks it
    if backend != given and not (backend == "auto" and so._backend_was_auto):
        return (
            "Request-level structured output backend selection is not "
            f"supported. The request specified '{given}', but vLLM "
            f"was initialised with '{backend}'. This error can be "
            "resolved by removing '_backend' from the request.",
            None,
        )
    return None


@STRUCTURED.rule(
    "structured_outputs.choice",
    engine=False,
    example={"choice": []},
    http={"structured_outputs": {"choice": []}},
)
def _choice(so: StructuredOutputsParams, limits: Limits) -> Fail | None:
    if isinstance(so.choice, list) and not so.choice:
        return f"Choice '{so.choice}' cannot be an empty list", None
    return None


@STRUCTURED.rule(
    "structured_outputs.grammar",
    engine=False,
    example={"grammar": "  "},
    http={"structured_outputs": {"grammar": " "}},
)
def _grammar(so: StructuredOutputsParams, limits: Limits) -> Fail | None:
    if isinstance(so.grammar, str) and so.grammar.strip() == "":
        return "structured_outputs.grammar cannot be an empty string", None
    return None


@STRUCTURED.rule(
    "structured_outputs.json",
    engine=False,
    example={"json": ""},
    http={"structured_outputs": {"json": ""}},
)
def _json(so: StructuredOutputsParams, limits: Limits) -> Fail | None:
    if isinstance(so.json, str) and so.json.strip() == "":
        return "structured_outputs.json cannot be an empty string", None
    return None


def _exceeds_nesting(spec: object, limit: int) -> bool:
    """vLLM's ``_exceeds_json_nesting``: objects and arrays nested deeper than ``limit``."""
    if isinstance(spec, str):
        try:
            spec = json_mod.loads(spec)
        except RecursionError:
            return True
        except ValueError:
            return False  # malformed JSON: the backend's check reports it
    level: list[Any] = [spec]
    for _ in range(limit):
        level = [
            child
            for node in level
            if isinstance(node, (dict, list))
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return False
    return True


_TOO_DEEP: Final = (
    "The JSON schema is nested too deeply: objects and arrays may nest at "
    f"most {MAX_JSON_NESTING} levels"
)


def _deep(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@STRUCTURED.rule("structured_outputs.json_nesting", engine=False, example={"json": _deep(40)})
def _json_nesting(so: StructuredOutputsParams, limits: Limits) -> Fail | None:
    if so.json and _exceeds_nesting(so.json, MAX_JSON_NESTING):
        return _TOO_DEEP, None
    return None


@STRUCTURED.rule(
    "structured_outputs.structural_tag_nesting",
    engine=False,
    example={"structural_tag": json_mod.dumps(_deep(45))},
)
def _tag_nesting(so: StructuredOutputsParams, limits: Limits) -> Fail | None:
    limit = MAX_JSON_NESTING + STRUCTURAL_TAG_WRAPPER_NESTING
    if so.structural_tag and _exceeds_nesting(so.structural_tag, limit):
        return _TOO_DEEP, None
    return None


@STRUCTURED.rule(
    "structured_outputs.json_object",
    engine=False,
    example={"json_object": False},
    http={"structured_outputs": {"json_object": False}},
)
def _json_object(so: StructuredOutputsParams, limits: Limits) -> Fail | None:
    if so.json_object is False:
        return (
            "structured_outputs.json_object must be True if set; omit "
            "structured_outputs to disable structured outputs",
            None,
        )
    return None


@STRUCTURED.rule(
    "structured_outputs.regex",
    engine=False,
    example={"regex": "a\x00"},
    http={"structured_outputs": {"regex": "a\x00"}},
)
def _regex(so: StructuredOutputsParams, limits: Limits) -> Fail | None:
    if so.regex and "\x00" in so.regex:
        return "structured_outputs.regex must not contain a NUL character ('\\x00')", None
    return None


@STRUCTURED.rule(
    "structured_outputs.structural_tag",
    engine=False,
    example={"structural_tag": " "},
)
def _structural_tag(so: StructuredOutputsParams, limits: Limits) -> Fail | None:
    if isinstance(so.structural_tag, str) and so.structural_tag.strip() == "":
        return "structured_outputs.structural_tag cannot be an empty string", None
    return None
