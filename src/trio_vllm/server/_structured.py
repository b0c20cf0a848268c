"""``response_format`` and ``structured_outputs`` of an OpenAI request, as vLLM reads them.

vLLM 0.32.0's request models (``entrypoints/openai/{completion,chat_completion}/
protocol.py`` and ``generate/base/protocol.py``): a ``json_schema`` response format
must carry ``json_schema``; at most one of ``structured_outputs``' ``json``, ``regex``,
``choice``; a chat request with such a constraint cannot also name a tool; then
``extract_structured_outputs`` lays ``response_format`` over ``structured_outputs``
(``json_object`` -> ``json_object=True``, ``json_schema`` -> ``json=<its schema>``).
The rest (one constraint in all, nothing empty, the backend, the grammar) is the text
layer's, with vLLM's messages (`trio_vllm.protocol.rules.STRUCTURED`).

The removed ``guided_*`` fields are ignored with vLLM's warning (vLLM 0.32.0 ignores
them too: the output is not constrained). Structural tags (``response_format`` of type
``structural_tag``, ``structured_outputs.structural_tag``) need xgrammar to validate as
vLLM does; the server refuses them with HTTP 400 rather than accept one vLLM refuses.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Final

from ..protocol import StructuredOutputsParams
from ._http import HTTPError, validation_error

__all__ = ["REMOVED_GUIDED_FIELDS", "structured_outputs_for", "warn_removed_guided_fields"]

logger = logging.getLogger("trio_vllm.server")

#: vLLM's ``_REMOVED_GUIDED_FIELDS``: accepted, ignored, warned about.
REMOVED_GUIDED_FIELDS: Final = frozenset(
    {
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
    }
)

# The fields a request's structured_outputs may set (pydantic builds the dataclass from
# them; the private _backend fields are init=False there, so a client cannot set them).
_FIELDS: Final = (
    "json",
    "regex",
    "choice",
    "grammar",
    "json_object",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
    "structural_tag",
)
_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "json": (str, dict),
    "regex": (str,),
    "choice": (list,),
    "grammar": (str,),
    "json_object": (bool,),
    "disable_any_whitespace": (bool,),
    "disable_additional_properties": (bool,),
    "whitespace_pattern": (str,),
    "structural_tag": (str,),
}
_WARNED: set[str] = set()


def warn_removed_guided_fields(unknown: set[str] | frozenset[str]) -> None:
    """vLLM's warning (once per set of fields) for a request with ``guided_*`` fields."""
    removed = unknown & REMOVED_GUIDED_FIELDS
    key = str(sorted(removed))
    if removed and key not in _WARNED:
        _WARNED.add(key)
        logger.warning(
            "Request contains the removed guided-decoding field(s) %s, which are "
            "ignored; output will NOT be constrained. Use `structured_outputs` (or "
            "`response_format`) instead; see docs/features/structured_outputs.md.",
            key,
        )


def _structured_outputs(given: object) -> dict[str, object]:
    if not isinstance(given, Mapping):
        raise HTTPError(
            "1 validation error:\n  structured_outputs: Input should be a dictionary",
            err_type="Bad Request",
            param="structured_outputs",
        )
    fields: dict[str, object] = {}
    for name in _FIELDS:
        value = given.get(name)
        if value is None:
            continue
        if not isinstance(value, _TYPES[name]) or (
            name == "choice" and not all(isinstance(c, str) for c in value)  # type: ignore[attr-defined]
        ):
            raise HTTPError(
                f"1 validation error:\n  structured_outputs.{name}: invalid type "
                f"{type(value).__name__}",
                err_type="Bad Request",
                param="structured_outputs",
            )
        fields[name] = value
    return fields


def structured_outputs_for(
    response_format: object,
    structured_outputs: object,
    *,
    chat: bool,
    tool_choice: object = None,
) -> StructuredOutputsParams | None:
    """The request's ``StructuredOutputsParams`` (``None``: unconstrained), as vLLM's
    request validators and ``extract_structured_outputs`` make it; `HTTPError` (400)
    with vLLM's message where vLLM refuses the request body."""
    rf_type: object = None
    if response_format is not None:
        if not isinstance(response_format, Mapping):
            raise HTTPError(
                "1 validation error:\n  response_format: Input should be a dictionary",
                err_type="Bad Request",
                param="response_format",
            )
        rf_type = response_format.get("type")
        if rf_type == "json_schema" and response_format.get("json_schema") is None:
            raise validation_error(
                "When response_format type is 'json_schema', the 'json_schema' field "
                "must be provided.",
                "response_format",
            )
        if rf_type == "structural_tag":
            raise HTTPError(
                "response_format of type 'structural_tag' is not supported by trio-vllm serve.",
                param="response_format",
            )
        if rf_type not in ("text", "json_object", "json_schema"):
            raise HTTPError(
                "1 validation error:\n  response_format.type: Input should be 'text', "
                f"'json_object' or 'json_schema', got {rf_type!r}",
                err_type="Bad Request",
                param="response_format",
            )
    fields: dict[str, object] | None = None
    if structured_outputs is not None:
        fields = _structured_outputs(structured_outputs)
        if sum(fields.get(k) is not None for k in ("json", "regex", "choice")) > 1:
            # vLLM's completion model names the parameter, its chat model does not.
            message = (
                "You can only use one kind of constraints for structured outputs "
                "('json', 'regex' or 'choice')."
            )
            if chat:
                raise HTTPError(message)
            raise validation_error(message, "structured_outputs")
        constrained = any(fields.get(k) is not None for k in ("json", "regex", "choice"))
        if (
            chat
            and constrained
            and (tool_choice if tool_choice is not None else "none")
            not in ("none", "auto", "required")
        ):
            raise HTTPError(
                "You can only either use constraints for structured outputs or tools, not both."
            )
        if "structural_tag" in fields:
            raise HTTPError(
                "structured_outputs.structural_tag is not supported by trio-vllm serve.",
                param="structured_outputs",
            )
    if rf_type == "json_object":
        fields = {**(fields or {}), "json_object": True}
    elif rf_type == "json_schema":
        assert isinstance(response_format, Mapping)
        spec = response_format["json_schema"]
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
            raise HTTPError(
                "1 validation error:\n  response_format.json_schema.name: Field required",
                err_type="Bad Request",
                param="response_format",
            )
        if not isinstance(spec.get("schema"), (dict, type(None))):
            raise HTTPError(
                "1 validation error:\n  response_format.json_schema.schema: Input should be "
                "a valid dictionary",
                err_type="Bad Request",
                param="response_format",
            )
        fields = {**(fields or {}), "json": spec.get("schema")}
    if fields is None:
        return None
    return StructuredOutputsParams(**fields)  # type: ignore[arg-type]
