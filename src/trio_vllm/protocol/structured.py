"""vLLM's frontend duties for structured outputs: pick the backend, check the grammar.

`resolve_structured_outputs` does what vLLM 0.32.0's
``SamplingParams._validate_structured_outputs`` does after its plain checks (those are
the `STRUCTURED` rules): it sets ``_backend`` (and ``_backend_was_auto``) as the
configured backend says, turns a ``choice`` into its EBNF ``grammar`` where vLLM's
xgrammar path does, and refuses a schema, regex or grammar the backend cannot compile
with vLLM's message.

Compiling needs a grammar library. vLLM's default backend ``auto`` tries xgrammar and,
when xgrammar rejects the constraint, falls back to guidance (llguidance), whose error
is the one ``vllm serve`` reports for a bad regex, schema or grammar. xgrammar's wheels
need torch, so trio-vllm uses llguidance (no dependencies; the ``[structured]`` extra)
and imports it lazily: a constraint llguidance compiles is sent with
``_backend="xgrammar"`` (what ``auto`` picks for such a constraint), one it rejects gets
guidance's message; a JSON schema with a feature vLLM knows xgrammar lacks goes to
guidance (or outlines), as vLLM's ``auto`` sends it. Without llguidance the plain
checks still run and the grammar is left to the engine, which fails just that request
(finish reason ERROR, no tokens).
Sans-I/O: no sockets, no event loop.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Final

import msgspec

from .._exceptions import InvalidRequestError

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType

    from .structs import StructuredOutputsParams

__all__ = [
    "BACKENDS",
    "choice_as_grammar",
    "grammar_checker_available",
    "resolve_structured_outputs",
]

#: The values of vLLM's ``--structured-outputs-config.backend``.
BACKENDS: Final = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")

_MISSING: Final = (
    "checking a structured-output grammar needs llguidance: pip install "
    "'trio-vllm[structured]'; without it a bad JSON schema, regex or grammar reaches the "
    "engine, which fails just that request (finish reason 'error', no tokens)"
)
_log = logging.getLogger("trio_vllm")
_warned: list[bool] = []


def choice_as_grammar(choice: list[str]) -> str:
    """vLLM's ``choice_as_grammar``: the EBNF grammar xgrammar is given for a choice."""
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def escape_char(ch: str) -> str:
        if ch in escapes:
            return escapes[ch]
        if ord(ch) < 0x20 or ord(ch) == 0x7F:
            return f"\\u{ord(ch):04x}"
        return ch

    escaped = ("".join(escape_char(ch) for ch in c) for c in choice)
    return "root ::= " + " | ".join(f'"{c}"' for c in escaped)


# vLLM's xgrammar STRING_SUPPORTED_FORMATS.
_XGRAMMAR_FORMATS: Final = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)


def _pattern_and_length(obj: dict[str, Any]) -> bool:
    return ("pattern" in obj or "format" in obj) and ("minLength" in obj or "maxLength" in obj)


def _types(obj: dict[str, Any]) -> set[str]:
    kind = obj.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    return set()


def _any_node(obj: object, bad: Callable[[dict[str, Any]], bool]) -> bool:
    """Whether ``bad`` holds for ``obj`` or any map nested in it (vLLM's walk)."""
    if not isinstance(obj, dict):
        return False
    if bad(obj):
        return True
    for value in obj.values():
        if isinstance(value, dict):
            if _any_node(value, bad):
                return True
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, dict) and _any_node(item, bad):
                    return True
    return False


def _xgrammar_lacks(obj: dict[str, Any]) -> bool:
    """One node of vLLM's ``has_xgrammar_unsupported_json_features``."""
    types = _types(obj)
    if types & {"integer", "number"} and "multipleOf" in obj:
        return True
    if "array" in types and any(
        k in obj for k in ("uniqueItems", "contains", "minContains", "maxContains")
    ):
        return True
    if "string" in types and "format" in obj and obj["format"] not in _XGRAMMAR_FORMATS:
        return True
    if "string" in types and _pattern_and_length(obj):
        return True
    if "object" in types and "propertyNames" in obj:
        names = obj.get("propertyNames")
        if isinstance(names, dict) and _pattern_and_length(names):
            return True
        if "patternProperties" in obj or "properties" in obj:
            return True
        if obj.get("unevaluatedProperties", True) is not True:
            return True
    pattern_properties = obj.get("patternProperties")
    if (
        "object" in types
        and isinstance(pattern_properties, dict)
        and ("properties" in obj or len(pattern_properties) > 1)
    ):
        return True
    allof = obj.get("allOf")
    return isinstance(allof, list) and len(allof) >= 2


def _schema(so: StructuredOutputsParams) -> object:
    return json.loads(so.json) if isinstance(so.json, str) else so.json


def _llguidance() -> ModuleType | None:
    try:
        import llguidance
    except ImportError:
        return None
    return llguidance


def grammar_checker_available() -> bool:
    """Whether the optional grammar checker (llguidance) can be imported."""
    return _llguidance() is not None


def _refuse(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, field="structured_outputs")


def _guidance_error(so: StructuredOutputsParams, llg: ModuleType) -> str | None:
    """vLLM's ``validate_guidance_grammar`` (no tokenizer): the message, or ``None``."""
    try:
        if so.json is not None:
            spec = so.json if isinstance(so.json, str) else json.dumps(so.json)
            grammar = llg.LLMatcher.grammar_from_json_schema(
                spec, defaults={"whitespace_flexible": True}
            )
        elif so.json_object:
            grammar = llg.LLMatcher.grammar_from_json_schema(
                '{"type": "object"}', defaults={"whitespace_flexible": True}
            )
        elif so.regex is not None:
            grammar = llg.grammar_from("regex", so.regex)
        elif so.choice is not None:
            grammar = llg.grammar_from("choice", json.dumps(so.choice))
        elif so.grammar is not None:
            grammar = llg.grammar_from("grammar", so.grammar)
        else:
            return None  # a structural tag: left to the engine
    except (ValueError, KeyError, TypeError) as exc:
        return f"Invalid grammar specification: {exc}"
    err: str = llg.LLMatcher.validate_grammar(grammar, None)
    return f"Grammar error: {err}" if err else None


def _json_schema_error(so: StructuredOutputsParams) -> str | None:
    if isinstance(so.json, str):
        try:
            json.loads(so.json)
        except json.JSONDecodeError:
            return "Invalid JSON grammar specification."
    return None


def resolve_structured_outputs(
    so: StructuredOutputsParams, backend: str = "auto", *, check_grammar: bool = True
) -> StructuredOutputsParams:
    """A copy of ``so`` as vLLM's frontend sends it for engines configured with
    ``backend``; `InvalidRequestError` with vLLM's message when the grammar is refused.

    ``so`` must pass the `STRUCTURED` rules first. ``check_grammar=False`` (or no
    llguidance installed) skips compiling. Never changes ``so``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown structured-output backend {backend!r}, one of {BACKENDS}")
    out = msgspec.structs.replace(so)
    llg = _llguidance() if check_grammar else None
    if check_grammar and llg is None and not _warned:
        _warned.append(True)
        _log.warning(_MISSING)
    # A caller's _backend (accepted by the STRUCTURED rules) is sent as is, after the
    # same compile checks as for an unset one.
    chosen = out._backend or backend
    if chosen == "auto" and out.json is not None:
        error = _json_schema_error(out)
        if error is not None:
            raise _refuse(error)
        schema = _schema(out)
        if _any_node(schema, _xgrammar_lacks):
            # vLLM: xgrammar refuses the schema, so auto falls back to guidance, or to
            # outlines for what guidance lacks too (patternProperties).
            out._backend_was_auto = True
            if _any_node(schema, lambda node: "patternProperties" in node):
                out._backend = "outlines"  # outlines' own checks are not reproduced
                return out
            error = None if llg is None else _guidance_error(out, llg)
            if error is not None:
                raise _refuse(error)
            out._backend = "guidance"
            return out
    if chosen in ("xgrammar", "auto"):
        error = _json_schema_error(out)
        if error is None and llg is not None:
            error = _guidance_error(out, llg)
        if error is not None:
            raise _refuse(error)
        if out.choice:
            # xgrammar is given the choice as an EBNF grammar, and vLLM sends that.
            out.grammar, out.choice = choice_as_grammar(out.choice), None
        if not out._backend:
            out._backend = "xgrammar"
            out._backend_was_auto = backend == "auto"
    elif chosen == "guidance":
        error = None if llg is None else _guidance_error(out, llg)
        if error is not None:
            raise _refuse(error)
        out._backend = "guidance"
    else:
        out._backend = chosen
    return out
