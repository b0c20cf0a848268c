"""The text layer: vLLM's frontend duties, sans-I/O (no trio, anyio or zmq here).

What vLLM's ``InputProcessor`` and ``OutputProcessor`` do, as plain objects you feed and
read: a model directory's tokenizer and generation config, prompt processing and
validation, incremental detokenization, stop strings, logprobs, ``n > 1`` fan-out, output
kinds, chat templates. ``tokenizers`` and ``jinja2`` are imported on first use, so
importing this package stays light.
"""

from __future__ import annotations

from ._chat import normalize_messages as normalize_messages
from ._chat import render_chat_template as render_chat_template
from ._defaults import OPENAI_SAMPLING_DEFAULTS as OPENAI_SAMPLING_DEFAULTS
from ._defaults import SamplingDefaults as SamplingDefaults
from ._detokenizer import FastIncrementalDetokenizer as FastIncrementalDetokenizer
from ._detokenizer import IncrementalDetokenizer as IncrementalDetokenizer
from ._detokenizer import SlowIncrementalDetokenizer as SlowIncrementalDetokenizer
from ._detokenizer import check_stop_strings as check_stop_strings
from ._input import DEFAULT_MAX_LOGPROBS as DEFAULT_MAX_LOGPROBS
from ._input import InputProcessor as InputProcessor
from ._input import ProcessedRequest as ProcessedRequest
from ._input import internal_request_id as internal_request_id
from ._input import random_hex as random_hex
from ._input import random_uuid as random_uuid
from ._logprobs import LogprobsProcessor as LogprobsProcessor
from ._output import OutputProcessor as OutputProcessor
from ._output import OutputProcessorOutput as OutputProcessorOutput
from ._output import ParentRequest as ParentRequest
from ._output import RequestState as RequestState
from ._pooling import EmbeddingOutput as EmbeddingOutput
from ._pooling import EmbeddingRequestOutput as EmbeddingRequestOutput
from ._pooling import PoolingOutput as PoolingOutput
from ._pooling import PoolingRequestOutput as PoolingRequestOutput
from ._pooling import pooling_model_of as pooling_model_of
from ._pooling import prepare_pooling as prepare_pooling
from ._pooling import to_pooling_output as to_pooling_output
from ._tokenize import detokenize as detokenize
from ._tokenize import token_strs as token_strs
from ._tokenize import tokenize as tokenize
from ._tokenize import tokenize_chat as tokenize_chat
from ._tokenizer import ModelFiles as ModelFiles
from ._tokenizer import Tokenizer as Tokenizer
from ._tokenizer import load_tokenizer as load_tokenizer
from ._tokenizer import resolve_model_dir as resolve_model_dir
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
    "DEFAULT_MAX_LOGPROBS",
    "OPENAI_SAMPLING_DEFAULTS",
    "ChatMessage",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "FastIncrementalDetokenizer",
    "IncrementalDetokenizer",
    "InputProcessor",
    "Logprob",
    "LogprobsProcessor",
    "ModelFiles",
    "OutputProcessor",
    "OutputProcessorOutput",
    "ParentRequest",
    "PoolingOutput",
    "PoolingRequestOutput",
    "ProcessedRequest",
    "Prompt",
    "PromptLogprobs",
    "RequestOutput",
    "RequestState",
    "SampleLogprobs",
    "SamplingDefaults",
    "SlowIncrementalDetokenizer",
    "TextPrompt",
    "Tokenizer",
    "TokensPrompt",
    "check_stop_strings",
    "detokenize",
    "internal_request_id",
    "load_tokenizer",
    "normalize_messages",
    "pooling_model_of",
    "prepare_pooling",
    "random_hex",
    "random_uuid",
    "render_chat_template",
    "resolve_model_dir",
    "to_pooling_output",
    "token_strs",
    "tokenize",
    "tokenize_chat",
]
