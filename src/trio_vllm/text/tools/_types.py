"""What tool-call and reasoning parsers return, shaped as vLLM 0.32's protocol models.

``FunctionCall``/``ToolCall`` (a complete call), ``DeltaFunctionCall``/``DeltaToolCall``
(a streamed piece of one), ``DeltaMessage`` (one streamed chat delta: ``content``,
``reasoning``, ``tool_calls``) and ``ExtractedToolCalls`` (vLLM's
``ExtractedToolCallInformation``). Field names and defaults are vLLM's, so the server
encodes them as ``vllm serve`` does. vLLM sends a stream chunk with
``exclude_unset=True``: a delta field a parser never set is left out, one it set to
``None`` goes out as ``null``. The delta structs keep that difference: their optional
fields default to ``msgspec.UNSET`` (left out) and the parsers pass ``None`` exactly
where vLLM's do; an empty ``tool_calls`` is dropped, as vLLM's serializer drops it.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from .._input import random_uuid

__all__ = [
    "DeltaFunctionCall",
    "DeltaMessage",
    "DeltaToolCall",
    "ExtractedToolCalls",
    "FunctionCall",
    "ToolCall",
    "make_tool_call_id",
]


def make_tool_call_id() -> str:
    """vLLM's default tool-call id: ``chatcmpl-tool-`` and 16 random hex characters."""
    return f"chatcmpl-tool-{random_uuid()}"


class FunctionCall(msgspec.Struct):
    """A complete call: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str


class ToolCall(msgspec.Struct):
    """One complete tool call of a response (``id`` is a fresh random id by default)."""

    function: FunctionCall
    id: str = msgspec.field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    """A streamed piece of a call: the name (once, whole) and/or more argument text
    (``UNSET``: not set, left out of the JSON; ``None``: set to ``null``)."""

    name: str | UnsetType | None = UNSET
    arguments: str | UnsetType | None = UNSET


class DeltaToolCall(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A streamed piece of the tool call at ``index``; ``id`` and ``type`` come with
    its first piece. (Fields in vLLM's order, so the JSON reads the same.)"""

    id: str | UnsetType | None = UNSET
    type: Literal["function"] | UnsetType | None = UNSET
    index: int
    function: DeltaFunctionCall | UnsetType | None = UNSET


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    """One streamed chat delta (vLLM's ``DeltaMessage``); ``UNSET`` fields are left
    out of the chunk, ``None`` ones are sent as ``null`` (vLLM's ``exclude_unset``)."""

    role: str | UnsetType | None = UNSET
    content: str | UnsetType | None = UNSET
    reasoning: str | UnsetType | None = UNSET
    tool_calls: list[DeltaToolCall] = msgspec.field(default_factory=list)


class ExtractedToolCalls(msgspec.Struct):
    """The tool calls found in a complete output, and the content left beside them
    (vLLM's ``ExtractedToolCallInformation``)."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None
