"""The tool parser interface (vLLM 0.32's ``ToolParser``), sans-I/O.

A parser is built per request (it keeps streaming state). ``extract_tool_calls`` reads
a complete output; ``extract_tool_calls_streaming`` is fed the text and token ids so
far, delta by delta, and returns what to send for this delta (``None``: nothing yet).
``prev_tool_call_arr`` and ``streamed_args_for_tool`` are the state vLLM's server reads
after the last delta (the arguments a parser parsed but did not stream yet).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from ._types import DeltaMessage, ExtractedToolCalls

__all__ = ["TokenLookup", "ToolParser"]


class TokenLookup(Protocol):
    """What a parser needs of a tokenizer: a token's id (``Tokenizer`` has it)."""

    def token_to_id(self, token: str) -> int | None: ...


class ToolParser:
    """Base of the tool-call parsers.

    ``supports_required_and_named``: the server may parse ``tool_choice`` required and
    named outputs as the JSON array a tool-derived schema forces (vLLM's flag).
    ``structural_tag_model``: the structural-tag format that constrains this parser's
    calls for required/named choices (vLLM's; then, as vLLM with its default
    ``VLLM_ENFORCE_STRICT_TOOL_CALLING``, those outputs are parsed as ``auto``'s and
    ``supports_required_and_named`` is false). ``keeps_special_tokens``: the parser's
    ``adjust_request`` turns ``skip_special_tokens`` off when tools are used.
    """

    supports_required_and_named: bool = True
    structural_tag_model: str | None = None
    keeps_special_tokens: bool = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.structural_tag_model is not None:
            cls.supports_required_and_named = False

    def __init__(
        self, tokenizer: TokenLookup, tools: Sequence[Mapping[str, object]] | None = None
    ) -> None:
        self.prev_tool_call_arr: list[dict[str, object]] = []
        self.current_tool_id: int = -1
        self.current_tool_name_sent: bool = False
        self.streamed_args_for_tool: list[str] = []
        self.tokenizer = tokenizer
        self.tools = list(tools or [])

    def get_remaining_unstreamed_args(self) -> str:
        """Arguments of the last tool call parsed but not streamed yet (vLLM's)."""
        if not self.prev_tool_call_arr:
            return ""
        index = len(self.prev_tool_call_arr) - 1
        args = self.prev_tool_call_arr[index].get("arguments", {})
        expected = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        actual = (
            self.streamed_args_for_tool[index] if index < len(self.streamed_args_for_tool) else ""
        )
        return expected[len(actual) :] if expected.startswith(actual) else ""

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        """The tool calls of a complete output. Never raises on bad model output: what
        cannot be parsed is returned as content with ``tools_called=False``."""
        raise NotImplementedError

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        """What to stream for this delta (``current_text = previous_text +
        delta_text``), or ``None`` for nothing yet. Never raises on bad model output."""
        raise NotImplementedError
