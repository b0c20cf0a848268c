"""Request and response bodies of the OpenAI-compatible API, as msgspec structs.

Field names, order and defaults follow vLLM 0.32.0's pydantic models
(``vllm/entrypoints/openai/{completion,chat_completion}/protocol.py``,
``vllm/entrypoints/serve/engine/protocol.py``), so a response serializes to the same
JSON keys in the same order. vLLM streams chunks with ``exclude_unset=True``; here a
field typed ``... | UnsetType = UNSET`` is left out of the JSON the same way.

Request structs list the fields trio-vllm knows; `DECLARED_FIELDS` says for each
whether it is implemented or refused (HTTP 400 naming it when set). vLLM's fields that
trio-vllm does not declare are in `UNSUPPORTED_FIELDS` (400 unless harmless); every
other key is ignored and logged, as vLLM's ``extra="allow"`` models do.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

__all__ = [
    "ChatCompletionLogProb",
    "ChatCompletionLogProbs",
    "ChatCompletionLogProbsContent",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionResponseChoice",
    "ChatCompletionStreamChoice",
    "ChatCompletionStreamResponse",
    "ChatDelta",
    "ChatResponseMessage",
    "CompletionLogProbs",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionResponseChoice",
    "CompletionStreamChoice",
    "CompletionStreamResponse",
    "ErrorInfo",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
    "ModelPermission",
    "PromptLogprob",
    "PromptLogprobsJSON",
    "StreamOptions",
    "StreamUsage",
    "UsageInfo",
]

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_STOP_STRINGS = 128  # VLLM_MAX_STOP_STRINGS' default
MAX_COMPLETION_PROMPTS = 1024  # VLLM_MAX_COMPLETION_PROMPTS' default

# ----------------------------------------------------------------------------- requests


class StreamOptions(Struct, kw_only=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(Struct, kw_only=True):
    """The sampling fields both endpoints share (vLLM's names and defaults)."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    user: str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    request_id: str | None = None
    return_token_ids: bool | None = None
    use_beam_search: bool = False
    priority: int = 0
    # Read by server/_structured.py as vLLM's request models read them.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/completions``. ``prompt`` is a string, a list of strings, a list of
    token ids or a list of token-id lists (checked after decoding: msgspec unions hold
    one array type)."""

    prompt: str | list[str | int | list[int]] | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True


FieldSupport = Literal["implemented", "accepted", "refused"]

#: What the server does with each declared request field, per endpoint: "implemented"
#: (it changes the request as in vLLM), "accepted" (vLLM does nothing with it either) or
#: "refused" (any value but the default gets HTTP 400 naming the field: `_openai.py`'s
#: own check where vLLM words one, else "`name` is not supported by trio-vllm serve.").
#: A field is never dropped silently: implementing one is flipping its entry here (and
#: a test over these tables sends each field and checks the verdict).
DECLARED_FIELDS: dict[str, dict[str, FieldSupport]] = {
    "completion": {},
    "chat": {},
    "embedding": {},  # server/_embeddings.py's EmbeddingRequest
}
_SHARED_SUPPORT: dict[str, FieldSupport] = {
    "model": "implemented",
    "frequency_penalty": "implemented",
    "presence_penalty": "implemented",
    "repetition_penalty": "implemented",
    "logit_bias": "implemented",
    "seed": "implemented",
    "stop": "implemented",
    "stream": "implemented",
    "stream_options": "implemented",
    "temperature": "implemented",
    "top_p": "implemented",
    "top_k": "implemented",
    "min_p": "implemented",
    "user": "accepted",  # vLLM's serving code never reads it
    "stop_token_ids": "implemented",
    "include_stop_str_in_output": "implemented",
    "ignore_eos": "implemented",
    "min_tokens": "implemented",
    "skip_special_tokens": "implemented",
    "spaces_between_special_tokens": "implemented",
    "allowed_token_ids": "implemented",
    "prompt_logprobs": "implemented",
    "bad_words": "implemented",
    "request_id": "implemented",
    "return_token_ids": "implemented",
    "use_beam_search": "refused",
    "priority": "refused",  # the text layer's generate takes no priority yet
    "response_format": "implemented",  # server/_structured.py
    "structured_outputs": "implemented",
}
DECLARED_FIELDS["completion"].update(
    _SHARED_SUPPORT,
    prompt="implemented",
    echo="implemented",
    logprobs="implemented",
    max_tokens="implemented",
    n="implemented",
    suffix="refused",  # vLLM refuses it too for a model without FIM rendering
    add_special_tokens="implemented",
)
DECLARED_FIELDS["chat"].update(
    _SHARED_SUPPORT,
    messages="implemented",
    logprobs="implemented",
    top_logprobs="implemented",
    max_tokens="implemented",
    max_completion_tokens="implemented",
    n="implemented",
    echo="implemented",
    add_generation_prompt="implemented",
    continue_final_message="refused",
    add_special_tokens="implemented",
    chat_template="implemented",
    chat_template_kwargs="implemented",
    tools="implemented",
    tool_choice="implemented",
    parallel_tool_calls="implemented",  # server/_tools.py: the grammar, then the calls kept
)
DECLARED_FIELDS["embedding"].update(
    # vLLM 0.32.0's EmbeddingCompletionRequest, every field
    input="implemented",
    model="implemented",
    encoding_format="implemented",  # float and base64; the bytes formats get their own 400
    dimensions="implemented",  # POOLING rules: refused as vLLM refuses it
    user="accepted",
    use_activation="implemented",
    add_special_tokens="implemented",
    embed_dtype="refused",  # float32 only
    endianness="implemented",
    request_id="implemented",
    padding="refused",
    truncate_prompt_tokens="refused",
    truncation_side="refused",
    priority="refused",
    mm_processor_kwargs="refused",
    cache_salt="refused",
)

#: Fields of vLLM's request models that trio-vllm does not declare, with the values it
#: accepts because they change nothing (null). Any other value gets HTTP 400 naming the field
#: instead of a result that silently differs from vLLM's; these are never logged as
#: ignored. Implementing one is declaring it on the request struct (and in
#: `DECLARED_FIELDS`) and removing it here.
UNSUPPORTED_FIELDS: dict[str, tuple[object, ...]] = {
    "logprob_token_ids": (None,),
    "prompt_embeds": (None,),
    "truncate_prompt_tokens": (None,),
    "kv_transfer_params": (None,),
    "ec_transfer_params": (None,),
    "vllm_xargs": (None,),
    "thinking_token_budget": (None,),
    "repetition_detection": (None,),
    "lora_request": (None,),
}

# ----------------------------------------------------------------------------- responses


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(Struct):
    error: ErrorInfo


class UsageInfo(Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    prompt_tokens_details: None = None
    completion_tokens_details: None = None


class StreamUsage(Struct):
    """Usage as vLLM streams it (set fields only, no ``*_details``)."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int


class CompletionLogProbs(Struct):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class PromptLogprob(Struct):
    """One entry of ``prompt_logprobs`` (vLLM's ``Logprob`` dataclass as JSON)."""

    logprob: float
    rank: int | None
    decoded_token: str | None


#: ``prompt_logprobs`` as vLLM answers it: per prompt position ``null`` (the first) or
#: ``{token id (a JSON key): Logprob}``.
PromptLogprobsJSON = list[dict[int, PromptLogprob] | None]


class CompletionResponseChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogProbs | None
    finish_reason: str | None
    stop_reason: int | str | None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobsJSON | None = None
    prompt_token_ids: list[int] | None = None
    routed_experts: None = None


class CompletionResponse(Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    service_tier: None
    system_fingerprint: str | None
    usage: UsageInfo
    kv_transfer_params: None = None
    ec_transfer_params: None = None
    metrics: None = None


class CompletionStreamChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogProbs | None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionStreamResponse(Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: StreamUsage | UnsetType = UNSET
    system_fingerprint: str | UnsetType | None = UNSET


class ChatCompletionLogProb(Struct):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(Struct):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None
    top_logprobs: list[ChatCompletionLogProb] = msgspec.field(default_factory=list)


class ChatCompletionLogProbs(Struct):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatResponseMessage(Struct):
    role: str
    content: str | None = None
    refusal: None = None
    annotations: None = None
    audio: None = None
    function_call: None = None
    # vLLM's ChatMessage serializer drops an empty tool_calls.
    tool_calls: list[Any] | UnsetType = UNSET
    reasoning: str | None = None


class ChatCompletionResponseChoice(Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None
    finish_reason: str | None
    stop_reason: int | str | None
    token_ids: list[int] | None = None
    routed_experts: None = None


class ChatCompletionResponse(Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    service_tier: None
    system_fingerprint: str | None
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsJSON | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    kv_transfer_params: None = None
    ec_transfer_params: None = None
    metrics: None = None


class ChatDelta(Struct):
    # None is sent as null: a parser set it (vLLM's exclude_unset keeps it).
    role: str | UnsetType = UNSET
    content: str | UnsetType | None = UNSET
    reasoning: str | UnsetType | None = UNSET
    tool_calls: list[Any] | UnsetType = UNSET


class ChatCompletionStreamChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatCompletionLogProbs | None
    finish_reason: str | None
    stop_reason: int | str | UnsetType | None = UNSET
    token_ids: list[int] | UnsetType | None = UNSET


class ChatCompletionStreamResponse(Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: StreamUsage | UnsetType = UNSET
    system_fingerprint: str | UnsetType | None = UNSET
    prompt_token_ids: list[int] | UnsetType | None = UNSET
    prompt_text: str | UnsetType | None = UNSET


class ModelPermission(Struct):
    id: str
    object: str
    created: int
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: None = None
    is_blocking: bool = False


class ModelCard(Struct):
    id: str
    object: str
    created: int
    owned_by: str
    root: str | None
    parent: str | None
    max_model_len: int | None
    permission: list[ModelPermission]


class ModelList(Struct):
    object: str
    data: list[ModelCard]
