"""From a decoded EngineCoreRequest to the scheduler's `EngineRequest`.

vLLM's contained pre-processing errors become `ValueError` (the request finishes with
ERROR, the engine lives on); ``--oov-fatal`` makes an out-of-vocabulary id fatal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._errors import FatalEngineError, UtilityError
from ._model import Sequence
from ._sampler import SamplingState
from ._scheduler import EngineRequest, PoolingSpec

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._model import Model
    from ._options import EngineOptions
    from ._wire import Wire

__all__ = ["check_vocabulary", "preprocess"]


def check_vocabulary(req: Any, vocab: int) -> None:
    """``--oov-fatal``: die of an out-of-vocabulary id as a stock engine core does
    (its embedding lookup or sampler mask indexes out of range)."""
    sp = req.sampling_params
    fields: list[tuple[str, Any]] = [("prompt_token_ids", req.prompt_token_ids or [])]
    if sp is not None:
        fields += [
            ("allowed_token_ids", sp.allowed_token_ids or []),
            ("logit_bias", list(sp.logit_bias or {})),
            ("stop_token_ids", sp.stop_token_ids or []),
        ]
    for name, ids in fields:
        for token in ids:
            if isinstance(token, int) and not 0 <= token < vocab:
                raise FatalEngineError(
                    f"request {req.request_id!r}: token id {token} in {name} is out of "
                    f"the vocabulary [0, {vocab}) (--oov-fatal)"
                )


def preprocess(
    req: Any,
    opts: EngineOptions,
    model: Model,
    wire: Wire,
    load_lora: Callable[[Any], None],
) -> EngineRequest:
    """The scheduler's request for ``req``; `ValueError` with vLLM's text when refused.
    ``load_lora`` loads the request's adapter (it may raise `UtilityError`)."""
    sp, pp = req.sampling_params, req.pooling_params
    if (sp is None) == (pp is None):
        raise ValueError("exactly one of sampling_params and pooling_params must be set")
    if req.mm_features:
        raise ValueError("multimodal inputs are not supported by this model")
    if req.resumable:
        raise ValueError("streaming-input (resumable) requests are not supported")
    if sp is not None:
        unsupported = {
            "structured_outputs": sp.structured_outputs is not None,
            "logprob_token_ids": sp.logprob_token_ids is not None,
            "prompt_logprob_token_ids": sp.prompt_logprob_token_ids is not None,
            "thinking_token_budget": sp.thinking_token_budget is not None,
            "repetition_detection": sp.repetition_detection is not None
            and sp.repetition_detection.max_pattern_size > 0,
        }
        for name, used in unsupported.items():
            if used:
                raise ValueError(f"{name} is not supported by this engine")
    if req.client_index < 0:
        raise ValueError(f"invalid client_index {req.client_index}")
    embeds = mask = None
    ids = req.prompt_token_ids
    if req.prompt_embeds is not None:
        embeds = wire.to_numpy(req.prompt_embeds).astype(np.float32)
        if embeds.ndim != 2 or embeds.shape[0] == 0:
            raise ValueError(f"prompt_embeds must be [num_tokens, hidden], got {embeds.shape}")
        if opts.model == "tiny" and embeds.shape[1] != model.hidden_size:
            raise ValueError(f"prompt_embeds hidden size {embeds.shape[1]} != {model.hidden_size}")
        n = embeds.shape[0]
        if req.prompt_is_token_ids is not None:
            if len(req.prompt_is_token_ids) != n or ids is None or len(ids) != n:
                raise ValueError("prompt_is_token_ids/prompt_token_ids length mismatch")
            mask = ~np.asarray(req.prompt_is_token_ids, dtype=bool)
            ids = [int(t) if not m else 0 for t, m in zip(ids, mask, strict=True)]
        else:
            mask = np.ones(n, dtype=bool)
            ids = [0] * n
    if not ids:
        raise ValueError("the prompt is empty")
    vocab = model.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise ValueError(f"token id out of vocabulary [0, {vocab})")
    limit = opts.max_model_len if pp is not None else opts.max_model_len - 1
    if len(ids) > limit:
        raise ValueError(
            f"prompt of {len(ids)} tokens is too long for max_model_len {opts.max_model_len}"
        )
    lora_name = None
    if req.lora_request is not None:
        if opts.max_loras <= 0:
            raise ValueError("LoRA request on an engine without LoRA support")
        try:
            load_lora(req.lora_request)
        except UtilityError as exc:
            raise ValueError(str(exc)) from exc
        lora_name = req.lora_request.lora_name
    seq = Sequence(list(ids), len(ids), embeds, mask, model.vocab_size)
    common: dict[str, Any] = {
        "request_id": req.request_id,
        "client_index": req.client_index,
        "seq": seq,
        "lora_name": lora_name,
        "cache_salt": req.cache_salt,
        "trace_headers": req.trace_headers,
        "arrival_time": req.arrival_time,
    }
    if pp is not None:
        return EngineRequest(
            **common,
            pooling=PoolingSpec(pp.task, pp.use_activation, pp.dimensions),
            skip_reading_prefix_cache=bool(pp.skip_reading_prefix_cache),
        )
    if sp.max_tokens is None:
        raise ValueError("max_tokens must not be None")
    if sp.n != 1:
        raise ValueError("n > 1 is fanned out by the frontend; send n=1")
    all_stop = set(sp._all_stop_token_ids) | set(sp.stop_token_ids or ())
    state = SamplingState(
        temperature=sp.temperature,
        top_k=sp.top_k if sp.top_k and sp.top_k > 0 else 0,
        top_p=sp.top_p,
        min_p=sp.min_p,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        logit_bias={int(k): float(v) for k, v in sp.logit_bias.items()} if sp.logit_bias else None,
        allowed_token_ids=sp.allowed_token_ids,
        bad_words_token_ids=sp._bad_words_token_ids,
        min_tokens=sp.min_tokens,
        min_tokens_stop_ids=sorted(all_stop),
        logprobs=sp.logprobs,
        rng=np.random.default_rng(sp.seed) if sp.seed is not None else None,
    )
    return EngineRequest(
        **common,
        sampling=state,
        max_tokens=sp.max_tokens,
        min_tokens=sp.min_tokens,
        eos_token_id=sp._eos_token_id,
        ignore_eos=sp.ignore_eos,
        stop_token_ids=frozenset(sp.stop_token_ids or ()),
        prompt_logprobs=sp.prompt_logprobs,
        skip_reading_prefix_cache=bool(sp.skip_reading_prefix_cache),
    )
