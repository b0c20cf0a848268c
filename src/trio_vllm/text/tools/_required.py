"""Streaming the calls of a ``tool_choice="required"`` output (vLLM 0.32's
``vllm/tool_parsers/streaming.py``): the model was forced to write a JSON array of
``{"name": ..., "parameters": ...}`` objects; each call is announced (id, name, the
arguments so far) once its name is complete and its parameters started, then only new
argument text follows. One prefix-stable scan of the text tells what an earlier,
shorter text had revealed, so no state is kept beyond the two texts. Sans-I/O.
"""

from __future__ import annotations

import json
from typing import Final

from ._types import DeltaFunctionCall, DeltaMessage, DeltaToolCall, make_tool_call_id

__all__ = ["required_tool_call_delta"]


class _Span:
    """Where one array element sits in the text (vLLM's ``_RequiredToolCallSpan``)."""

    __slots__ = ("args_end", "args_start", "name", "name_end")

    def __init__(self) -> None:
        self.name: str | None = None
        self.name_end: int | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None

    def ready_at(self, length: int) -> bool:
        return (
            self.name is not None
            and self.name_end is not None
            and self.name_end <= length
            and self.args_start is not None
            and self.args_start < length
        )

    @property
    def ready(self) -> bool:
        return self.name is not None and self.args_start is not None


_EXPECT_KEY: Final = 0
_EXPECT_COLON: Final = 1
_EXPECT_VALUE: Final = 2
_IN_STRING_VALUE: Final = 3
_IN_CONTAINER_VALUE: Final = 4
_IN_SCALAR_VALUE: Final = 5
_AFTER_VALUE: Final = 6


def _scan(text: str) -> list[_Span]:
    """vLLM's ``_scan_required_tool_calls``, state for state."""
    spans: list[_Span] = []
    depth = 0
    in_string = False
    escaped = False
    string_start = 0
    cur: _Span | None = None
    expect = _EXPECT_KEY
    key: str | None = None
    value_start = 0

    def end_value(pos: int) -> None:
        nonlocal expect
        assert cur is not None
        if key == "parameters":
            cur.args_end = pos
        elif key == "name" and expect == _IN_STRING_VALUE:
            try:
                cur.name = json.loads(text[value_start:pos])
                cur.name_end = pos
            except json.JSONDecodeError:
                cur.name = None
        expect = _AFTER_VALUE

    def start_value(pos: int, state: int) -> None:
        nonlocal expect, value_start
        assert cur is not None
        value_start = pos
        if key == "parameters":
            cur.args_start = pos
        expect = state

    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 2 and cur is not None:
                    if expect == _EXPECT_KEY:
                        key = text[string_start + 1 : i]
                        expect = _EXPECT_COLON
                    elif expect == _IN_STRING_VALUE:
                        end_value(i + 1)
            continue
        if ch == '"':
            in_string = True
            string_start = i
            if depth == 2 and cur is not None and expect == _EXPECT_VALUE:
                start_value(i, _IN_STRING_VALUE)
            continue
        if ch in "{[":
            if depth == 0:
                if ch != "[":
                    return spans
            elif depth == 1:
                if ch != "{":
                    return spans
                cur = _Span()
                spans.append(cur)
                expect = _EXPECT_KEY
                key = None
            elif depth == 2 and cur is not None and expect == _EXPECT_VALUE:
                start_value(i, _IN_CONTAINER_VALUE)
            depth += 1
            continue
        if ch in "}]":
            if depth == 2 and cur is not None and expect == _IN_SCALAR_VALUE:
                end_value(i)
            depth -= 1
            if depth == 2 and cur is not None and expect == _IN_CONTAINER_VALUE:
                end_value(i + 1)
            elif depth == 1:
                cur = None
            elif depth <= 0:
                return spans
            continue
        if depth != 2 or cur is None:
            continue
        if ch == ":":
            if expect == _EXPECT_COLON:
                expect = _EXPECT_VALUE
        elif ch == ",":
            if expect == _IN_SCALAR_VALUE:
                end_value(i)
            expect = _EXPECT_KEY
            key = None
        elif ch.isspace():
            if expect == _IN_SCALAR_VALUE:
                end_value(i)
        elif expect == _EXPECT_VALUE:
            start_value(i, _IN_SCALAR_VALUE)
    return spans


def required_tool_call_delta(previous_text: str, current_text: str) -> DeltaMessage | None:
    """What to stream for this delta (vLLM's ``extract_required_tool_call_streaming``):
    ``previous_text`` is a prefix of ``current_text``; ``None`` when nothing is new."""
    if not current_text:
        return None
    sent_len = len(previous_text)
    calls: list[DeltaToolCall] = []
    for index, span in enumerate(_scan(current_text)):
        if not span.ready:
            break  # elements come in order: nothing later can be ready
        assert span.args_start is not None
        end = span.args_end if span.args_end is not None else len(current_text)
        if span.ready_at(sent_len):
            new_arguments = current_text[min(end, sent_len) : end]
            if new_arguments:
                calls.append(
                    DeltaToolCall(
                        index=index,
                        function=DeltaFunctionCall(name=None, arguments=new_arguments),
                    )
                )
            continue
        calls.append(
            DeltaToolCall(
                id=make_tool_call_id(),
                type="function",
                index=index,
                function=DeltaFunctionCall(
                    name=span.name, arguments=current_text[span.args_start : end]
                ),
            )
        )
    return DeltaMessage(tool_calls=calls) if calls else None
