"""vLLM 0.32's ``hermes`` tool parser (``Hermes2ProToolParser``): ``<tool_call>{"name":
..., "arguments": {...}}</tool_call>`` blocks, text before the first one is content."""

from __future__ import annotations

import json
import logging
import re
from typing import TYPE_CHECKING

from ._base import TokenLookup, ToolParser
from ._types import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)
from ._utils import is_complete_json, partial_tag_overlap

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = ["HermesToolParser"]

_log = logging.getLogger(__name__)


class HermesToolParser(ToolParser):
    """The ``hermes`` parser (Hermes 2 Pro, Qwen 2.5 and the many models trained on its
    format). The server renders with ``skip_special_tokens=False`` for it, as vLLM does,
    since some models mark ``<tool_call>`` special."""

    structural_tag_model = "hermes"
    keeps_special_tokens = True

    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"
    tool_call_regex = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
    _name_regex = re.compile(r'"name"\s*:\s*"([^"]+)"')
    _args_regex = re.compile(r'"arguments"\s*:\s*')

    def __init__(
        self, tokenizer: TokenLookup, tools: Sequence[Mapping[str, object]] | None = None
    ) -> None:
        super().__init__(tokenizer, tools)
        # Streaming: how much of the text has gone out as content.
        self._sent_content_idx = 0

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        if self.tool_call_start_token not in model_output:
            return ExtractedToolCalls(tools_called=False, tool_calls=[], content=model_output)
        try:
            raw_calls = [
                json.loads(a if a else b) for a, b in self.tool_call_regex.findall(model_output)
            ]
            tool_calls = [
                ToolCall(
                    function=FunctionCall(
                        name=call["name"],
                        arguments=json.dumps(call["arguments"], ensure_ascii=False),
                    )
                )
                for call in raw_calls
            ]
        except Exception:  # vLLM: any failure leaves the output as plain content
            _log.debug("hermes: no tool call could be parsed", exc_info=True)
            return ExtractedToolCalls(tools_called=False, tool_calls=[], content=model_output)
        content = model_output[: model_output.find(self.tool_call_start_token)]
        return ExtractedToolCalls(
            tools_called=True, tool_calls=tool_calls, content=content if content else None
        )

    def _extract_content(self, current_text: str) -> str | None:
        """Unsent text before any tool call, holding back a possible partial tag."""
        if self.tool_call_start_token not in current_text:
            sendable = len(current_text) - partial_tag_overlap(
                current_text, self.tool_call_start_token
            )
        else:
            sendable = current_text.index(self.tool_call_start_token)
        if sendable > self._sent_content_idx:
            content = current_text[self._sent_content_idx : sendable]
            self._sent_content_idx = sendable
            return content
        return None

    def _tool_call_jsons(self, text: str) -> list[tuple[str, bool]]:
        """(json text, complete) for each ``<tool_call>`` region."""
        results: list[tuple[str, bool]] = []
        pos = 0
        while True:
            start = text.find(self.tool_call_start_token, pos)
            if start == -1:
                break
            json_start = start + len(self.tool_call_start_token)
            json_end = text.find(self.tool_call_end_token, json_start)
            if json_end != -1:
                results.append((text[json_start:json_end].strip(), True))
                pos = json_end + len(self.tool_call_end_token)
                continue
            raw = text[json_start:]
            overlap = partial_tag_overlap(raw, self.tool_call_end_token)
            if overlap:
                raw = raw[:-overlap]
            tc_json = raw.strip()
            # Valid JSON without its closing tag is complete: the tag is yet to come.
            results.append((tc_json, is_complete_json(tc_json) if tc_json else False))
            break
        return results

    def _tool_args(self, tc_json: str, is_complete: bool) -> str | None:
        match = self._args_regex.search(tc_json)
        if not match:
            return None
        raw = tc_json[match.end() :]
        if is_complete:
            raw = raw.rstrip()
            if raw.endswith("}"):
                raw = raw[:-1].rstrip()
        return raw

    def _args_diff(self, index: int, tc_json: str, is_complete: bool) -> str | None:
        args = self._tool_args(tc_json, is_complete)
        if args is None or len(args) <= len(self.streamed_args_for_tool[index]):
            return None
        diff = args[len(self.streamed_args_for_tool[index]) :]
        self.streamed_args_for_tool[index] = args
        self.prev_tool_call_arr[index]["arguments"] = args
        return diff

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        # Re-parses the whole text each time and diffs against what was sent.
        try:
            content = self._extract_content(current_text)
            deltas: list[DeltaToolCall] = []
            for i, (tc_json, is_complete) in enumerate(self._tool_call_jsons(current_text)):
                if i >= len(self.prev_tool_call_arr):
                    self.prev_tool_call_arr.append({})
                    self.streamed_args_for_tool.append("")
                if "name" not in self.prev_tool_call_arr[i]:
                    match = self._name_regex.search(tc_json)
                    if not match:
                        break  # tool i+1 waits for tool i's name
                    name = match.group(1)
                    self.prev_tool_call_arr[i]["name"] = name
                    deltas.append(
                        DeltaToolCall(
                            index=i,
                            type="function",
                            id=make_tool_call_id(),
                            function=DeltaFunctionCall(name=name),
                        )
                    )
                diff = self._args_diff(i, tc_json, is_complete)
                if diff:
                    deltas.append(
                        DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=diff))
                    )
            if content or deltas:
                return DeltaMessage(content=content, tool_calls=deltas)
            return None
        except Exception:  # vLLM: a delta that fails to parse sends nothing
            _log.debug("hermes: streaming parse failed", exc_info=True)
            return None
