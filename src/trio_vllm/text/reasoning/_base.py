"""The reasoning parser interface (vLLM 0.32's ``ReasoningParser``) and the
``<think>``/``</think>`` base (``BaseThinkingReasoningParser``), sans-I/O.

``extract_reasoning`` splits a complete output into ``(reasoning, content)``;
``extract_reasoning_streaming`` is fed delta by delta (text and token ids) and returns
the `DeltaMessage` to send (``reasoning`` and/or ``content``), or ``None``. The markers
are found by token id in streaming, by text otherwise, as vLLM does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..tools._types import DeltaMessage

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from ..tools._base import TokenLookup

__all__ = ["ReasoningParser", "ThinkingReasoningParser"]


class ReasoningParser:
    """Base of the reasoning parsers; one per request (streaming keeps state).
    ``chat_template_kwargs`` are the request's (``qwen3`` reads ``enable_thinking``).

    ``engine_based_streaming``: the parser itself says when reasoning ended
    (`has_engine_confirmed_reasoning_end`) and may hold text back until
    `finish_streaming`; otherwise the end is the end marker's token id in a delta
    (`is_reasoning_end_streaming`), as vLLM's serving layer tells the two apart.
    """

    engine_based_streaming: bool = False

    def __init__(
        self, tokenizer: TokenLookup, *, chat_template_kwargs: Mapping[str, object] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether the reasoning section has ended in these token ids."""
        raise NotImplementedError

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        """The token ids after the reasoning section."""
        raise NotImplementedError

    def is_reasoning_end_streaming(
        self, input_ids: Sequence[int], delta_ids: Sequence[int]
    ) -> bool:
        """Whether reasoning ends in this delta (``delta_ids``)."""
        raise NotImplementedError

    def has_engine_confirmed_reasoning_end(self) -> bool:
        """Whether the streamed text so far ended the reasoning (engine-based parsers)."""
        return False

    def finish_streaming(self) -> DeltaMessage | None:
        """What the end of the stream releases (engine-based parsers); ``None`` here."""
        return None

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a complete output; never raises on model output."""
        raise NotImplementedError

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        """What to send for this delta, or ``None``."""
        raise NotImplementedError


class ThinkingReasoningParser(ReasoningParser):
    """Reasoning between a start and an end token (vLLM's ``BaseThinkingReasoningParser``).

    Raises `RuntimeError` when the tokenizer lacks either token, as vLLM does."""

    start_token = "<think>"
    end_token = "</think>"

    def __init__(
        self, tokenizer: TokenLookup, *, chat_template_kwargs: Mapping[str, object] | None = None
    ) -> None:
        super().__init__(tokenizer, chat_template_kwargs=chat_template_kwargs)
        start_id = tokenizer.token_to_id(self.start_token)
        end_id = tokenizer.token_to_id(self.end_token)
        if start_id is None or end_id is None:
            raise RuntimeError(
                f"{type(self).__name__} reasoning parser could not locate "
                "think start/end tokens in the tokenizer!"
            )
        self.start_token_id: int = start_id
        self.end_token_id: int = end_id

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        for token_id in reversed(input_ids):
            if token_id == self.start_token_id:
                return False
            if token_id == self.end_token_id:
                return True
        return False

    def is_reasoning_end_streaming(
        self, input_ids: Sequence[int], delta_ids: Sequence[int]
    ) -> bool:
        return self.end_token_id in delta_ids

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        if self.end_token_id not in input_ids[: max(0, len(input_ids) - 1)]:
            return []
        return input_ids[input_ids.index(self.end_token_id) + 1 :]

    def _split_at_end(self, delta_text: str) -> DeltaMessage:
        end = delta_text.find(self.end_token)
        content = delta_text[end + len(self.end_token) :]
        return DeltaMessage(reasoning=delta_text[:end], content=content if content else None)

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        markers = (self.start_token_id, self.end_token_id)
        if len(delta_token_ids) == 1 and delta_token_ids[0] in markers:
            return None  # a lone marker token sends nothing
        if self.start_token_id in previous_token_ids:
            if self.end_token_id in delta_token_ids:
                return self._split_at_end(delta_text)
            if self.end_token_id in previous_token_ids:
                return DeltaMessage(content=delta_text)
            return DeltaMessage(reasoning=delta_text)
        if self.start_token_id in delta_token_ids:
            if self.end_token_id in delta_token_ids:
                start = delta_text.find(self.start_token)
                end = delta_text.find(self.end_token)
                content = delta_text[end + len(self.end_token) :]
                return DeltaMessage(
                    reasoning=delta_text[start + len(self.start_token) : end],
                    content=content if content else None,
                )
            return DeltaMessage(reasoning=delta_text)
        return DeltaMessage(content=delta_text)

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        before, start, after = model_output.partition(self.start_token)
        model_output = after if start else before
        # Models that do not write the start token: reasoning is from the beginning.
        if self.end_token not in model_output:
            return model_output, None
        reasoning, _, content = model_output.partition(self.end_token)
        return reasoning, content or None
