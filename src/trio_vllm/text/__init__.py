"""The text layer: vLLM's frontend duties, sans-I/O (no trio, anyio or zmq here).

What vLLM's ``InputProcessor`` and ``OutputProcessor`` do, as plain objects you feed and
read: a model directory's tokenizer and generation config, prompt processing and
validation, incremental detokenization, stop strings, logprobs, ``n > 1`` fan-out, output
kinds, chat templates. ``tokenizers`` and ``jinja2`` are imported on first use, so
importing this package stays light.
"""

from __future__ import annotations

from ._types import ChatMessage as ChatMessage
from ._types import CompletionOutput as CompletionOutput
from ._types import Logprob as Logprob
from ._types import Prompt as Prompt
from ._types import PromptLogprobs as PromptLogprobs
from ._types import RequestOutput as RequestOutput
from ._types import SampleLogprobs as SampleLogprobs
from ._types import TextPrompt as TextPrompt
from ._types import TokensPrompt as TokensPrompt

__all__ = [
    "ChatMessage",
    "CompletionOutput",
    "Logprob",
    "Prompt",
    "PromptLogprobs",
    "RequestOutput",
    "SampleLogprobs",
    "TextPrompt",
    "TokensPrompt",
]
