"""An incremental JSON event parser with ijson's events (``parse_coro``), sans-I/O.

vLLM's pre-v11 ``mistral`` tool parser feeds its tool-call JSON to ``ijson.parse_coro``
piece by piece and reacts to the ``(prefix, event, value)`` events each piece completes.
`JsonEvents.feed` gives the same events for the same pieces: a container's start or end
as soon as its bracket is read, a key or a string once its closing quote is, a number
or literal once the character after it is (ijson's yajl backend holds a number that may
go on). Invalid JSON raises `ValueError` (as ijson raises its own error), and the parser
stays broken: every later `feed` raises too.
"""

from __future__ import annotations

import json
from typing import Final

__all__ = ["JsonEvent", "JsonEvents"]

JsonEvent = tuple[str, str, object]

_WS: Final = " \t\n\r"
_NUMBER_CHARS: Final = frozenset("0123456789+-.eE")
_LITERALS: Final = {"true": True, "false": False, "null": None}


class JsonEvents:
    """One JSON document, fed in pieces."""

    def __init__(self) -> None:
        # Each open container: ["map" | "array", expecting, current key]
        # expecting: "key_or_end", "colon", "value", "comma_or_end", "value_or_end".
        self._stack: list[list[object]] = []
        self._buf = ""  # an unfinished token (string, number or literal)
        self._kind = ""  # "string" / "number" / "literal" / ""
        self._done = False  # the top-level value is complete
        self._broken = False

    def _prefix(self) -> str:
        parts: list[str] = []
        for kind, _, key in self._stack:
            if kind == "map":
                if key is not None:
                    parts.append(str(key))
            else:
                parts.append("item")
        return ".".join(parts)

    def _container_prefix(self) -> str:
        """The prefix of the innermost container's own events (its start/end/keys)."""
        parts: list[str] = []
        for kind, _, key in self._stack[:-1]:
            parts.append("item" if kind == "array" else str(key))
        return ".".join(parts)

    def _fail(self, message: str) -> ValueError:
        self._broken = True
        return ValueError(message)

    def feed(self, data: str) -> list[JsonEvent]:
        """The events ``data`` completes; `ValueError` for invalid JSON."""
        if self._broken:
            raise ValueError("the JSON parser failed earlier")
        events: list[JsonEvent] = []
        i = 0
        while i < len(data):
            ch = data[i]
            if self._kind == "string":
                end = self._string_end(data, i, self._buf)
                if end < 0:
                    self._buf += data[i:]
                    return events
                self._buf += data[i : end + 1]
                i = end + 1
                self._finish_string(events)
                continue
            if self._kind in ("number", "literal"):
                if self._kind == "number" and ch in _NUMBER_CHARS:
                    self._buf += ch
                    i += 1
                    continue
                if self._kind == "literal" and ch.isalpha():
                    self._buf += ch
                    i += 1
                    if self._buf in _LITERALS:
                        self._finish_scalar(events)
                    continue
                self._finish_scalar(events)
                continue  # the character is read again, as the next token's
            if ch in _WS:
                i += 1
                continue
            self._token(ch, events)
            i += 1
        return events

    @staticmethod
    def _string_end(data: str, start: int, held: str) -> int:
        # The closing quote's index at or after ``start``, or -1. ``held`` is the string
        # so far: when it ends inside an escape (an odd run of backslashes), the first
        # character here is escaped.
        run = len(held) - len(held.rstrip("\\"))
        i = start + 1 if run % 2 else start
        while i < len(data):
            if data[i] == "\\":
                i += 2
                continue
            if data[i] == '"':
                return i
            i += 1
        return -1

    def _expecting(self) -> str:
        if not self._stack:
            if self._done:
                raise self._fail("trailing data after the JSON value")
            return "value"
        return str(self._stack[-1][1])

    def _token(self, ch: str, events: list[JsonEvent]) -> None:
        expecting = self._expecting()
        top = self._stack[-1] if self._stack else None
        if expecting == "colon":
            if ch != ":":
                raise self._fail(f"expected ':' got {ch!r}")
            assert top is not None
            top[1] = "value"
            return
        if expecting == "comma_or_end":
            assert top is not None
            if ch == ",":
                top[1] = "key" if top[0] == "map" else "value"
                return
            if (ch == "}" and top[0] == "map") or (ch == "]" and top[0] == "array"):
                self._close(events)
                return
            raise self._fail(f"unexpected {ch!r}")
        if expecting in ("key_or_end", "key"):
            assert top is not None
            if ch == "}" and expecting == "key_or_end":
                self._close(events)
                return
            if ch != '"':
                raise self._fail(f"expected a key, got {ch!r}")
            self._kind, self._buf = "string", '"'
            return
        # a value (or, in an array just opened, its end)
        if ch == "]" and expecting == "value_or_end":
            self._close(events)
            return
        if ch == "{":
            events.append((self._prefix(), "start_map", None))
            self._stack.append(["map", "key_or_end", None])
        elif ch == "[":
            events.append((self._prefix(), "start_array", None))
            self._stack.append(["array", "value_or_end", None])
        elif ch == '"':
            self._kind, self._buf = "string", '"'
        elif ch in "-0123456789":
            self._kind, self._buf = "number", ch
        elif ch in "tfn":
            self._kind, self._buf = "literal", ch
        else:
            raise self._fail(f"invalid character {ch!r}")

    def _close(self, events: list[JsonEvent]) -> None:
        kind = self._stack[-1][0]
        prefix = self._container_prefix()
        self._stack.pop()
        events.append((prefix, "end_map" if kind == "map" else "end_array", None))
        self._value_done()

    def _value_done(self) -> None:
        if not self._stack:
            self._done = True
            return
        top = self._stack[-1]
        top[1] = "comma_or_end"

    def _finish_string(self, events: list[JsonEvent]) -> None:
        raw, self._buf, self._kind = self._buf, "", ""
        try:
            value = json.loads(raw)
        except ValueError:
            raise self._fail(f"invalid string {raw!r}") from None
        top = self._stack[-1] if self._stack else None
        if top is not None and top[0] == "map" and top[1] in ("key_or_end", "key"):
            top[2] = value
            top[1] = "colon"
            events.append((self._container_prefix(), "map_key", value))
            return
        events.append((self._prefix(), "string", value))
        self._value_done()

    def _finish_scalar(self, events: list[JsonEvent]) -> None:
        raw, kind = self._buf, self._kind
        self._buf, self._kind = "", ""
        if kind == "literal":
            if raw not in _LITERALS:
                raise self._fail(f"invalid literal {raw!r}")
            value = _LITERALS[raw]
            event = "null" if value is None else "boolean"
        else:
            try:
                value = json.loads(raw)
            except ValueError:
                raise self._fail(f"invalid number {raw!r}") from None
            event = "number"
        events.append((self._prefix(), event, value))
        self._value_done()
