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
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from .._exceptions import InvalidRequestError
from ..protocol import EngineCoreRequest, SamplingParams
from ..protocol.rules import (
    DEFAULTED_MAX_TOKENS,
    PROMPT,
    PROMPT_TEXT,
    SAMPLING,
    SAMPLING_LIMITS,
    SAMPLING_WIRE,
    Limits,
    PromptInput,
    PromptText,
)
from ..protocol.structured import resolve_structured_outputs
from ._chat import render_chat_template
from ._defaults import SamplingDefaults
from ._output import OutputProcessor, ParentRequest

if TYPE_CHECKING:
    from ..protocol import LoRARequest
    from ._tokenizer import ModelFiles, Tokenizer
    from ._types import ChatMessage, Prompt

__all__ = [
    "DEFAULT_MAX_LOGPROBS",
    "InputProcessor",
    "ProcessedRequest",
    "random_hex",
    "random_uuid",
]


#: vLLM's default ``--max-logprobs``.
DEFAULT_MAX_LOGPROBS: Final = 20
_RANDOM_CHUNK: Final = 4096


class _RandomBytes:
    """``os.urandom`` bytes, taken 4 KiB at a time: one system call per few hundred
    request ids instead of one (in ``uuid.uuid4``) per id. A forked child starts
    afresh, so that parent and child never hand out the same bytes. Locked: frontends
    in several threads (SyncLLM) must not take the same bytes either."""

    __slots__ = ("buf", "lock", "pos")

    def __init__(self) -> None:
        self.buf = b""
        self.pos = 0
        self.lock = threading.Lock()

    def reset(self) -> None:
        self.buf = b""
        self.pos = 0
        self.lock = threading.Lock()  # a forked child's copy may be held by a dead thread

    def hex(self, nbytes: int) -> str:
        with self.lock:
            pos = self.pos
            end = pos + nbytes
            if end > len(self.buf):
                self.buf = os.urandom(max(_RANDOM_CHUNK, nbytes))
                pos, end = 0, nbytes
            self.pos = end
            return self.buf[pos:end].hex()


_RANDOM = _RandomBytes()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_RANDOM.reset)


def random_hex(nbytes: int) -> str:
    """``2 * nbytes`` random hex digits (``os.urandom``'s, as ``uuid.uuid4``'s are)."""
    return _RANDOM.hex(nbytes)


def random_uuid() -> str:
    """vLLM's ``random_uuid``: 16 random hex characters."""
    return _RANDOM.hex(8)


def internal_request_id(external_req_id: str) -> str:
    """vLLM's ``assign_request_id``: ``"<external id>-<8 random hex chars>"``."""
    return f"{external_req_id}-{_RANDOM.hex(4)}"


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
        structured_outputs_backend: str = "auto",
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
        # What the request rules know of this model (trio_vllm.protocol.rules).
        self.limits = Limits(
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            max_token_id=self._max_token_id(),
            max_logprobs=max_logprobs,
            structured_output_backend=structured_outputs_backend,
        )
        # vLLM's --structured-outputs-config.backend: "auto" picks per request.
        self.structured_outputs_backend = structured_outputs_backend

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

    def tokenize_prompt(
        self, prompt: Prompt, *, generate: bool = True
    ) -> tuple[str | None, list[int]]:
        """``(prompt text or None, prompt token ids)`` for a prompt, validated.

        Text is encoded with the tokenizer's special tokens (BOS), as vLLM's completion
        renderer does; token ids are taken as they are. ``generate=False``: a pooling
        prompt, which may fill the whole context.
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
        self.validate_prompt_ids(ids, from_text=encoded, generate=generate)
        return text, ids

    def _encode_prompt_text(self, text: str) -> list[int]:
        tokenizer = self._require_tokenizer("a text prompt")
        PROMPT_TEXT.raise_for(PromptText(text, tokenizer.max_chars_per_token), self.limits)
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

    def validate_prompt_ids(
        self, ids: Sequence[int], *, from_text: bool = False, generate: bool = True
    ) -> None:
        """vLLM's prompt checks: not empty, shorter than ``max_model_len`` (room for one
        token; ``generate=False``: at most ``max_model_len``), every id inside the
        vocabulary. ``from_text``: the ids are a text prompt's (vLLM tokenizes those to
        at most ``max_model_len + 1`` tokens, and says so)."""
        PROMPT.raise_for(PromptInput(ids, len(ids), from_text, generate), self.limits)

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
        tokenized (``update_from_tokenizer``); ``structured_outputs`` gets its backend
        and its grammar checked (`resolve_structured_outputs`).
        """
        limits = self.limits
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
            for rule in DEFAULTED_MAX_TOKENS:
                violation = rule(p, limits)
                if violation is not None:
                    raise violation.error()
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        _update_from_generation_config(p, self.generation_config, eos)
        if self.tokenizer is not None and p.bad_words:
            _update_bad_words(p, self.tokenizer)
        if p.structured_outputs is not None:
            # vLLM's backend choice and grammar check (a new struct: the caller's, which
            # a shallow copy shares, stays as it was).
            p.structured_outputs = resolve_structured_outputs(
                p.structured_outputs, self.structured_outputs_backend
            )
        SAMPLING_WIRE.raise_for(p, limits)
        return p

    def _verify(self, p: SamplingParams) -> None:
        """vLLM's checks of a ``SamplingParams``: made (``_verify_args``), then against
        the model (``verify``); `InvalidRequestError` with vLLM's message."""
        violation = SAMPLING.check(p) or SAMPLING_LIMITS.check(p, self.limits)
        if violation is not None:
            raise violation.error()

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
                        "bad_words entries must tokenize to at least one token. "
                        f"(parameter=bad_words, value={p.bad_words})",
                        param="bad_words",
                        field="bad_words",
                    )
                continue
            if not add_prefix_space or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    top = tokenizer.max_token_id
    bad = [t for ids in out for t in ids if t < 0 or t > top]
    if bad:
        raise InvalidRequestError(
            f"The model vocabulary size is {top + 1}, but the following tokens were "
            f"specified as bad: {bad}. All token id values should be integers satisfying: "
            f"0 <= token_id <= {top}. (parameter=bad_words, value={p.bad_words})",
            param="bad_words",
            field="bad_words",
        )
    p._bad_words_token_ids = out
