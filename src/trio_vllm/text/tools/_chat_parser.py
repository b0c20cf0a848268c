"""One chat choice's output through its reasoning and tool parsers, as vLLM 0.32's
serving layer runs them (``vllm.parser.abstract_parser.DelegatingParser``).

Non-streaming: `ChatOutputParser.parse` splits the text into reasoning, content and
tool calls. Streaming: `ChatOutputParser.parse_delta` is fed every delta of the choice
and returns what to send; reasoning comes first, then (once it ended) the tool parser
sees the text after it. ``tool_choice`` is ``"auto"``, ``"none"``, ``"required"`` or a
named tool (``{"type": "function", "function": {"name": ...}}``): for the last two a
parser that ``supports_required_and_named`` reads the output the tool-derived JSON
schema forced (a named tool's arguments; an array of ``{"name", "parameters"}``), any
other parser (one constrained by a structural tag) reads it as ``auto`` does. Sans-I/O:
no exceptions escape for bad model output.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._required import required_tool_call_delta
from ._types import DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, make_tool_call_id

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..reasoning._base import ReasoningParser
    from ._base import ToolParser

__all__ = ["ChatOutputParser"]


class ChatOutputParser:
    """The reasoning and tool parsers of one choice (either may be ``None``)."""

    def __init__(
        self,
        reasoning_parser: ReasoningParser | None,
        tool_parser: ToolParser | None,
        *,
        tool_choice: str | Mapping[str, Any] | None,
        enable_auto_tools: bool,
        include_reasoning: bool = True,
    ) -> None:
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.tool_choice = tool_choice
        self.enable_auto_tools = enable_auto_tools
        self.include_reasoning = include_reasoning
        # vLLM's `_engine_based`: no parser that is not engine-based (our tool parsers
        # never are), which changes how the text after the reasoning is sent.
        self._engine_based = tool_parser is None and (
            reasoning_parser is None or reasoning_parser.engine_based_streaming
        )
        # vLLM's StreamState.
        self._previous_text = ""
        self._previous_ids: list[int] = []
        self._reasoning_ended = False
        self._prompt_checked = False
        self._tool_text_started = False
        self._function_name_returned = False
        function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
        self._named: str | None = (
            str(function.get("name")) if isinstance(function, Mapping) else None
        )
        supports = tool_parser is not None and tool_parser.supports_required_and_named
        # vLLM's _extract_tool_calls: which reading of the output applies.
        self._parse_named = supports and self._named is not None
        self._parse_required = supports and tool_choice == "required"
        forced = self._named is not None or tool_choice == "required"
        self._forced = forced
        self._parse_auto = enable_auto_tools and (
            tool_choice in ("auto", None) or (not supports and forced)
        )

    # -- non-streaming -----------------------------------------------------------------

    def parse(self, model_output: str) -> tuple[str | None, str | None, list[FunctionCall] | None]:
        """``(reasoning, content, tool_calls)``; ``tool_calls`` is ``[]`` when tools
        are not parsed and ``None`` when parsed and none was found (vLLM's values)."""
        reasoning: str | None
        content: str | None
        if self.reasoning_parser is None:
            reasoning, content = None, model_output
        else:
            reasoning, content = self.reasoning_parser.extract_reasoning(model_output)
        tool_calls, content = self._extract_tool_calls(content)
        return reasoning, content, tool_calls

    def _extract_tool_calls(
        self, content: str | None
    ) -> tuple[list[FunctionCall] | None, str | None]:
        parser = self.tool_parser
        if parser is None or self.tool_choice == "none":
            return [], content
        if self._parse_named:
            if content is None or not content.strip():
                return [], None
            assert self._named is not None
            return [FunctionCall(name=self._named, arguments=content)], None
        if self._parse_required:
            return _required_calls(content or ""), None
        if not self._parse_auto:
            return [], content
        info = parser.extract_tool_calls(content if content is not None else "")
        if not info.tools_called:
            if self._forced and (content is None or not content.strip()):
                return [], None
            return None, content
        calls = [c.function for c in info.tool_calls]
        content = info.content
        if content and content.strip() == "":
            content = None
        return calls, content

    # -- streaming ----------------------------------------------------------------------

    def _in_reasoning(self) -> bool:
        return self.reasoning_parser is not None and not self._reasoning_ended

    def _in_tools(self) -> bool:
        return self.tool_parser is not None and self._reasoning_ended

    def parse_delta(
        self,
        delta_text: str,
        delta_token_ids: Sequence[int],
        prompt_token_ids: Sequence[int] | None,
        *,
        finished: bool,
    ) -> DeltaMessage | None:
        """What to send for this delta of the choice, or ``None`` (vLLM's
        ``parse_delta``); ``finished`` on its last delta."""
        rp = self.reasoning_parser
        if not self._prompt_checked and prompt_token_ids is not None:
            self._prompt_checked = True
            if rp is None or rp.is_reasoning_end(prompt_token_ids):
                self._reasoning_ended = True
        delta_ids = list(delta_token_ids)
        current_text = self._previous_text + delta_text
        current_ids = self._previous_ids + delta_ids
        message: DeltaMessage | None = None
        transitioned = False

        if self._in_reasoning() and rp is not None:
            message = rp.extract_reasoning_streaming(
                self._previous_text,
                current_text,
                delta_text,
                self._previous_ids,
                current_ids,
                delta_ids,
            )
            if rp.engine_based_streaming:
                ended = rp.has_engine_confirmed_reasoning_end()
            else:
                ended = rp.is_reasoning_end_streaming(current_ids, delta_ids)
            if ended:
                self._reasoning_ended = transitioned = True
                current_ids = rp.extract_content_ids(delta_ids)
                flush = rp.finish_streaming() if rp.engine_based_streaming else None
                current_text = ((message.content if message else None) or "") + (
                    (flush.content if flush else None) or ""
                )
                if not self._engine_based:
                    delta_text = current_text
                elif current_text:
                    # No tool phase follows: the flushed text goes out as content now.
                    if message is None:
                        message = DeltaMessage()
                    message.content = current_text

        if self._in_tools() and self.tool_parser is not None:
            if not self._tool_text_started:
                # The tool parser sees the text after the reasoning only.
                self._tool_text_started = True
                self._previous_text, self._previous_ids = "", []
                delta_text, delta_ids = current_text, current_ids
            reasoning = message.reasoning if message else None
            message = self._tool_delta(current_text, delta_text, current_ids, delta_ids)
            if reasoning:
                if message is None:
                    message = DeltaMessage(reasoning=reasoning)
                elif not message.reasoning:
                    message.reasoning = reasoning

        if (
            message is None
            and not transitioned
            and not self._in_reasoning()
            and not self._in_tools()
        ):
            message = DeltaMessage(content=delta_text)

        self._previous_text, self._previous_ids = current_text, current_ids

        if finished:
            message = self._finalize(message)
        if message is not None and not self.include_reasoning:
            message.reasoning = None
            if not message.content and not message.tool_calls:
                message = None
        return message

    def _tool_delta(
        self, current_text: str, delta_text: str, current_ids: list[int], delta_ids: list[int]
    ) -> DeltaMessage | None:
        assert self.tool_parser is not None
        if self.tool_choice == "none":
            return DeltaMessage(content=delta_text) if delta_text else None
        if self._parse_named:
            # vLLM's extract_named_tool_call_streaming: every delta is argument text,
            # the first one with the call's id and name.
            assert self._named is not None
            if self._function_name_returned:
                call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta_text))
            else:
                self._function_name_returned = True
                call = DeltaToolCall(
                    id=make_tool_call_id(),
                    type="function",
                    index=0,
                    function=DeltaFunctionCall(name=self._named, arguments=delta_text),
                )
            return DeltaMessage(tool_calls=[call])
        if self._parse_required:
            return required_tool_call_delta(self._previous_text, current_text)
        return self.tool_parser.extract_tool_calls_streaming(
            self._previous_text,
            current_text,
            delta_text,
            self._previous_ids,
            current_ids,
            delta_ids,
        )

    def _finalize(self, message: DeltaMessage | None) -> DeltaMessage | None:
        # Arguments the tool parser parsed but did not stream go with the last delta.
        if (
            self.tool_parser is not None
            and message is not None
            and message.tool_calls
            and (last := message.tool_calls[-1]).function  # vLLM: set, not None
        ):
            last.function.arguments = (
                last.function.arguments or ""
            ) + self.tool_parser.get_remaining_unstreamed_args()
        # An engine-based reasoning parser still in reasoning releases what it held back.
        rp = self.reasoning_parser
        if rp is not None and rp.engine_based_streaming and not self._reasoning_ended:
            flush = rp.finish_streaming()
            if flush is not None:
                if message is None:
                    message = flush
                else:
                    if flush.content:
                        message.content = (message.content or "") + flush.content
                    if flush.reasoning:
                        message.reasoning = (message.reasoning or "") + flush.reasoning
        return message


def _bool_like(value: object) -> bool:
    # pydantic's lax bool (JSON input): true/false, 0/1, and its words.
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, (int, float)):
        return value in (0, 1)
    return isinstance(value, str) and value.lower() in _BOOL_WORDS


_BOOL_WORDS = frozenset({"0", "off", "f", "false", "n", "no", "1", "on", "t", "true", "y", "yes"})


def _required_calls(content: str) -> list[FunctionCall]:
    """vLLM's ``TypeAdapter(list[FunctionDefinition]).validate_json``: the calls of a
    JSON array of ``{"name", "parameters"}`` objects; ``[]`` when it does not validate."""
    try:
        items = json.loads(content)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    calls: list[FunctionCall] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        if not isinstance(item.get("description"), (str, type(None))):
            return []
        if not isinstance(item.get("parameters"), (dict, type(None))):
            return []
        if not (_bool_like(item.get("strict")) and _bool_like(item.get("defer_loading"))):
            return []
        arguments = json.dumps(item.get("parameters"), ensure_ascii=False)
        calls.append(FunctionCall(name=item["name"], arguments=arguments))
    return calls
