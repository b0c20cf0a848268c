"""vLLM 0.32's ``deepseek_r1`` reasoning parser (``DeepSeekR1ReasoningParser``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..tools._types import DeltaMessage
from ._base import ThinkingReasoningParser

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["DeepSeekR1ReasoningParser"]


class DeepSeekR1ReasoningParser(ThinkingReasoningParser):
    """``<think>...</think>``; the prompt usually opens ``<think>`` itself, so the
    output is reasoning until ``</think>`` even without a start token."""

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        ret = super().extract_reasoning_streaming(
            previous_text,
            current_text,
            delta_text,
            previous_token_ids,
            current_token_ids,
            delta_token_ids,
        )
        if (
            ret is not None
            and self.start_token_id not in previous_token_ids
            and self.start_token_id not in delta_token_ids
        ):
            if self.end_token_id in delta_token_ids:
                return self._split_at_end(delta_text)
            if self.end_token_id in previous_token_ids:
                return DeltaMessage(content=delta_text)
            return DeltaMessage(reasoning=delta_text)
        return ret
