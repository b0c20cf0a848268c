"""Prompts and sampling params to engine requests, as vLLM 0.32.0's ``InputProcessor`` and
``AsyncLLM.add_request`` do (tokenize, validate, fill the frontend duties, fan out ``n``).

`InputProcessor.process_inputs` returns a `ProcessedRequest`: the
``EngineCoreRequest`` s to send (one, or ``n`` children) and what the output processor
needs to track them. Nothing is sent and nothing is registered: register with
`ProcessedRequest.register` and send in one step that cannot be cancelled between
the two (the async frontend's job). Every refusal is an
`InvalidRequestError` raised before anything exists.
"""

from __future__ import annotations

import copy
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from .._exceptions import InvalidRequestError
from ..protocol import EngineCoreRequest, SamplingParams
from ..protocol.validation import validate_sampling_params
from ._chat import render_chat_template
from ._defaults import SamplingDefaults
from ._output import OutputProcessor, ParentRequest

if TYPE_CHECKING:
    from ..protocol import LoRARequest
    from ._tokenizer import ModelFiles, Tokenizer
    from ._types import ChatMessage, Prompt

__all__ = ["DEFAULT_MAX_LOGPROBS", "InputProcessor", "ProcessedRequest", "random_uuid"]

# Appended to vLLM's text for a prompt of exactly max_model_len tokens, so every too-long
# refusal names the context length (the contract servers rely on).
_CONTEXT_SUFFIX: Final = " This model's maximum context length is {} tokens."

#: vLLM's default ``--max-logprobs``.
DEFAULT_MAX_LOGPROBS: Final = 20
_MASK_64: Final = (1 << 64) - 1


def random_uuid() -> str:
    """vLLM's ``random_uuid``: 16 random hex characters."""
    return f"{uuid.uuid4().int & _MASK_64:016x}"


def internal_request_id(external_req_id: str) -> str:
    """vLLM's ``assign_request_id``: ``"<external id>-<8 random hex chars>"``."""
    return f"{external_req_id}-{random_uuid()[:8]}"


@dataclass
class ProcessedRequest:
    """One caller request ready to send: ``requests`` go to the engine in order.

    ``request_id`` is the internal id (a parent's when ``n > 1``, never sent itself);
    ``external_req_id`` the caller's. ``requests[i]`` is the ``i``-th child for ``n > 1``.
    """

    request_id: str
    external_req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    requests: list[EngineCoreRequest]
    parent: ParentRequest | None

    @property
    def engine_request_ids(self) -> list[str]:
        """The ids the engine knows (what to ABORT when the caller goes away)."""
        return [r.request_id for r in self.requests]

    def register(self, output_processor: OutputProcessor) -> None:
        """Track every engine request of this one in ``output_processor``
        (all or nothing: an id clash leaves the processor unchanged)."""
        clash = [r.request_id for r in self.requests if output_processor.has_request(r.request_id)]
        if clash:
            raise ValueError(f"request ids {clash} are already being processed")
        for index, request in enumerate(self.requests):
            output_processor.add_request(request, self.prompt, self.parent, index)


class InputProcessor:
    """Prompt processing and validation for one model (vLLM's ``InputProcessor``).

    ``max_model_len`` comes from the engines' ready response. ``generation_config`` is the
    model's generation config (its ``eos_token_id`` ids join the stop ids);
    ``sampling_defaults`` are used when a request gives no params (vLLM's
    ``get_default_sampling_params``). Methods never do I/O.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        *,
        max_model_len: int,
        vocab_size: int | None = None,
        generation_config: Mapping[str, object] | None = None,
        sampling_defaults: Mapping[str, float | int] | None = None,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        if vocab_size is None and tokenizer is not None:
            vocab_size = tokenizer.max_token_id + 1
        self.vocab_size = vocab_size
        self.generation_config: dict[str, Any] = dict(generation_config or {})
        self.sampling_defaults: SamplingDefaults = (
            sampling_defaults
            if isinstance(sampling_defaults, SamplingDefaults)
            else SamplingDefaults(sampling_defaults)
        )
        self.max_logprobs = max_logprobs

    @classmethod
    def from_model_files(
        cls,
        files: ModelFiles,
        tokenizer: Tokenizer | None,
        *,
        max_model_len: int,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
    ) -> InputProcessor:
        """An input processor for a model directory (vocabulary from ``config.json``)."""
        return cls(
            tokenizer,
            max_model_len=max_model_len,
            vocab_size=files.vocab_size,
            generation_config=files.generation_config,
            sampling_defaults=files.sampling_defaults(),
            max_logprobs=max_logprobs,
        )

    # -- prompts ---------------------------------------------------------------------------

    def _require_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise InvalidRequestError(f"{what} needs a tokenizer; this model has none loaded")
        return self.tokenizer

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """``(prompt text or None, prompt token ids)`` for a prompt, validated.

        Text is encoded with the tokenizer's special tokens (BOS), as vLLM's completion
        renderer does; token ids are taken as they are.
        """
        text: str | None
        given: object = prompt  # callers from JSON may pass anything
        encoded = False
        if isinstance(given, str):
            text, encoded = given, True
            ids = self._encode_prompt_text(given)
        elif isinstance(given, Mapping):
            if "prompt_token_ids" in given:
                ids = _as_token_ids(given["prompt_token_ids"])
                value = given.get("prompt")
                text = value if isinstance(value, str) else None
            elif isinstance(given.get("prompt"), str):
                text, encoded = str(given["prompt"]), True
                ids = self._encode_prompt_text(text)
            else:
                raise InvalidRequestError(
                    "a prompt dict needs 'prompt' (text) or 'prompt_token_ids'"
                )
        elif isinstance(given, Sequence) and not isinstance(given, (bytes, bytearray)):
            text, ids = None, _as_token_ids(given)
        else:
            raise InvalidRequestError(
                f"a prompt must be text, a list of token ids or a prompt dict, "
                f"not {type(prompt).__name__}"
            )
        self.validate_prompt_ids(ids, from_text=encoded)
        return text, ids

    def _encode_prompt_text(self, text: str) -> list[int]:
        tokenizer = self._require_tokenizer("a text prompt")
        # vLLM refuses, before tokenizing, a text longer than max_model_len tokens of the
        # longest vocabulary piece could be.
        max_chars = self.max_model_len * tokenizer.max_chars_per_token
        if len(text) > max_chars:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your prompt contains {len(text)} characters (more than "
                f"{max_chars} characters, which is the upper bound for {self.max_model_len} "
                f"input tokens). Please reduce the length of the input prompt."
            )
        return tokenizer.encode(text, add_special_tokens=True)

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> tuple[str, list[int]]:
        """``(prompt text, token ids)`` of a conversation (see ``render_chat_template``);
        the text is encoded without adding special tokens, as vLLM's chat path does."""
        tokenizer = self._require_tokenizer("chat")
        text = render_chat_template(
            messages,
            tokenizer=tokenizer,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
        self.validate_prompt_ids(ids)
        return text, ids

    def validate_prompt_ids(self, ids: Sequence[int], *, from_text: bool = False) -> None:
        """vLLM's prompt checks: not empty, shorter than ``max_model_len`` (room for one
        token), every id inside the vocabulary. ``from_text``: the ids are a text prompt's
        (vLLM tokenizes those to at most ``max_model_len + 1`` tokens, and says so)."""
        n = len(ids)
        max_len = self.max_model_len
        if n == 0:
            raise InvalidRequestError("The decoder prompt cannot be empty")
        if n > max_len:
            count = f"at least {max_len + 1}" if from_text else str(n)
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, your "
                f"prompt contains {count} input tokens, which exceeds this limit even "
                f"without any output tokens. Please reduce the length of the input prompt."
            )
        if n == max_len:
            raise InvalidRequestError(
                f"The decoder prompt (length {n}) plus the number of requested output tokens "
                f"(at least 1) is longer than the maximum model length of {max_len}. Make "
                f"sure that `max_model_len` is no smaller than the number of text tokens "
                f"(prompt + requested output tokens).{_CONTEXT_SUFFIX.format(max_len)}"
            )
        lo, hi = min(ids), max(ids)
        if lo < 0:
            raise InvalidRequestError(f"Token id {lo} is out of vocabulary")
        limit = self._max_token_id()
        if limit is not None and hi > limit:
            raise InvalidRequestError(f"Token id {hi} is out of vocabulary")

    def _max_token_id(self) -> int | None:
        # vLLM: an id is in vocabulary below max(tokenizer.max_token_id, vocab_size - 1).
        limits = [self.vocab_size - 1] if self.vocab_size is not None else []
        if self.tokenizer is not None:
            limits.append(self.tokenizer.max_token_id)
        return max(limits) if limits else None

    # -- sampling params --------------------------------------------------------------------

    def prepare_params(self, params: SamplingParams | None, prompt_len: int) -> SamplingParams:
        """A validated copy of ``params`` with vLLM's frontend duties done.

        ``None`` means the model's defaults. With ``skip_clone`` (as vLLM's OpenAI server
        sets it) the copy is shallow: containers the caller changes later are shared,
        but nothing here changes the caller's. ``max_tokens=None`` becomes
        ``max_model_len - prompt_len``; the tokenizer's EOS becomes ``_eos_token_id``
        (unless ``ignore_eos``) and joins ``_all_stop_token_ids``; the generation config's
        other EOS ids join ``_all_stop_token_ids`` and (unless ``ignore_eos``)
        ``stop_token_ids`` (vLLM's ``update_from_generation_config``); ``bad_words`` are
        tokenized (``update_from_tokenizer``).
        """
        if params is None:
            p = self.sampling_defaults.sampling_params()  # fresh: nobody else holds it
            self._verify(p)
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"params must be a SamplingParams, not {type(params).__name__}"
            )
        else:
            self._verify(params)
            if params.skip_clone:
                # vLLM's clone() with skip_clone: shallow (a deep copy was most of this
                # method's time); the set updated below in place is the copy's own.
                p = copy.copy(params)
                p._all_stop_token_ids = set(params._all_stop_token_ids)
            else:
                p = copy.deepcopy(params)
        if p.max_tokens is None:
            p.max_tokens = self.max_model_len - prompt_len
            if p.min_tokens > p.max_tokens:
                raise InvalidRequestError(
                    f"min_tokens must be less than or equal to max_tokens={p.max_tokens}, "
                    f"got {p.min_tokens}."
                )
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        _update_from_generation_config(p, self.generation_config, eos)
        if self.tokenizer is not None and p.bad_words:
            _update_bad_words(p, self.tokenizer)
        try:
            validate_sampling_params(p, max_logprobs=self.max_logprobs, vocab_size=self.vocab_size)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        return p

    def _verify(self, p: SamplingParams) -> None:
        """The checks vLLM's ``SamplingParams`` runs, with vLLM's messages."""
        n: object = p.n
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"n must be at least 1, got {p.n}.")
        if p.greedy and p.n > 1:
            raise InvalidRequestError(f"n must be 1 when using greedy sampling, got {p.n}.")
        if not math.isfinite(p.temperature) or not 0.0 <= p.temperature <= 2.0:
            raise InvalidRequestError(f"temperature must be in [0, 2], got {p.temperature}.")
        if not 0.0 < p.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {p.top_p}.")
        if p.max_tokens is not None and p.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {p.max_tokens}.")
        if p.min_tokens < 0:
            raise InvalidRequestError(
                f"min_tokens must be greater than or equal to 0, got {p.min_tokens}."
            )
        if p.max_tokens is not None and p.min_tokens > p.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be less than or equal to max_tokens={p.max_tokens}, "
                f"got {p.min_tokens}."
            )
        if any(not s for s in p.stop or ()):
            raise InvalidRequestError("stop cannot contain an empty string.")
        if p.stop and not p.detokenize:
            raise InvalidRequestError(
                "stop strings are only supported when detokenize is True. "
                "Set detokenize=True to use stop."
            )
        vocab = self.vocab_size
        max_logprobs = vocab if self.max_logprobs == -1 and vocab else self.max_logprobs
        for name, value in (("sample", p.logprobs), ("prompt", p.prompt_logprobs)):
            if value is None:
                continue
            if value < -1:
                raise InvalidRequestError(
                    f"{'logprobs' if name == 'sample' else 'prompt_logprobs'} must be "
                    f"non-negative or -1, got {value}."
                )
            requested = vocab if value == -1 and vocab is not None else value
            if requested > max_logprobs:
                raise InvalidRequestError(
                    f"Requested {name} logprobs of {requested}, which is greater than max "
                    f"allowed: {max_logprobs}"
                )
        if p.stop_token_ids and vocab is not None:
            bad = [t for t in p.stop_token_ids if t < 0 or t >= vocab]
            if bad:
                raise InvalidRequestError(
                    f"token_id(s) {bad} in stop_token_ids contain out-of-vocab token ids. "
                    f"Vocabulary size: {vocab}"
                )

    # -- requests ---------------------------------------------------------------------------

    def process_inputs(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        prompt_text: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        cache_salt: str | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> ProcessedRequest:
        """The engine requests for one caller request (ids as vLLM assigns them).

        The engine request id is ``"<request_id>-<8 hex chars>"`` (``external_req_id`` is
        ``request_id``); for ``n > 1`` the children are ``"<i>_<that id>"`` with
        ``seed + i``. ``prompt_text`` overrides the text reported in outputs.
        """
        _check_request_id(request_id)
        text, ids = self.tokenize_prompt(prompt)
        return self._build(
            request_id,
            text if prompt_text is None else prompt_text,
            ids,
            params,
            arrival_time=arrival_time,
            lora_request=lora_request,
            priority=priority,
            data_parallel_rank=data_parallel_rank,
            cache_salt=cache_salt,
            trace_headers=trace_headers,
        )

    def process_chat(
        self,
        request_id: str,
        messages: Sequence[ChatMessage],
        params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
        tools: Sequence[Mapping[str, object]] | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        cache_salt: str | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> ProcessedRequest:
        """`process_inputs` for a conversation rendered with the chat template."""
        _check_request_id(request_id)
        text, ids = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )
        return self._build(
            request_id,
            text,
            ids,
            params,
            arrival_time=arrival_time,
            lora_request=lora_request,
            priority=priority,
            data_parallel_rank=data_parallel_rank,
            cache_salt=cache_salt,
            trace_headers=trace_headers,
        )

    def _build(
        self,
        external_id: str,
        text: str | None,
        ids: list[int],
        params: SamplingParams | None,
        *,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        cache_salt: str | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> ProcessedRequest:
        sp = self.prepare_params(params, len(ids))
        internal_id = internal_request_id(external_id)
        base = EngineCoreRequest(
            internal_id,
            prompt_token_ids=ids,
            sampling_params=sp,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            lora_request=lora_request,
            cache_salt=cache_salt,
            data_parallel_rank=data_parallel_rank,
            priority=priority,
            trace_headers=dict(trace_headers) if trace_headers is not None else None,
            external_req_id=external_id,
        )
        if sp.n == 1:
            return ProcessedRequest(internal_id, external_id, text, ids, sp, [base], None)
        parent = ParentRequest(internal_id, external_id, sp)
        children: list[EngineCoreRequest] = []
        for index in range(sp.n):
            child_id, child_params = parent.get_child_info(index)
            children.append(_replace(base, request_id=child_id, sampling_params=child_params))
        return ProcessedRequest(internal_id, external_id, text, ids, sp, children, parent)


def _check_request_id(request_id: object) -> None:
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError("request_id must be a non-empty string")


def _replace(request: EngineCoreRequest, **changes: Any) -> EngineCoreRequest:
    import msgspec

    return msgspec.structs.replace(request, **changes)


def _as_token_ids(raw: object) -> list[int]:
    if isinstance(raw, (str, bytes, bytearray)) or not isinstance(raw, Sequence):
        raise InvalidRequestError("prompt_token_ids must be a list of ints")
    ids: list[int] = []
    for value in raw:
        if isinstance(value, bool) or not isinstance(value, int):
            # numpy integers are fine; floats and strings are not.
            index = getattr(value, "__index__", None)
            if index is None or isinstance(value, bool):
                raise InvalidRequestError(
                    f"prompt_token_ids must hold ints only, got {type(value).__name__}"
                )
            value = index()
        ids.append(int(value))
    return ids


def _update_from_generation_config(
    p: SamplingParams, generation_config: Mapping[str, object], eos_token_id: int | None
) -> None:
    # vLLM's SamplingParams.update_from_generation_config, set operations and all (the
    # order of the resulting stop_token_ids list is the set's, as in vLLM).
    if not p.ignore_eos:
        p._eos_token_id = eos_token_id
    if eos_token_id is not None:
        p._all_stop_token_ids.add(eos_token_id)
    eos_ids = generation_config.get("eos_token_id")
    if isinstance(eos_ids, int):
        eos_set = {eos_ids}
    elif isinstance(eos_ids, (list, tuple, set)):
        eos_set = {int(i) for i in eos_ids}
    else:
        return
    if eos_token_id is not None:
        eos_set.discard(eos_token_id)
    if eos_set:
        p._all_stop_token_ids.update(eos_set)
        if not p.ignore_eos:
            eos_set.update(p.stop_token_ids or ())
            p.stop_token_ids = list(eos_set)


def _update_bad_words(p: SamplingParams, tokenizer: Tokenizer) -> None:
    # vLLM's SamplingParams.update_from_tokenizer.
    out: list[list[int]] = []
    for bad_word in p.bad_words or ():
        for add_prefix_space in (False, True):
            prompt = (" " if add_prefix_space else "") + bad_word.lstrip()
            ids = tokenizer.encode(prompt, add_special_tokens=False)
            if not ids:
                if not add_prefix_space:
                    raise InvalidRequestError(
                        "bad_words entries must tokenize to at least one token."
                    )
                continue
            if not add_prefix_space or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    bad = [t for ids in out for t in ids if t < 0 or t > tokenizer.max_token_id]
    if bad:
        raise InvalidRequestError(f"token ids {bad} of bad_words are out of vocabulary")
    p._bad_words_token_ids = out
