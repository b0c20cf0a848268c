"""Reasoning parsers: vLLM 0.32's ``deepseek_r1`` and ``qwen3``, sans-I/O.

One parser per request, built with the model's tokenizer (anything with
``token_to_id``): ``extract_reasoning(text)`` -> ``(reasoning, content)``, or
``extract_reasoning_streaming(...)`` delta by delta -> `DeltaMessage` with
``reasoning``/``content``. The markers must be tokens of the vocabulary.
"""

from __future__ import annotations

from ._base import ReasoningParser as ReasoningParser
from ._base import ThinkingReasoningParser as ThinkingReasoningParser
from ._deepseek_r1 import DeepSeekR1ReasoningParser as DeepSeekR1ReasoningParser
from ._qwen3 import Qwen3ReasoningParser as Qwen3ReasoningParser

#: ``--reasoning-parser`` names (vLLM's spelling) -> parser class.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The parser named ``name``; `KeyError` naming the known ones otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise KeyError(f"Reasoning parser '{name}' not found (known: {known}).") from None


__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ThinkingReasoningParser",
    "reasoning_parser_class",
]
