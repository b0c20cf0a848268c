"""The OpenAI endpoints' rules, without I/O: request -> plan, outputs -> response bytes.

`plan_completion` and `plan_chat` check a decoded request the way vLLM's
``OpenAIServingCompletion``/``OpenAIServingChat`` do (same status codes, same messages
where vLLM words them) and turn it into token prompts and ``SamplingParams``.
`CompletionResponder` and `ChatResponder` turn the frontend's DELTA
`RequestOutput` objects into SSE events, or into the final JSON body, with vLLM's
field names and chunking: one event per completion per output, a role chunk first for
chat, a usage chunk last when ``stream_options.include_usage``, then ``data: [DONE]``.
"""

from __future__ import annotations

import functools
import time
import uuid
from typing import TYPE_CHECKING

import msgspec
from msgspec import UNSET

from .._exceptions import InvalidRequestError
from ..protocol import RequestOutputKind, SamplingParams, StructuredOutputsParams
from ..protocol.rules import (
    CHAT,
    COMPLETION,
    OPENAI,
    PROMPT,
    PROMPT_TEXT,
    SAMPLING,
    Limits,
    PromptInput,
    PromptText,
)
from ..text import random_hex
from ..text.tools import tool_choice_constraint
from ._http import HTTPError, encode
from ._schemas import (
    DECLARED_FIELDS,
    INT64_MAX,
    INT64_MIN,
    MAX_COMPLETION_PROMPTS,
    MAX_STOP_STRINGS,
    UNSUPPORTED_FIELDS,
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
    PromptLogprob,
    StreamUsage,
    UsageInfo,
)
from ._structured import structured_outputs_for
from ._tools import (
    ChoiceParsers,
    ToolOptions,
    check_tools,
    delta_fields,
    skip_special_tokens,
    tool_choice_of,
)

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from ..protocol.rules import Violation
    from ..text import CompletionOutput, Logprob, RequestOutput, SamplingDefaults, TokensPrompt
    from ._frontend import TextFrontend, TokenizerLike
    from ._schemas import PromptLogprobsJSON

__all__ = [
    "ChatResponder",
    "CompletionResponder",
    "GenerationPlan",
    "plan_chat",
    "plan_completion",
]

DONE = b"data: [DONE]\n\n"
# Stands for a chunk's text while its event template is built: a NUL (JSON-escaped,
# so it never equals an escaped id or model by accident) and a per-process nonce.
_MARK = f"\x00trio-vllm-{uuid.uuid4().hex}"
_MARK_JSON = encode(_MARK)
_LOGPROB_FLOOR = -9999.0  # vLLM clamps -inf to this (JSON has no infinity)
_COMPLETION_MAX_TOKENS = 16  # CompletionRequest.max_tokens' default
_DEFAULT_MAX_CHARS_PER_TOKEN = 64  # bound on prompt characters per allowed token


class GenerationPlan:
    """Everything a generation request needs once it passed validation."""

    __slots__ = (
        "continuous_usage",
        "created",
        "echo_only",
        "echo_texts",
        "engine_ids",
        "include_usage",
        "logprobs",
        "model",
        "n",
        "params",
        "parsers",
        "prompt_logprobs",
        "prompts",
        "request_id",
        "return_token_ids",
        "role",
        "stream",
    )

    def __init__(
        self,
        *,
        request_id: str,
        model: str,
        prompts: list[TokensPrompt],
        engine_ids: list[str],
        params: list[SamplingParams],
        n: int,
        stream: bool,
        include_usage: bool,
        continuous_usage: bool,
        logprobs: int | None,
        return_token_ids: bool,
        echo_texts: list[str] | None = None,
        echo_only: bool = False,
        role: str = "assistant",
        parsers: ChoiceParsers | None = None,
        prompt_logprobs: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.created = int(time.time())
        self.model = model
        self.prompts = prompts
        self.engine_ids = engine_ids
        self.params = params
        self.n = n
        self.stream = stream
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.logprobs = logprobs
        self.return_token_ids = return_token_ids
        self.echo_texts = echo_texts
        self.echo_only = echo_only  # echo with max_tokens=0: the prompt is the answer
        self.role = role
        # Chat with --tool-call-parser/--reasoning-parser: the choices' parsers.
        self.parsers = parsers
        self.prompt_logprobs = prompt_logprobs  # asked for: the response carries them


# ----------------------------------------------------------------------------- planning


def base_request_id(header_id: str | None, body_id: str | None) -> str:
    """vLLM's ``_base_request_id``: the ``X-Request-Id`` header, the body's
    ``request_id``, or 32 fresh random hex digits (as a uuid4's hex)."""
    if header_id is not None:
        return header_id
    return random_hex(16) if body_id is None else body_id


def _refuse(violation: Violation | None) -> None:
    """Raise a request rule's verdict as vLLM's HTTP 400 (``param`` as vLLM names it)."""
    if violation is not None:
        raise HTTPError(str(violation), param=violation.param)


@functools.lru_cache(maxsize=8)
def _limits(max_model_len: int) -> Limits:
    return Limits(max_model_len=max_model_len)


# Refused declared fields whose refusal has its own check (and message) below.
_OWN_REFUSALS = frozenset(
    {"use_beam_search", "suffix", "tools", "tool_choice", "continue_final_message"}
)
# Per endpoint: (field, its default) for every refused field without an own check.
_GENERIC_REFUSALS = {
    kind: tuple(
        (f.name, f.default)
        for f in msgspec.structs.fields(struct)
        if DECLARED_FIELDS[kind][f.name] == "refused" and f.name not in _OWN_REFUSALS
    )
    for kind, struct in (("completion", CompletionRequest), ("chat", ChatCompletionRequest))
}


def _not_supported(name: str) -> HTTPError:
    return HTTPError(f"`{name}` is not supported by trio-vllm serve.", param=name)


def _common_checks(
    req: CompletionRequest | ChatCompletionRequest, extra: Mapping[str, object], limits: Limits
) -> None:
    for name, accepted in UNSUPPORTED_FIELDS.items():
        if name in extra and extra[name] not in accepted:
            raise _not_supported(name)
    kind = "completion" if isinstance(req, CompletionRequest) else "chat"
    for name, default in _GENERIC_REFUSALS[kind]:
        if getattr(req, name) != default:
            raise _not_supported(name)
    if req.use_beam_search:
        raise HTTPError("Beam search is not supported by trio-vllm serve.", param="use_beam_search")
    _refuse(OPENAI.check(req, limits))
    if req.seed is not None and not (INT64_MIN <= req.seed <= INT64_MAX):
        raise HTTPError("seed must be a 64-bit integer.", param="seed")
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP_STRINGS:
        raise HTTPError(f"stop may hold at most {MAX_STOP_STRINGS} strings.", param="stop")


def _check_prompt_len(limits: Limits, count: int) -> None:
    _refuse(PROMPT["prompt_too_long"](PromptInput(None, count), limits))


def _check_prompt_chars(limits: Limits, text: str, tokenizer: TokenizerLike) -> None:
    # vLLM bounds text before tokenizing (max_chars_per_token); so does the server, so a
    # huge prompt costs no tokenizer time.
    per_token = getattr(tokenizer, "max_chars_per_token", _DEFAULT_MAX_CHARS_PER_TOKEN)
    _refuse(PROMPT_TEXT.check(PromptText(text, per_token), limits))


def _sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    defaults: SamplingDefaults,
    *,
    n: int,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    # vLLM's to_sampling_params: the request's value, else the model's default (its
    # generation config), else the OpenAI default.
    logit_bias: dict[int, float] | None = None
    if req.logit_bias:
        try:
            logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        except ValueError:
            raise HTTPError("logit_bias keys must be token ids.", param="logit_bias") from None
    stop: list[str] = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    value = defaults.value
    params = SamplingParams(
        n=n,
        presence_penalty=value("presence_penalty", req.presence_penalty),
        frequency_penalty=value("frequency_penalty", req.frequency_penalty),
        repetition_penalty=value("repetition_penalty", req.repetition_penalty),
        temperature=value("temperature", req.temperature),
        top_p=value("top_p", req.top_p),
        top_k=int(value("top_k", req.top_k)),
        min_p=value("min_p", req.min_p),
        seed=req.seed,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        output_kind=RequestOutputKind.DELTA,
        logit_bias=logit_bias,
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words or None,
        structured_outputs=structured_outputs,
        skip_clone=True,  # built for this request only (vLLM's OpenAI layer does the same)
    )
    # vLLM's to_sampling_params makes a SamplingParams, which checks its values; the
    # model-dependent rules follow in the text layer (its input processor).
    _refuse(SAMPLING.check(params))
    return params


def _usage_flags(req: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
    opts = req.stream_options
    if not req.stream or opts is None:
        return False, False
    include = bool(opts.include_usage)
    return include, include and bool(opts.continuous_usage_stats)


def plan_completion(
    req: CompletionRequest,
    llm: TextFrontend,
    *,
    model: str,
    header_request_id: str | None,
    extra: Mapping[str, object],
) -> GenerationPlan:
    """Check a completion request and tokenize its prompt(s); `HTTPError` if bad."""
    limits = _limits(llm.max_model_len)
    _common_checks(req, extra, limits)
    structured = structured_outputs_for(req.response_format, req.structured_outputs, chat=False)
    _refuse(COMPLETION.check(req, limits))
    prompt = req.prompt
    assert prompt is not None  # COMPLETION's rule
    items: list[str | list[int]]
    if isinstance(prompt, str):
        items = [prompt]
    elif all(isinstance(p, int) for p in prompt):
        items = [[p for p in prompt if isinstance(p, int)]]
    elif all(isinstance(p, str) for p in prompt):
        items = [p for p in prompt if isinstance(p, str)]
    elif all(isinstance(p, list) for p in prompt):
        items = [p for p in prompt if isinstance(p, list)]
    else:
        raise HTTPError(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists.",
            param="prompt",
        )
    if len(items) > MAX_COMPLETION_PROMPTS:
        raise HTTPError(
            f"prompt list length {len(items)} exceeds the maximum allowed count of "
            f"{MAX_COMPLETION_PROMPTS}.",
            param="prompt",
        )
    if req.suffix is not None:
        _refuse_suffix(req)
    max_model_len = llm.max_model_len
    tokenizer = llm.tokenizer
    defaults = llm.sampling_defaults
    prompts: list[TokensPrompt] = []
    params: list[SamplingParams] = []
    echo_texts: list[str] = []
    echo_only = bool(req.echo) and req.max_tokens == 0
    # vLLM's to_sampling_params: an echo without prompt_logprobs asks for `logprobs`
    # prompt logprobs; they become the echoed prompt's logprobs (and the choice's
    # prompt_logprobs, as vLLM's response carries them whenever the engine was asked)
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo:
        prompt_logprobs = req.logprobs
    # vLLM's normalize_null_max_tokens: an explicit null is the default 16, so the
    # generation config's max_new_tokens never stands in for it (a cap still applies).
    requested = _COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    for item in items:
        if isinstance(item, str):
            _check_prompt_chars(limits, item, tokenizer)
            ids = tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
            text = item
        else:
            if not item:
                raise HTTPError("prompt token-id lists must not be empty.", param="prompt")
            if min(item) < 0:
                raise HTTPError("prompt token ids must be non-negative.", param="prompt")
            ids = item
            text = tokenizer.decode(item, skip_special_tokens=False) if req.echo else ""
        _check_prompt_len(limits, len(ids))
        # vLLM's get_max_tokens; a limit below 1 is refused with the SamplingParams.
        max_tokens = defaults.max_tokens(requested, max_model_len - len(ids))
        prompts.append({"prompt_token_ids": ids, "prompt": text})
        params.append(
            _sampling_params(
                req,
                defaults,
                n=req.n,
                max_tokens=1 if echo_only else max_tokens,
                logprobs=req.logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_outputs=structured,
            )
        )
        # vLLM: with return_token_ids the echo is the prompt's ids, not its text
        echo_texts.append("" if req.return_token_ids else text)
    request_id = f"cmpl-{base_request_id(header_request_id, req.request_id)}"
    include_usage, continuous = _usage_flags(req)
    return GenerationPlan(
        request_id=request_id,
        model=model,
        prompts=prompts,
        engine_ids=[f"{request_id}-{i}" for i in range(len(prompts))],
        params=params,
        n=req.n,
        stream=bool(req.stream),
        include_usage=include_usage,
        continuous_usage=continuous,
        logprobs=req.logprobs,
        return_token_ids=bool(req.return_token_ids),
        echo_texts=echo_texts if req.echo else None,
        echo_only=echo_only,
        prompt_logprobs=prompt_logprobs,
    )


def _refuse_suffix(req: CompletionRequest) -> None:
    """vLLM 0.32.0's answer to ``suffix`` (``OnlineRenderer``): its checks in its order.

    Only a renderer with fill-in-the-middle support (DeepSeek V4's) takes a suffix; the
    server renders prompts with the model directory's tokenizer alone, which has none,
    so every request with a suffix (even ``""``) is refused as vLLM refuses it there.
    """
    if req.echo:
        raise HTTPError("Echo is unsupported with suffix.", param="suffix")
    prompt = req.prompt
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and all(isinstance(p, str) for p in prompt)
    ):
        raise HTTPError(
            "suffix is only supported for models with FIM completion rendering", param="suffix"
        )
    raise HTTPError(
        "suffix requires text prompt input for FIM completion rendering", param="suffix"
    )


_UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


def request_chat_template(
    chat_template: str | None,
    chat_template_kwargs: Mapping[str, object] | None,
    *,
    trusted: bool,
) -> tuple[str | None, dict[str, object] | None]:
    """The template and template kwargs a chat request renders with, as vLLM's.

    Its ``validate_chat_template``: a request's own template (``chat_template``, or
    ``chat_template_kwargs["chat_template"]``) is an `HTTPError` 400 unless the server
    trusts them (``--trust-request-chat-template``): the template is code the server
    would run. A trusted ``chat_template_kwargs["chat_template"]`` is the template when
    ``chat_template`` is not given (vLLM's ``get_apply_chat_template_kwargs`` lets the
    field override the kwarg), and leaves the kwargs."""
    kwargs = None if chat_template_kwargs is None else dict(chat_template_kwargs)
    in_kwargs = kwargs.get("chat_template") if kwargs else None
    if not trusted and (chat_template is not None or in_kwargs is not None):
        raise HTTPError(_UNTRUSTED_TEMPLATE)
    # a null one is no template (vLLM renders with the model's); another non-string
    # type stays, for the renderer to refuse
    if kwargs and "chat_template" in kwargs and (in_kwargs is None or isinstance(in_kwargs, str)):
        del kwargs["chat_template"]
        if chat_template is None:
            chat_template = in_kwargs
    return chat_template, kwargs


def plan_chat(
    req: ChatCompletionRequest,
    llm: TextFrontend,
    *,
    model: str,
    header_request_id: str | None,
    extra: Mapping[str, object],
    tool_options: ToolOptions = ToolOptions(),  # noqa: B008 - frozen, immutable
    trust_request_chat_template: bool = False,
) -> GenerationPlan:
    """Check a chat request and render its messages; `HTTPError` if bad (a request's own
    chat template unless ``trust_request_chat_template``, as vLLM)."""
    n = 1 if req.n is None else req.n
    limits = _limits(llm.max_model_len)
    _common_checks(req, extra, limits)
    structured = structured_outputs_for(
        req.response_format, req.structured_outputs, chat=True, tool_choice=req.tool_choice
    )
    _refuse(CHAT.check(req, limits))
    top = 0 if req.top_logprobs is None else req.top_logprobs
    check_tools(req, tool_options)
    tool_choice = tool_choice_of(req)
    active = tool_options.active_tool_parser
    if active is not None and req.tools and tool_choice != "none":
        # vLLM's parser adjust_request: the tools' grammar for required/named (and
        # auto with a strict tool or a single-call limit) replaces the request's own.
        try:
            structured = tool_choice_constraint(
                active,
                req.tools,
                tool_choice,
                parallel_tool_calls=req.parallel_tool_calls,
                structured_outputs=structured,
                own_structured_outputs=req.structured_outputs is not None,
            )
        except InvalidRequestError as exc:
            raise HTTPError(str(exc), param=exc.param) from None
    # vLLM checks the template's trust after the tool checks, before rendering
    chat_template, chat_template_kwargs = request_chat_template(
        req.chat_template, req.chat_template_kwargs, trusted=trust_request_chat_template
    )
    if req.continue_final_message:
        raise HTTPError(
            "`continue_final_message` is not supported by trio-vllm serve.",
            param="continue_final_message",
        )
    if not req.messages:
        raise HTTPError("messages must not be empty.", param="messages")
    for message in req.messages:
        if not isinstance(message.get("role"), str):
            raise HTTPError("every message needs a string `role`.", param="messages")
    max_model_len = llm.max_model_len
    for message in req.messages:
        content = message.get("content")
        if isinstance(content, str):
            _check_prompt_chars(limits, content, llm.tokenizer)
    try:
        text, ids = llm.render_chat(
            req.messages,
            add_generation_prompt=req.add_generation_prompt,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            tools=req.tools,
        )
    except ValueError as exc:  # InvalidRequestError included
        raise HTTPError(str(exc)) from None
    except Exception as exc:
        # Rendering runs a template over the request's own values (and, with
        # ``chat_template``, the request's own template): whatever it raises (a jinja
        # TemplateError, 1/0, a sandbox limit, a filter given the wrong type) is the
        # request's fault, so a 400 naming it, never a 500 with a traceback.
        if any(cls.__name__ == "TemplateError" for cls in type(exc).__mro__):
            raise HTTPError(f"chat template error: {exc}") from None
        raise HTTPError(f"chat template error: {type(exc).__name__}: {exc}") from None
    if req.add_special_tokens:
        ids = llm.tokenizer.encode(text, add_special_tokens=True)
    _check_prompt_len(limits, len(ids))
    requested = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    defaults = llm.sampling_defaults
    max_tokens = defaults.max_tokens(requested, max_model_len - len(ids))
    logprobs = top if req.logprobs else None
    # vLLM's to_sampling_params: an echo without prompt_logprobs asks for top_logprobs
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo:
        prompt_logprobs = req.top_logprobs
    params = _sampling_params(
        req,
        defaults,
        n=n,
        max_tokens=max_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_outputs=structured,
    )
    parsers = None
    if tool_options.has_parser:
        skip = skip_special_tokens(req, tool_options, tool_choice)
        if skip != params.skip_special_tokens:
            params = msgspec.structs.replace(params, skip_special_tokens=skip)
        parsers = ChoiceParsers(req, tool_options, llm.tokenizer, n, tool_choice)
    request_id = f"chatcmpl-{base_request_id(header_request_id, req.request_id)}"
    include_usage, continuous = _usage_flags(req)
    role = "assistant" if req.add_generation_prompt else str(req.messages[-1]["role"])
    echo: list[str] | None = None
    if req.echo:
        last = req.messages[-1]
        content = last.get("content")
        if last.get("role") == role and content:
            if isinstance(content, list):
                content = "\n".join(
                    str(part.get("text", "")) for part in content if isinstance(part, dict)
                )
            echo = [str(content)]
        else:
            echo = [""]
    return GenerationPlan(
        request_id=request_id,
        model=model,
        prompts=[{"prompt_token_ids": ids, "prompt": text}],
        engine_ids=[request_id],
        params=[params],
        n=n,
        stream=bool(req.stream),
        include_usage=include_usage,
        continuous_usage=continuous,
        logprobs=logprobs,
        return_token_ids=bool(req.return_token_ids),
        echo_texts=echo,
        role=role,
        parsers=parsers,
        prompt_logprobs=prompt_logprobs,
    )


# ----------------------------------------------------------------------------- responses


def _template(chunk: object) -> tuple[bytes, bytes] | None:
    """The SSE event of ``chunk`` split around its text (``_MARK``): the event for any
    text is ``head + encode(text) + tail``, byte for byte what encoding the chunk with
    that text gives; ``None`` if the mark does not occur exactly once."""
    event = b"data: " + encode(chunk) + b"\n\n"
    if event.count(_MARK_JSON) != 1:
        return None
    head, _, tail = event.partition(_MARK_JSON)
    return head, tail


def _decoded(tokenizer: TokenizerLike, token_id: int, logprob: Logprob | None) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: TokenizerLike,
    token_ids: Sequence[int],
    steps: Sequence[Mapping[int, Logprob] | None],
    num_top: int,
    initial_offset: int,
) -> CompletionLogProbs:
    """vLLM's ``_create_completion_logprobs`` (``num_top + 1`` entries per position)."""
    offsets: list[int] = []
    token_lps: list[float | None] = []
    tokens: list[str] = []
    tops: list[dict[str, float] | None] = []
    last_len = 0
    for i, tid in enumerate(token_ids):
        step = steps[i] if i < len(steps) else None
        if step is None:
            token = _decoded(tokenizer, tid, None)
            tokens.append(token)
            token_lps.append(None)
            tops.append(None)
        else:
            chosen = step.get(tid)
            token = _decoded(tokenizer, tid, chosen)
            tokens.append(token)
            token_lps.append(
                _LOGPROB_FLOOR if chosen is None else max(chosen.logprob, _LOGPROB_FLOOR)
            )
            tops.append(
                {
                    _decoded(tokenizer, t, lp): max(lp.logprob, _LOGPROB_FLOOR)
                    for j, (t, lp) in enumerate(step.items())
                    if num_top == -1 or num_top >= j
                }
            )
        offsets.append(initial_offset if not offsets else offsets[-1] + last_len)
        last_len = len(token)
    return CompletionLogProbs(offsets, token_lps, tokens, tops)


def chat_logprobs(
    tokenizer: TokenizerLike,
    token_ids: Sequence[int],
    steps: Sequence[Mapping[int, Logprob] | None],
    num_top: int,
) -> ChatCompletionLogProbs:
    """vLLM's ``_create_chat_logprobs``."""
    content: list[ChatCompletionLogProbsContent] = []
    for i, tid in enumerate(token_ids):
        step = steps[i] if i < len(steps) else None
        chosen = None if step is None else step.get(tid)
        if step is None or chosen is None:
            token = _decoded(tokenizer, tid, None)
            content.append(
                ChatCompletionLogProbsContent(
                    token=token, bytes=list(token.encode("utf-8", errors="replace"))
                )
            )
            continue
        tops: list[ChatCompletionLogProb] = []
        for j, (t, lp) in enumerate(step.items()):
            if num_top != -1 and j >= num_top:
                break
            name = _decoded(tokenizer, t, lp)
            tops.append(
                ChatCompletionLogProb(
                    name,
                    max(lp.logprob, _LOGPROB_FLOOR),
                    list(name.encode("utf-8", errors="replace")),
                )
            )
        decoded = chosen.decoded_token
        content.append(
            ChatCompletionLogProbsContent(
                token=_decoded(tokenizer, tid, chosen),
                logprob=max(chosen.logprob, _LOGPROB_FLOOR),
                bytes=None if decoded is None else list(decoded.encode("utf-8", errors="replace")),
                top_logprobs=tops,
            )
        )
    return ChatCompletionLogProbs(content)


def prompt_logprobs_json(
    positions: Sequence[Mapping[int, Logprob] | None],
) -> PromptLogprobsJSON:
    """vLLM's ``clamp_prompt_logprobs`` (``-inf`` becomes -9999.0, nothing else changes)
    and its JSON shape: ``null`` or ``{token id: {logprob, rank, decoded_token}}``."""
    inf = float("-inf")
    return [
        None
        if pos is None
        else {
            tid: PromptLogprob(
                _LOGPROB_FLOOR if lp.logprob == inf else lp.logprob, lp.rank, lp.decoded_token
            )
            for tid, lp in pos.items()
        }
        for pos in positions
    ]


class GenerationError(Exception):
    """A completion finished with ``finish_reason="error"`` (vLLM: HTTP 500)."""


class _Choice:
    __slots__ = ("finish_reason", "logprob_steps", "num_tokens", "stop_reason", "text", "token_ids")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprob_steps: list[Mapping[int, Logprob] | None] = []
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, out: CompletionOutput, keep: bool) -> None:
        self.num_tokens += len(out.token_ids)
        if keep:
            self.text.append(out.text)
            self.token_ids.extend(out.token_ids)
            if out.logprobs:
                self.logprob_steps.extend(out.logprobs)
        self.finish_reason = out.finish_reason
        self.stop_reason = out.stop_reason


class _Responder:
    """Shared bookkeeping: choices, prompt lengths, token counts."""

    def __init__(self, plan: GenerationPlan, tokenizer: TokenizerLike, fingerprint: str | None):
        self.plan = plan
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.choices = [_Choice() for _ in range(plan.n * len(plan.prompts))]
        self.prompt_tokens = [len(p["prompt_token_ids"]) for p in plan.prompts]
        # The common chunk (text only, not the last) as prebuilt bytes around its text,
        # per choice: one string encode per token instead of building and encoding
        # three structs. None where a request's chunks carry more (logprobs, token
        # ids, continuous usage).
        self.use_templates = (
            plan.stream
            and plan.logprobs is None
            and not plan.return_token_ids
            and not plan.continuous_usage
            and plan.parsers is None
        )
        self._templates: dict[int, tuple[bytes, bytes] | None] = {}
        # One prompt, one choice, templated: `_fast` takes an output of one completion
        # that is not the last (the hot path; set by the subclasses).
        self._fast: tuple[bytes, bytes] | None = None
        # (prompt, child) -> the prompt logprobs its outputs brought (non-streaming
        # responses carry them; with n > 1 each child brings the same, the first is kept)
        self._prompt_lps: dict[tuple[int, int], list[Mapping[int, Logprob] | None]] = {}

    def on_output(self, prompt_idx: int, res: RequestOutput) -> bytes:
        raise NotImplementedError

    def _fast_event(self, out: CompletionOutput, fast: tuple[bytes, bytes]) -> bytes:
        """The templated event of the one choice's not-last output (`_fast`); what the
        subclasses' general template case sends for it."""
        choice = self.choices[0]
        if not (out.text or out.token_ids or choice.num_tokens):
            return b""
        choice.num_tokens += len(out.token_ids)
        choice.finish_reason = None
        choice.stop_reason = out.stop_reason
        return fast[0] + encode(out.text) + fast[1]

    def _keep_prompt_logprobs(self, prompt_idx: int, res: RequestOutput) -> None:
        if res.prompt_logprobs:
            child = res.outputs[0].index if res.outputs else 0
            self._prompt_lps.setdefault((prompt_idx, child), []).extend(res.prompt_logprobs)

    def _prompt_steps(self, prompt_idx: int) -> list[Mapping[int, Logprob] | None]:
        """The prompt logprobs kept for prompt ``prompt_idx`` (its first child's)."""
        keys = sorted(k for k in self._prompt_lps if k[0] == prompt_idx)
        return self._prompt_lps[keys[0]] if keys else []

    def _prompt_logprobs(self, prompt_idx: int) -> PromptLogprobsJSON | None:
        if self.plan.prompt_logprobs is None:
            return None
        return prompt_logprobs_json(self._prompt_steps(prompt_idx))

    def on_outputs(self, prompt_idx: int, outs: Sequence[RequestOutput]) -> bytes:
        """`on_output` of each output in turn: their SSE events, concatenated."""
        if len(outs) == 1:
            return self.on_output(prompt_idx, outs[0])
        return b"".join([self.on_output(prompt_idx, out) for out in outs])

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def _usage(self) -> UsageInfo:
        p, c = sum(self.prompt_tokens), self.completion_tokens
        return UsageInfo(p, p + c, c)

    def _stream_usage(self) -> StreamUsage:
        p, c = sum(self.prompt_tokens), self.completion_tokens
        return StreamUsage(p, p + c, c)


class CompletionResponder(_Responder):
    """``/v1/completions`` responses: feed `on_output`, then take `finish`."""

    def __init__(self, plan: GenerationPlan, tokenizer: TokenizerLike, fingerprint: str | None):
        super().__init__(plan, tokenizer, fingerprint)
        self._offsets = [0] * len(self.choices)
        self._echoed = [False] * len(self.choices)
        if self.use_templates and len(self.choices) == 1 and plan.echo_texts is None:
            self._fast = self._completion_template(0)

    def on_output(self, prompt_idx: int, res: RequestOutput) -> bytes:
        """Record one DELTA output; the SSE events to send for it (streaming), else b""."""
        fast = self._fast
        if fast is not None and len(res.outputs) == 1:
            # The general path's template case below, for the one choice, inlined.
            out = res.outputs[0]
            if out.finish_reason is None and out.index == 0:
                return self._fast_event(out, fast)
        plan = self.plan
        events: list[bytes] = []
        if plan.prompt_logprobs is not None and not plan.stream:
            self._keep_prompt_logprobs(prompt_idx, res)
        for out in res.outputs:
            if out.finish_reason == "error":
                raise GenerationError("Internal server error")
            i = out.index + prompt_idx * plan.n
            choice = self.choices[i]
            if not plan.stream:
                choice.add(out, True)
                continue
            if (
                self.use_templates
                and out.finish_reason is None
                and (plan.echo_texts is None or self._echoed[i])
                and (out.text or out.token_ids or choice.num_tokens)
            ):
                template = self._completion_template(i)
                if template is not None:
                    choice.add(out, False)
                    events.append(template[0] + encode(out.text) + template[1])
                    continue
            text = out.text
            token_ids: Sequence[int] = out.token_ids
            steps: Sequence[Mapping[int, Logprob] | None] | None = out.logprobs
            prompt_ids: list[int] | None = None
            if plan.echo_texts is not None and not self._echoed[i]:
                self._echoed[i] = True
                ptext = plan.echo_texts[prompt_idx]
                pids = plan.prompts[prompt_idx]["prompt_token_ids"]
                # vLLM: the echoed prompt's logprobs are the prompt logprobs this
                # output brought (its first), then the output's own
                if plan.echo_only:
                    text, token_ids = ptext, pids
                    steps = res.prompt_logprobs or []
                else:
                    text, token_ids = ptext + out.text, [*pids, *out.token_ids]
                    steps = [*(res.prompt_logprobs or []), *(out.logprobs or [])]
                prompt_ids = pids  # vLLM's echo chunk carries them, asked for or not
            elif plan.return_token_ids and not self._echoed[i]:
                self._echoed[i] = True
                prompt_ids = plan.prompts[prompt_idx]["prompt_token_ids"]
            elif not text and not token_ids and not choice.num_tokens:
                continue
            logprobs = None
            if plan.logprobs is not None:
                logprobs = completion_logprobs(
                    self.tokenizer, token_ids, steps or (), plan.logprobs, self._offsets[i]
                )
                if logprobs.tokens:
                    self._offsets[i] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            choice.add(out, False)
            chunk = CompletionStreamResponse(
                plan.request_id,
                "text_completion",
                plan.created,
                plan.model,
                [
                    CompletionStreamChoice(
                        i,
                        text,
                        logprobs,
                        out.finish_reason,
                        out.stop_reason,
                        prompt_ids,
                        list(out.token_ids) if plan.return_token_ids else None,
                    )
                ],
            )
            if out.finish_reason is not None and not plan.include_usage:
                chunk.system_fingerprint = self.fingerprint
            if plan.continuous_usage:
                p = self.prompt_tokens[prompt_idx]
                chunk.usage = StreamUsage(p, p + choice.num_tokens, choice.num_tokens)
            events.append(b"data: " + encode(chunk) + b"\n\n")
        return b"".join(events)

    def _completion_template(self, i: int) -> tuple[bytes, bytes] | None:
        try:
            return self._templates[i]
        except KeyError:
            plan = self.plan
            chunk = CompletionStreamResponse(
                plan.request_id, "text_completion", plan.created, plan.model,
                [CompletionStreamChoice(i, _MARK, None, None, None, None, None)],
            )  # fmt: skip
            template = self._templates[i] = _template(chunk)
            return template

    def finish(self) -> bytes:
        """The end of the stream (usage chunk if asked, ``[DONE]``), or the JSON body."""
        plan = self.plan
        if plan.stream:
            tail = DONE
            if plan.include_usage:
                usage = CompletionStreamResponse(
                    plan.request_id,
                    "text_completion",
                    plan.created,
                    plan.model,
                    [],
                    self._stream_usage(),
                    self.fingerprint,
                )
                tail = b"data: " + encode(usage) + b"\n\n" + DONE
            return tail
        choices: list[CompletionResponseChoice] = []
        for i, c in enumerate(self.choices):
            prompt_idx = i // plan.n
            text = "".join(c.text)
            token_ids = c.token_ids
            pids = plan.prompts[prompt_idx]["prompt_token_ids"]
            steps = c.logprob_steps
            if plan.echo_texts is not None:
                ptext = plan.echo_texts[prompt_idx]
                prompt_steps = self._prompt_steps(prompt_idx) if plan.logprobs is not None else []
                if plan.echo_only:
                    text, token_ids, steps = ptext, pids, prompt_steps
                else:
                    text, token_ids = ptext + text, [*pids, *token_ids]
                    steps = [*prompt_steps, *steps]
            logprobs = None
            if plan.logprobs is not None:
                logprobs = completion_logprobs(self.tokenizer, token_ids, steps, plan.logprobs, 0)
            choices.append(
                CompletionResponseChoice(
                    i,
                    text,
                    logprobs,
                    c.finish_reason,
                    c.stop_reason,
                    list(c.token_ids) if plan.return_token_ids else None,
                    self._prompt_logprobs(prompt_idx),
                    pids if plan.return_token_ids else None,
                )
            )
        body = CompletionResponse(
            plan.request_id,
            "text_completion",
            plan.created,
            plan.model,
            choices,
            None,
            self.fingerprint,
            self._usage(),
        )
        return encode(body)


class ChatResponder(_Responder):
    """``/v1/chat/completions`` responses: feed `on_output`, then `finish`."""

    def __init__(self, plan: GenerationPlan, tokenizer: TokenizerLike, fingerprint: str | None):
        super().__init__(plan, tokenizer, fingerprint)
        self._first = True
        self._finished = [False] * plan.n
        if self.use_templates and plan.n == 1:
            self._fast = self._chat_template(0)

    def _chunk(self, choice: ChatCompletionStreamChoice) -> ChatCompletionStreamResponse:
        plan = self.plan
        return ChatCompletionStreamResponse(
            plan.request_id, "chat.completion.chunk", plan.created, plan.model, [choice]
        )

    def on_output(self, prompt_idx: int, res: RequestOutput) -> bytes:
        fast = self._fast
        if fast is not None and not self._first and len(res.outputs) == 1:
            # The general path's template case below, for the one choice, inlined.
            out = res.outputs[0]
            if out.finish_reason is None and out.index == 0 and not self._finished[0]:
                return self._fast_event(out, fast)
        plan = self.plan
        events: list[bytes] = []
        if plan.prompt_logprobs is not None and not plan.stream:
            self._keep_prompt_logprobs(prompt_idx, res)
        if plan.stream and self._first:
            self._first = False
            for i in range(plan.n):
                chunk = self._chunk(
                    ChatCompletionStreamChoice(i, ChatDelta(plan.role, ""), None, None)
                )
                chunk.prompt_token_ids = (
                    plan.prompts[0]["prompt_token_ids"] if plan.return_token_ids else None
                )
                chunk.prompt_text = None
                if plan.continuous_usage:
                    p = self.prompt_tokens[0]
                    chunk.usage = StreamUsage(p, p, 0)
                events.append(b"data: " + encode(chunk) + b"\n\n")
            if plan.echo_texts and plan.echo_texts[0]:
                for i in range(plan.n):
                    chunk = self._chunk(
                        ChatCompletionStreamChoice(
                            i, ChatDelta(content=plan.echo_texts[0]), None, None
                        )
                    )
                    if plan.continuous_usage:
                        p = self.prompt_tokens[0]
                        chunk.usage = StreamUsage(p, p, 0)
                    events.append(b"data: " + encode(chunk) + b"\n\n")
        for out in res.outputs:
            i = out.index
            if plan.stream and self._finished[i]:
                continue
            if out.finish_reason == "error":
                raise GenerationError("Internal server error")
            choice = self.choices[i]
            if not plan.stream:
                choice.add(out, True)
                continue
            if (
                self.use_templates
                and out.finish_reason is None
                and (out.text or out.token_ids or choice.num_tokens)
            ):
                template = self._chat_template(i)
                if template is not None:
                    choice.add(out, False)
                    events.append(template[0] + encode(out.text) + template[1])
                    continue
            logprobs = None
            if plan.logprobs is not None:
                logprobs = chat_logprobs(
                    self.tokenizer, out.token_ids, out.logprobs or (), plan.logprobs
                )
            if not out.text and not out.token_ids and not choice.num_tokens:
                continue
            choice.add(out, False)
            token_ids = list(out.token_ids) if plan.return_token_ids else None
            finish_reason = out.finish_reason
            if plan.parsers is None:
                delta = ChatDelta(content=out.text)
            else:
                message = plan.parsers.delta(
                    i,
                    out.text,
                    list(out.token_ids),
                    plan.prompts[0]["prompt_token_ids"],
                    out.finish_reason is not None,
                )
                if message is None:
                    # vLLM: nothing to send yet, unless the chunk carries more.
                    if finish_reason is None and logprobs is None and token_ids is None:
                        continue
                    delta = ChatDelta()
                else:
                    delta = ChatDelta(**delta_fields(message))
                if finish_reason is not None:
                    finish_reason = plan.parsers.finish_reason(i, finish_reason)
            if finish_reason is None:
                stream_choice = ChatCompletionStreamChoice(
                    i, delta, logprobs, None, token_ids=token_ids
                )
            else:
                self._finished[i] = True
                stream_choice = ChatCompletionStreamChoice(
                    i, delta, logprobs, finish_reason, out.stop_reason, token_ids
                )
            chunk = self._chunk(stream_choice)
            if out.finish_reason is not None and not plan.include_usage:
                chunk.system_fingerprint = self.fingerprint
            if plan.continuous_usage:
                p = self.prompt_tokens[0]
                chunk.usage = StreamUsage(p, p + choice.num_tokens, choice.num_tokens)
            events.append(b"data: " + encode(chunk) + b"\n\n")
        return b"".join(events)

    def _chat_template(self, i: int) -> tuple[bytes, bytes] | None:
        try:
            return self._templates[i]
        except KeyError:
            # As the general path builds a text chunk without token ids.
            chunk = self._chunk(
                ChatCompletionStreamChoice(i, ChatDelta(content=_MARK), None, None,
                                           token_ids=None)
            )  # fmt: skip
            template = self._templates[i] = _template(chunk)
            return template

    def finish(self) -> bytes:
        plan = self.plan
        if plan.stream:
            if not plan.include_usage:
                return DONE
            usage = ChatCompletionStreamResponse(
                plan.request_id,
                "chat.completion.chunk",
                plan.created,
                plan.model,
                [],
                self._stream_usage(),
                self.fingerprint,
            )
            return b"data: " + encode(usage) + b"\n\n" + DONE
        choices: list[ChatCompletionResponseChoice] = []
        echo = plan.echo_texts[0] if plan.echo_texts else ""
        for i, c in enumerate(self.choices):
            logprobs = None
            if plan.logprobs is not None:
                logprobs = chat_logprobs(
                    self.tokenizer, c.token_ids, c.logprob_steps, plan.logprobs
                )
            text = "".join(c.text)
            if plan.parsers is None:
                message = ChatResponseMessage(plan.role, echo + text)
                finish_reason = c.finish_reason or "stop"
            else:
                reasoning, content, tool_calls, finish_reason = plan.parsers.message(
                    i, text, c.finish_reason
                )
                message = ChatResponseMessage(
                    plan.role, content, tool_calls=tool_calls or UNSET, reasoning=reasoning
                )
            choices.append(
                ChatCompletionResponseChoice(
                    i,
                    message,
                    logprobs,
                    finish_reason,
                    c.stop_reason,
                    list(c.token_ids) if plan.return_token_ids else None,
                )
            )
        body = ChatCompletionResponse(
            plan.request_id,
            "chat.completion",
            plan.created,
            plan.model,
            choices,
            None,
            self.fingerprint,
            self._usage(),
            self._prompt_logprobs(0),
            plan.prompts[0]["prompt_token_ids"] if plan.return_token_ids else None,
        )
        return encode(body)
