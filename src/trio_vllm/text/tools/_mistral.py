"""The ``mistral`` tool parser of vLLM 0.32, for tokenizers before Mistral's v11 format.

vLLM 0.32's parser (``vllm/parser/mistral.py`` behind ``MistralParserToolAdapter``)
reads ``content[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``. For a
tokenizer with the ``[TOOL_CALLS]`` token but no ``[ARGS]`` token (Mistral 7B v0.3 and
the other pre-v11 models in Hugging Face format) it runs its legacy path, ported here:
non-streaming, the first JSON value after the marker; streaming, the text after the
marker split at its JSON punctuation and fed to an ijson event stream whose events move
a small state machine (`_jsonevents.JsonEvents` gives ijson's events). Tool-call ids
are Mistral's: 9 random alphanumerics. For ``tool_choice`` required or named the output
is a bare JSON array (no marker), forced by a JSON schema (`guided_schema`).

v11+ tokenizers (``[ARGS]`` in the vocabulary) and ``mistral_common`` tokenizers go
through vLLM's parser engine and ``mistral_common``'s grammar instead; that path is not
ported: `NotImplementedError` for such a tokenizer (the server refuses to start with
it). Raises `RuntimeError` with vLLM's message when the tokenizer has no
``[TOOL_CALLS]`` token.
"""

from __future__ import annotations

import json
import logging
import random
import re
import string
from collections.abc import Mapping, Sequence
from enum import Enum, auto
from typing import Any

from ._base import TokenLookup, ToolParser
from ._jsonevents import JsonEvents
from ._types import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    ToolCall,
)

__all__ = ["MistralToolParser", "guided_schema", "mistral_tool_call_id"]

_log = logging.getLogger(__name__)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_tool_call_id() -> str:
    """A Mistral tool-call id: 9 alphanumerics (what mistral_common accepts)."""
    return "".join(random.choices(_ALPHANUMERIC, k=9))  # an id, not a secret


class _State(Enum):
    WAITING_FOR_TOOL_START = auto()
    WAITING_FOR_TOOL_KEY = auto()
    PARSING_NAME = auto()
    PARSING_NAME_COMPLETED = auto()
    WAITING_FOR_ARGUMENTS_START = auto()
    PARSING_ARGUMENTS = auto()
    PARSING_ARGUMENTS_COMPLETED = auto()
    TOOL_COMPLETE = auto()
    ALL_TOOLS_COMPLETE = auto()


def _function_calls(parsed: object) -> list[FunctionCall]:
    """vLLM's ``_pre_v11_function_calls``."""
    if isinstance(parsed, dict):
        parsed = [parsed]
    if not isinstance(parsed, list):
        return []
    calls: list[FunctionCall] = []
    for call in parsed:
        if not isinstance(call, dict) or not ("name" in call or "arguments" in call):
            continue
        name = call.get("name")
        arguments = call.get("arguments")
        if arguments is None:
            arguments = "{}"
        elif not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(FunctionCall(name=name if isinstance(name, str) else "", arguments=arguments))
    return calls


def guided_schema(tools: Sequence[Mapping[str, Any]], tool_choice: object) -> dict[str, Any] | None:
    """vLLM's ``_build_guided_schema_pre_v11``: the JSON schema of the bare array a
    required or named tool choice forces (``None``: the named tool is not there)."""
    extra: dict[str, Any] = {}
    functions = [t.get("function") for t in tools]
    chosen = [f for f in functions if isinstance(f, Mapping)]
    if isinstance(tool_choice, Mapping):
        named = tool_choice.get("function")
        name = named.get("name") if isinstance(named, Mapping) else None
        chosen = [f for f in chosen if f.get("name") == name]
        if not chosen:
            return None
        extra["maxItems"] = 1
    return {
        "type": "array",
        "minItems": 1,
        **extra,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [f.get("name")]},
                        "arguments": f.get("parameters") or {"type": "object"},
                    },
                    "required": ["name", "arguments"],
                }
                for f in chosen
            ],
        },
    }


class MistralToolParser(ToolParser):
    """The ``mistral`` parser (pre-v11 tokenizers). ``tool_choice`` is the request's:
    required and named outputs are a bare array, ``none`` is never parsed."""

    supports_required_and_named = False  # vLLM reads their output as auto does
    keeps_special_tokens = True
    #: vLLM's parser is an engine adapter: the chain feeds it each delta alone.
    engine_based_streaming = True
    wants_tool_choice = True
    _array_regex = re.compile(r"\[{.*}\]", re.DOTALL)

    def __init__(
        self,
        tokenizer: TokenLookup,
        tools: Sequence[Mapping[str, object]] | None = None,
        *,
        tool_choice: object = None,
    ) -> None:
        super().__init__(tokenizer, tools)
        self.tool_choice = tool_choice
        self.bot_token_id = tokenizer.token_to_id(TOOL_CALLS)
        if self.bot_token_id is None:
            raise RuntimeError(
                "Mistral parser could not locate the tool call token in the tokenizer!"
            )
        if tokenizer.token_to_id(ARGS) is not None:
            raise NotImplementedError(
                "Mistral v11+ tokenizers ([ARGS] in the vocabulary) go through vLLM's "
                "parser engine and mistral_common's grammar; trio-vllm ports the pre-v11 "
                "[TOOL_CALLS] format only"
            )
        # The engine's state (vLLM keeps it on the parser engine, not on the adapter,
        # so the adapter's own prev_tool_call_arr stays empty: nothing "unstreamed").
        self._calls: list[dict[str, object]] = []
        self._streamed: list[str] = []
        self._state = _State.WAITING_FOR_TOOL_START
        self._started = False
        self._name: str | None = None
        self._mistral_id: str | None = None
        self._new_tool = False
        self._string_args: str | None = None
        self._events = JsonEvents()
        self._bare_object = False

    def _forced(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, Mapping)

    # -- non-streaming -------------------------------------------------------------------

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        if self.tool_choice == "none" and self.tools:
            return ExtractedToolCalls(False, [], model_output)
        content: str | None = None
        if TOOL_CALLS in model_output:
            content, *segments = model_output.split(TOOL_CALLS)
            raw = next((s.strip() for s in segments if s.strip()), "")
        elif self._forced():
            raw = model_output.strip()
        else:
            return ExtractedToolCalls(False, [], model_output)
        parsed: object
        try:
            parsed, _ = json.JSONDecoder().raw_decode(raw)
        except json.JSONDecodeError:
            try:
                parsed = json.loads(self._array_regex.findall(raw)[0])
            except (IndexError, json.JSONDecodeError):
                parsed = None
        calls = _function_calls(parsed)
        if not calls:
            return ExtractedToolCalls(False, [], raw)
        return ExtractedToolCalls(
            True,
            [ToolCall(function=c, id=mistral_tool_call_id()) for c in calls],
            content if content and content.strip() else None,
        )

    # -- streaming -----------------------------------------------------------------------

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        marker = self.bot_token_id in delta_token_ids or TOOL_CALLS in delta_text
        # A required/named output is a bare array: its first text starts the calls.
        if marker or (not self._started and delta_text and self._forced()):
            self._started = True
        if not self._started:
            return DeltaMessage(content=delta_text)
        try:
            return self._stream(delta_text, delta_token_ids)
        except Exception:  # vLLM: any failure of a delta sends nothing for it
            _log.debug("mistral: cannot parse the streamed tool call", exc_info=True)
            return None

    def _feed(self, text: str) -> None:
        for prefix, event, value in self._events.feed(text):
            self._on_event(prefix, event, value)

    def _on_event(self, prefix: str, event: str, value: object) -> None:
        # vLLM's update_stream_state_pre_v11_tokenizer coroutine, event by event.
        if prefix == "" and event == "start_map":
            self._bare_object = True
        if self._bare_object:
            prefix = f"item.{prefix}" if prefix else "item"
        if prefix == "item" and event == "start_map":
            self._state = _State.WAITING_FOR_TOOL_KEY
            self._new_tool = True
        if prefix == "item" and event == "map_key" and value == "name":
            self._state = _State.PARSING_NAME
        if prefix == "item.name" and event == "string":
            self._name = str(value)
            self._state = _State.PARSING_NAME_COMPLETED
        if prefix == "item" and event == "map_key" and value == "arguments":
            self._state = _State.WAITING_FOR_ARGUMENTS_START
        if prefix == "item.arguments" and event == "start_map":
            self._state = _State.PARSING_ARGUMENTS
        if prefix == "item.arguments" and event == "end_map":
            self._state = _State.PARSING_ARGUMENTS_COMPLETED
        if prefix == "item.arguments" and event == "string":
            self._string_args = str(value)
        if prefix == "item" and event == "end_map":
            self._state = _State.ALL_TOOLS_COMPLETE if self._bare_object else _State.TOOL_COMPLETE
        if prefix == "" and event == "end_array":
            self._state = _State.ALL_TOOLS_COMPLETE

    def _split(self, state: _State, text: str) -> tuple[str, str]:
        stops = {
            _State.WAITING_FOR_TOOL_START: "{",
            _State.WAITING_FOR_TOOL_KEY: ":{}",
            _State.PARSING_NAME: ",]}",
            _State.WAITING_FOR_ARGUMENTS_START: "{}",
            _State.PARSING_ARGUMENTS: "}",
            _State.PARSING_ARGUMENTS_COMPLETED: "}]",
            _State.PARSING_NAME_COMPLETED: "}]",
            _State.TOOL_COMPLETE: "{]",
        }.get(state)
        if stops is None:
            return text, ""
        # vLLM's _split_delta with each stop count 1: up to the first stop character.
        for i, ch in enumerate(text):
            if ch in stops:
                return text[: i + 1], text[i + 1 :]
        return text, ""

    def _stream(self, delta_text: str, delta_token_ids: Sequence[int]) -> DeltaMessage | None:
        content: str | None = None
        deltas: list[DeltaToolCall] = []
        current = DeltaToolCall(index=self.current_tool_id, type="function")
        modified = False
        if self.bot_token_id in delta_token_ids or TOOL_CALLS in delta_text:
            if not delta_text.startswith(TOOL_CALLS):
                content = delta_text.split(TOOL_CALLS)[0]
            delta_text = "".join(delta_text.split(TOOL_CALLS)[1:])
        while delta_text:
            before = self._state
            if self._state == _State.ALL_TOOLS_COMPLETE:
                content, delta_text = delta_text, ""
                piece = ""
            else:
                piece, delta_text = self._split(self._state, delta_text)
                self._feed(piece)
            if self._new_tool:
                self._new_tool = False
                if modified:
                    if self._mistral_id is not None:
                        current.id, self._mistral_id = self._mistral_id, None
                    self._track(current)
                    deltas.append(current)
                modified = False
                self.current_tool_id += 1
                self._streamed.append("")
                self._calls.append({})
                self._mistral_id = mistral_tool_call_id()
                current = DeltaToolCall(index=self.current_tool_id, type="function")
            if not current.function:
                current.function = DeltaFunctionCall()
            function = current.function
            if self._name is not None:
                modified = True
                function.name = self._name
                self._calls[self.current_tool_id]["name"] = self._name
                self._name = None
            if self._string_args is not None:
                modified = True
                function.arguments = self._string_args
                self._string_args = None
            if self._state == _State.PARSING_NAME_COMPLETED:
                self._state = _State.WAITING_FOR_TOOL_KEY
            if self._state in (_State.PARSING_ARGUMENTS, _State.PARSING_ARGUMENTS_COMPLETED):
                if self._state == _State.PARSING_ARGUMENTS_COMPLETED:
                    self._state = _State.WAITING_FOR_TOOL_KEY
                modified = True
                if isinstance(function.arguments, str):
                    function.arguments += piece
                else:
                    function.arguments = piece
                if before != _State.PARSING_ARGUMENTS:  # the first piece: lstripped
                    function.arguments = function.arguments.lstrip()
        if modified:
            if self._mistral_id is not None:
                current.id, self._mistral_id = self._mistral_id, None
            self._track(current)
            deltas.append(current)
        if content or deltas:
            message = DeltaMessage()
            if content:
                message.content = content
            if deltas:
                message.tool_calls = deltas
            return message
        return DeltaMessage() if self._state == _State.ALL_TOOLS_COMPLETE else None

    def _track(self, call: DeltaToolCall) -> None:
        function = call.function
        if function and isinstance(function.arguments, str):
            self._streamed[self.current_tool_id] += function.arguments
            self._calls[self.current_tool_id]["arguments"] = self._streamed[self.current_tool_id]

    def get_remaining_unstreamed_args(self) -> str:
        """Always ``""``: vLLM reads the adapter's (empty) state, not the engine's."""
        return ""
