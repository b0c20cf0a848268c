"""vLLM 0.32's ``pythonic`` tool parser (``PythonicToolParser``): the whole output is a
Python list of calls with literal keyword arguments, ``[f(a=1), g(b='x')]``."""

from __future__ import annotations

import ast
import logging
import re
import warnings
from typing import TYPE_CHECKING

from ._base import ToolParser
from ._types import DeltaMessage, DeltaToolCall, ExtractedToolCalls, ToolCall
from ._utils import UnexpectedAstError, compute_tool_delta, handle_single_tool, make_valid_python

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["PythonicToolParser"]

_log = logging.getLogger(__name__)


def _parse_calls(text: str) -> list[ToolCall]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        module = ast.parse(text)
    parsed = getattr(module.body[0], "value", None)
    if not isinstance(parsed, ast.List) or not all(isinstance(e, ast.Call) for e in parsed.elts):
        raise UnexpectedAstError("Tool output must be a list of function calls")
    return [handle_single_tool(e) for e in parsed.elts]  # type: ignore[arg-type]


class PythonicToolParser(ToolParser):
    """The ``pythonic`` parser (Llama 3.2/4 and ToolACE-style models)."""

    TOOL_CALL_REGEX = re.compile(
        r"\[([a-zA-Z]+\w*\(([a-zA-Z]+\w*=.*,\s*)*([a-zA-Z]+\w*=.*\s)?\),\s*)*"
        r"([a-zA-Z]+\w*\(([a-zA-Z]+\w*=.*,\s*)*([a-zA-Z]+\w*=.*\s*)?\)\s*)+\]",
        re.DOTALL,
    )

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        plain = ExtractedToolCalls(tools_called=False, tool_calls=[], content=model_output)
        if self.TOOL_CALL_REGEX.match(model_output) is None:
            return plain
        try:
            return ExtractedToolCalls(
                tools_called=True, tool_calls=_parse_calls(model_output), content=None
            )
        except Exception:  # vLLM: what does not parse is plain text
            _log.debug("pythonic: no tool call could be parsed", exc_info=True)
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
        if not current_text.startswith("["):
            return DeltaMessage(content=delta_text)
        try:
            valid = make_valid_python(current_text)
            if valid is None:
                return None
            valid_text, added_text = valid
            tool_calls = _parse_calls(valid_text)
            tool_deltas: list[DeltaToolCall] = []
            for index, new_call in enumerate(tool_calls):
                if index < self.current_tool_id:
                    continue
                self.current_tool_id = index
                if len(self.streamed_args_for_tool) == index:
                    self.streamed_args_for_tool.append("")
                complete = index < len(tool_calls) - 1 or ")]" not in added_text
                if complete:
                    self.current_tool_id += 1
                withheld = added_text[:-2] if not complete else ""
                if not complete and added_text[-2] == ")":
                    withheld += "}"  # the call is open: hold back the closing brace
                # The model's strings are single-quoted; the JSON arguments use double.
                withheld = withheld.replace("'", '"')
                delta = compute_tool_delta(
                    self.streamed_args_for_tool[index], new_call, index, withheld
                )
                if delta is not None:
                    tool_deltas.append(delta)
                    if delta.function and isinstance(delta.function.arguments, str):
                        self.streamed_args_for_tool[index] += delta.function.arguments
            # As vLLM: a placeholder so the server's end-of-stream check sees a call
            # (finish_reason tool_calls) without "completing" arguments.
            if tool_deltas and not self.prev_tool_call_arr:
                self.prev_tool_call_arr = [{"arguments": {}}]
            if tool_deltas:
                return DeltaMessage(tool_calls=tool_deltas)
            if not added_text and self.current_tool_id > 0:
                return DeltaMessage(content="")  # all calls done: lets finish_reason be set
            return None
        except Exception:  # vLLM: a delta that fails to parse sends nothing
            _log.debug("pythonic: streaming parse failed", exc_info=True)
            return None
