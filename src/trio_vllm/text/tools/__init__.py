"""Tool-call parsers: vLLM 0.32's ``hermes``, ``llama3_json`` and ``pythonic``, sans-I/O.

Build one parser per request with the model's tokenizer (anything with
``token_to_id``) and the request's tools; call ``extract_tool_calls(text)`` on a
complete output, or ``extract_tool_calls_streaming(...)`` delta by delta. Results are
vLLM's shapes (`ExtractedToolCalls`, `DeltaMessage`). Parsers never raise on model
output: what they cannot parse stays content, as in vLLM.
"""

from __future__ import annotations

from ._base import TokenLookup as TokenLookup
from ._base import ToolParser as ToolParser
from ._chat_parser import ChatOutputParser as ChatOutputParser
from ._constraints import STRUCTURAL_TAG_MODELS as STRUCTURAL_TAG_MODELS
from ._constraints import tool_choice_constraint as tool_choice_constraint
from ._hermes import HermesToolParser as HermesToolParser
from ._llama import Llama3JsonToolParser as Llama3JsonToolParser
from ._pythonic import PythonicToolParser as PythonicToolParser
from ._types import DeltaFunctionCall as DeltaFunctionCall
from ._types import DeltaMessage as DeltaMessage
from ._types import DeltaToolCall as DeltaToolCall
from ._types import ExtractedToolCalls as ExtractedToolCalls
from ._types import FunctionCall as FunctionCall
from ._types import ToolCall as ToolCall
from ._types import make_tool_call_id as make_tool_call_id

#: ``--tool-call-parser`` names (vLLM's spelling) -> parser class.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "pythonic": PythonicToolParser,
}


def tool_parser_class(name: str) -> type[ToolParser]:
    """The parser named ``name``; `KeyError` naming the known ones otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise KeyError(f"Tool parser '{name}' not found (known: {known}).") from None


__all__ = [
    "STRUCTURAL_TAG_MODELS",
    "TOOL_PARSERS",
    "ChatOutputParser",
    "DeltaFunctionCall",
    "DeltaMessage",
    "DeltaToolCall",
    "ExtractedToolCalls",
    "FunctionCall",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "PythonicToolParser",
    "TokenLookup",
    "ToolCall",
    "ToolParser",
    "make_tool_call_id",
    "tool_choice_constraint",
    "tool_parser_class",
]
