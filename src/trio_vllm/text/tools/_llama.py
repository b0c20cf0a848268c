"""vLLM 0.32's ``llama3_json`` tool parser (``Llama3JsonToolParser``): one or more JSON
objects ``{"name": ..., "arguments"|"parameters": {...}}``, optionally after
``<|python_tag|>``, separated by ``"; "`` when streamed."""

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
from ._utils import (
    allow_flags,
    find_common_prefix,
    is_complete_json,
    malformed_json_error,
    partial_json_loads,
)

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = ["Llama3JsonToolParser"]

_log = logging.getLogger(__name__)


class Llama3JsonToolParser(ToolParser):
    """The ``llama3_json`` parser (Llama 3.x/4 with vLLM's JSON tool template).

    Raises `RuntimeError` when the tokenizer has no ``<|python_tag|>`` token, as vLLM
    does. Streaming needs partial-json-parser (the ``tools`` extra)."""

    structural_tag_model = "llama"

    bot_token = "<|python_tag|>"
    _start_regex = re.compile(r"\{")
    _decoder = json.JSONDecoder()

    def __init__(
        self, tokenizer: TokenLookup, tools: Sequence[Mapping[str, object]] | None = None
    ) -> None:
        super().__init__(tokenizer, tools)
        self.bot_token_id = tokenizer.token_to_id(self.bot_token)
        if self.bot_token_id is None:
            raise RuntimeError(
                "Llama3JsonToolParser could not locate the bot token "
                f"'{self.bot_token}' in the tokenizer."
            )

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        plain = ExtractedToolCalls(tools_called=False, tool_calls=[], content=model_output)
        if not (self.bot_token in model_output or "{" in model_output):
            return plain
        end_index = -1  # skip braces inside an object already parsed
        tool_calls: list[ToolCall] = []
        for match in self._start_regex.finditer(model_output):
            start_index = match.start()
            if start_index <= end_index:
                continue
            try:
                obj, json_end = self._decoder.raw_decode(model_output[start_index:])
                end_index = start_index + json_end
                name = obj["name"]
                arguments = obj["arguments"] if "arguments" in obj else obj["parameters"]
                tool_calls.append(
                    ToolCall(
                        function=FunctionCall(
                            name=name, arguments=json.dumps(arguments, ensure_ascii=False)
                        )
                    )
                )
            except Exception:  # vLLM: one bad object makes the whole output content
                _log.debug("llama3_json: no tool call could be parsed", exc_info=True)
                return plain
        if tool_calls:
            return ExtractedToolCalls(tools_called=True, tool_calls=tool_calls, content=None)
        return plain

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        if not (current_text.startswith(self.bot_token) or current_text.startswith("{")):
            return DeltaMessage(content=delta_text)
        # Until the name is sent, partial strings are not completed: a name goes out whole.
        flags = allow_flags(strings=self.current_tool_name_sent)
        try:
            tool_call_arr: list[dict[str, object]] = []
            is_complete: list[bool] = []
            try:
                start_idx = len(self.bot_token) if current_text.startswith(self.bot_token) else 0
                while start_idx < len(current_text):
                    obj, end_idx = partial_json_loads(current_text[start_idx:], flags)
                    is_complete.append(
                        is_complete_json(current_text[start_idx : start_idx + end_idx])
                    )
                    start_idx += end_idx + len("; ")
                    if "parameters" in obj:
                        if "arguments" in obj:
                            raise ValueError("model generated both parameters and arguments")
                        obj["arguments"] = obj["parameters"]
                    tool_call_arr.append(obj)
            except malformed_json_error():
                return None  # not enough text to parse yet

            current: dict[str, object] = (
                tool_call_arr[self.current_tool_id] if tool_call_arr else {}
            )
            delta: DeltaMessage | None
            if not tool_call_arr:
                return None
            if len(tool_call_arr) > self.current_tool_id + 1:
                # A new call starts: first send what the JSON completion gave the
                # previous one that was not streamed yet.
                delta = None
                if self.current_tool_id >= 0:
                    cur_arguments = current.get("arguments")
                    if cur_arguments:
                        args_json = json.dumps(cur_arguments, ensure_ascii=False)
                        sent = len(self.streamed_args_for_tool[self.current_tool_id])
                        rest = args_json[sent:]
                        delta = DeltaMessage(
                            tool_calls=[
                                DeltaToolCall(
                                    index=self.current_tool_id,
                                    function=DeltaFunctionCall(arguments=rest),
                                )
                            ]
                        )
                        self.streamed_args_for_tool[self.current_tool_id] += rest
                self.current_tool_id = len(tool_call_arr) - 1
                self.current_tool_name_sent = False
                self.streamed_args_for_tool.append("")
                return delta
            if not self.current_tool_name_sent:
                function_name = current.get("name")
                delta = None
                if function_name:
                    if not isinstance(function_name, str):
                        raise TypeError("a tool name must be a string")
                    delta = DeltaMessage(
                        tool_calls=[
                            DeltaToolCall(
                                index=self.current_tool_id,
                                type="function",
                                id=make_tool_call_id(),
                                function=DeltaFunctionCall(name=function_name),
                            )
                        ]
                    )
                    self.current_tool_name_sent = True
            else:
                cur_arguments = current.get("arguments")
                delta = None
                if cur_arguments:
                    sent = len(self.streamed_args_for_tool[self.current_tool_id])
                    args_json = json.dumps(cur_arguments, ensure_ascii=False)
                    prev_arguments = self.prev_tool_call_arr[self.current_tool_id].get("arguments")
                    diff: str | None = None
                    if is_complete[self.current_tool_id]:
                        diff = args_json[sent:]
                    elif prev_arguments:
                        prev_json = json.dumps(prev_arguments, ensure_ascii=False)
                        if args_json != prev_json:
                            diff = find_common_prefix(prev_json, args_json)[sent:]
                    if diff is not None:
                        delta = DeltaMessage(
                            tool_calls=[
                                DeltaToolCall(
                                    index=self.current_tool_id,
                                    function=DeltaFunctionCall(arguments=diff),
                                )
                            ]
                        )
                        self.streamed_args_for_tool[self.current_tool_id] += diff
            self.prev_tool_call_arr = tool_call_arr
            return delta
        except Exception:  # vLLM: a delta that fails to parse sends nothing
            _log.debug("llama3_json: streaming parse failed", exc_info=True)
            return None
