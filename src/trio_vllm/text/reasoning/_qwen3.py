"""vLLM 0.32's ``qwen3`` reasoning parser: the reasoning side of its ``Qwen3Parser``
engine (``vllm/parser/qwen3.py`` over ``vllm/parser/engine``), as the serving layer
uses it (tool parsing skipped: tool markup stays text).

Grammar: output starts in reasoning (``enable_thinking``, the default; else in
content). ``<think>`` there is dropped, ``</think>`` ends reasoning (dropped; a second
one later too), ``<tool_call>`` ends reasoning implicitly and stays content. The
markers are matched by token id once the stream carries token ids, by text otherwise;
a suffix that may still become a marker is held back. Whitespace-only content before
the first visible content waits to be sent with it (``finish_streaming`` releases it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from ..tools._types import DeltaMessage
from ._base import ReasoningParser
from ._lexer import CONTENT, LiteralLexer, MarkerScanner, Piece

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from ..tools._base import TokenLookup

__all__ = ["Qwen3ReasoningParser"]

_LITERALS = {
    "THINK_START": "<think>",
    "THINK_END": "</think>",
    "TOOL_START": "<tool_call>",
    "TOOL_END": "</tool_call>",
    "FUNC_PREFIX": "<function=",
    "FUNC_END": "</function>",
    "PARAM_START": "<parameter=",
    "PARAM_END": "</parameter>",
    "CLOSE_ANGLE": ">",
}
_ID_TERMINALS = ("THINK_START", "THINK_END", "TOOL_START", "TOOL_END")
_TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")

_State = Literal["reasoning", "content"]
# What a semantic event is here: ("reasoning" | "content", text) or ("end", "").
_Event = tuple[str, str]


class Qwen3ReasoningParser(ReasoningParser):
    """The ``qwen3`` reasoning parser. ``chat_template_kwargs={"enable_thinking":
    False}`` makes every output content, as vLLM.

    The tokenizer needs ``decode(ids)`` for the marker tokens of a streamed delta (our
    `Tokenizer` has it). vLLM also drops special tokens its config does not name
    (``all_special_tokens``); the server renders them out already (they are special),
    so no such drop is done here.
    """

    engine_based_streaming = True

    def __init__(
        self, tokenizer: TokenLookup, *, chat_template_kwargs: Mapping[str, object] | None = None
    ) -> None:
        super().__init__(tokenizer, chat_template_kwargs=chat_template_kwargs)
        self.thinking_enabled = bool(self.chat_template_kwargs.get("enable_thinking", True))
        self._initial: _State = "reasoning" if self.thinking_enabled else "content"
        ids = {name: tokenizer.token_to_id(_LITERALS[name]) for name in _ID_TERMINALS}
        markers = {tid: name for name, tid in ids.items() if tid is not None}
        self._start_id = ids["THINK_START"]
        self._end_id = ids["THINK_END"]
        # Reasoning ends at </think> and at <tool_call> (both must be tokens).
        end_ids = (ids["THINK_END"], ids["TOOL_START"])
        self._end_ids = (
            frozenset(t for t in end_ids if t is not None) if None not in end_ids else frozenset()
        )
        self._boundary_ids = frozenset(
            t for t in (tokenizer.token_to_id(b) for b in _TURN_BOUNDARIES) if t is not None
        )
        self._id_terminal_names = frozenset(markers.values())
        decode = getattr(tokenizer, "decode", None)
        self._scanner = MarkerScanner(
            markers, lambda tid: decode([tid], skip_special_tokens=False) if decode else ""
        )
        self._lexer = LiteralLexer(_LITERALS)
        self._streaming = False
        self._reset()

    def _reset(self) -> None:
        self._state: _State = self._initial
        self._ever_had_ids = False
        self._scanner.reset()
        self._lexer.reset()
        self.reasoning_ended = False
        self._deferred_content = ""
        self._content_has_nonws = False

    # -- the engine ----------------------------------------------------------------------

    def _emit(self, text: str) -> list[_Event]:
        return [(self._state, text)]

    def _on_terminal(self, terminal: str, text: str) -> list[_Event]:
        state = self._state
        if terminal == "THINK_START" and state == "reasoning":
            return []
        if terminal == "THINK_END":
            self._state = "content"
            return [("end", "")] if state == "reasoning" else []
        if terminal == "TOOL_START":
            # Tool parsing is skipped: the marker is content, and ends reasoning.
            self._state = "content"
            return [("end", ""), ("content", text)]
        return self._emit(text)

    def _lexed(self, pieces: list[Piece]) -> list[_Event]:
        events: list[_Event] = []
        strict = self._id_terminal_names if self._ever_had_ids else frozenset()
        for piece in pieces:
            if piece.terminal == CONTENT or piece.terminal in strict:
                if piece.text:
                    events += self._emit(piece.text)
            else:
                events += self._on_terminal(piece.terminal, piece.text)
        return events

    def _feed(self, delta_text: str, delta_token_ids: Sequence[int]) -> list[_Event]:
        if delta_token_ids:
            self._ever_had_ids = True
        events: list[_Event] = []
        for item in self._scanner.scan(delta_text, delta_token_ids):
            if isinstance(item, Piece):
                events += self._lexed(self._lexer.feed(item.text))
            else:
                events += self._lexed(self._lexer.flush())
                events += self._on_terminal(item.terminal, item.text)
        return events

    def _finish(self) -> list[_Event]:
        events: list[_Event] = []
        for item in self._scanner.flush_pending():
            if isinstance(item, Piece):
                events += self._lexed(self._lexer.feed(item.text))
            else:
                events += self._lexed(self._lexer.flush())
                events += self._on_terminal(item.terminal, item.text)
        events += self._lexed(self._lexer.flush())
        if self._state == "reasoning":
            events.append(("end", ""))
            self._state = "content"
        return events

    def _to_delta(self, events: list[_Event], *, finished: bool = False) -> DeltaMessage | None:
        if not events and not self._deferred_content:
            return None
        content_parts = [self._deferred_content] if self._deferred_content else []
        self._deferred_content = ""
        reasoning_parts: list[str] = []
        for kind, text in events:
            if kind == "content":
                content_parts.append(text)
            elif kind == "reasoning":
                reasoning_parts.append(text)
            else:
                self.reasoning_ended = True
        content = "".join(content_parts)
        if not self._content_has_nonws and content:
            if content.strip():
                self._content_has_nonws = True
            elif not finished:
                self._deferred_content, content = content, ""
        reasoning = "".join(reasoning_parts)
        if content or reasoning:
            # vLLM's engine passes only the fields it has (the others stay unset).
            message = DeltaMessage()
            if content:
                message.content = content
            if reasoning:
                message.reasoning = reasoning
            return message
        return None

    # -- the parser interface -------------------------------------------------------------

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        if not self.thinking_enabled:
            return None, model_output
        self._reset()
        events = self._feed(model_output, []) + self._finish()
        reasoning = "".join(t for k, t in events if k == "reasoning")
        content = "".join(t for k, t in events if k == "content")
        self.reasoning_ended = True
        return reasoning or None, content or None

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        if not self._streaming:
            self._streaming = True
            self._reset()
        return self._to_delta(self._feed(delta_text, delta_token_ids))

    def finish_streaming(self) -> DeltaMessage | None:
        """What the stream's end releases: held-back text and deferred whitespace."""
        events = self._finish()
        if events or self._deferred_content:
            return self._to_delta(events, finished=True)
        return None

    def has_engine_confirmed_reasoning_end(self) -> bool:
        return self.reasoning_ended

    def is_reasoning_end_streaming(
        self, input_ids: Sequence[int], delta_ids: Sequence[int]
    ) -> bool:
        return any(t in self._end_ids for t in delta_ids)

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        for token_id in reversed(input_ids):
            if token_id in self._end_ids:
                return True
            if token_id == self._start_id:
                if self.thinking_enabled:
                    return False
                break
            if token_id in self._boundary_ids:
                break
        return not self.thinking_enabled

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        if not self.thinking_enabled:
            return input_ids
        if self._end_id is not None:
            for i in range(len(input_ids) - 1, -1, -1):
                if input_ids[i] == self._end_id:
                    return input_ids[i + 1 :]
        if self._end_ids:
            turn_start = 0
            for i in range(len(input_ids) - 1, -1, -1):
                if input_ids[i] in self._boundary_ids:
                    turn_start = i + 1
                    break
            for i in range(turn_start, len(input_ids)):
                if input_ids[i] in self._end_ids:
                    return input_ids[i:]
        return input_ids
