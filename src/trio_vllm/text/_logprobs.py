"""Sample and prompt logprobs with decoded tokens, as vLLM 0.32.0's ``v1/engine/logprobs.py``.

The engine sends, per new token, the sampled token's id, logprob and rank followed by the
top-k (``LogprobsLists``: one row per token); prompt logprobs come as tensors, one row per
prompt position after the first. This turns them into ``list[dict[int, Logprob]]`` with
each token decoded on its own (``Tokenizer.decode_tokens_individually``) and a decoded
token that ends in U+FFFD (half a UTF-8 character) corrected from the preceding sampled
tokens, exactly as vLLM does. The cumulative logprob sums the sampled tokens' logprobs.

vLLM's ``flat_logprobs`` container is not reproduced: the lists hold the same values.
"""

from __future__ import annotations

from itertools import chain, repeat
from typing import TYPE_CHECKING, Any

from ._types import Logprob, PromptLogprobs, SampleLogprobs

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from ..protocol import EngineCoreOutput, LogprobsLists, LogprobsTensors, SamplingParams
    from ._tokenizer import Tokenizer

__all__ = ["LogprobsProcessor"]

_REPLACEMENT = "\ufffd"


def _tolist(value: Any) -> Any:
    """Python lists of a numpy array, torch tensor or RawTensor."""
    to_numpy = getattr(value, "to_numpy", None)
    if to_numpy is not None:  # RawTensor
        value = to_numpy()
    return value.tolist()


class LogprobsProcessor:
    """Logprobs state of one completion. ``logprobs``/``prompt_logprobs`` are ``None``
    unless requested; ``cumulative_logprob`` is ``None`` unless sample logprobs are."""

    def __init__(self, tokenizer: Tokenizer | None, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        num_logprobs = params.logprobs
        if num_logprobs is None and params.logprob_token_ids:
            num_logprobs = len(params.logprob_token_ids)
        self.num_logprobs = num_logprobs
        self.num_prompt_logprobs = params.prompt_logprobs
        self.cumulative_logprob: float | None = None if num_logprobs is None else 0.0
        self.logprobs: SampleLogprobs | None = None if num_logprobs is None else []
        # The first prompt token has no logprob (nothing predicts it).
        self.prompt_logprobs: PromptLogprobs | None = (
            None if params.prompt_logprobs is None else [None]
        )

    def update_from_output(self, output: EngineCoreOutput) -> None:
        """Take the logprobs of one engine output."""
        if output.new_logprobs is not None:
            self._update_sample_logprobs(output.new_logprobs)
        if output.new_prompt_logprobs_tensors is not None:
            self._update_prompt_logprobs(output.new_prompt_logprobs_tensors)

    def pop_prompt_logprobs(self) -> PromptLogprobs | None:
        """All prompt logprobs, then forget them (DELTA hands them out once)."""
        plp = self.prompt_logprobs
        if plp:
            self.prompt_logprobs = []
        return plp

    def _update_sample_logprobs(self, lists: LogprobsLists) -> None:
        assert self.num_logprobs is not None
        assert self.logprobs is not None
        assert self.cumulative_logprob is not None
        ranks_all = _tolist(lists.sampled_token_ranks)
        logprobs_all = _tolist(lists.logprobs)
        token_ids_all = _tolist(lists.logprob_token_ids)
        for rank, logprobs, token_ids in zip(ranks_all, logprobs_all, token_ids_all, strict=False):
            decoded: Iterable[str | None]
            if self.tokenizer is None:
                decoded = repeat(None)
            else:
                decoded = self._verify_tokens(
                    self.tokenizer.decode_tokens_individually(token_ids),
                    token_ids,
                    _sampled_context_ids(self.logprobs),
                )
            self.cumulative_logprob += logprobs[0]
            _append_position(self.logprobs, token_ids, logprobs, decoded, rank, self.num_logprobs)

    def _update_prompt_logprobs(self, tensors: LogprobsTensors) -> None:
        assert self.num_prompt_logprobs is not None
        assert self.prompt_logprobs is not None
        token_ids_list = _tolist(tensors.logprob_token_ids)
        logprobs_list = _tolist(tensors.logprobs)
        ranks_list = _tolist(tensors.selected_token_ranks)
        num_positions = len(logprobs_list)
        width = len(logprobs_list[0]) if num_positions else 0
        all_decoded: list[str] | None = None
        if self.tokenizer is not None:
            flat = [t for row in token_ids_list for t in row]
            all_decoded = self.tokenizer.decode_tokens_individually(flat)
        for pos in range(num_positions):
            decoded: Iterable[str | None]
            if all_decoded is None:
                decoded = repeat(None)
            else:
                decoded = self._verify_tokens(
                    all_decoded[pos * width : (pos + 1) * width],
                    token_ids_list[pos],
                    _sampled_context_ids(self.prompt_logprobs),
                )
            _append_position(
                self.prompt_logprobs,
                token_ids_list[pos],
                logprobs_list[pos],
                decoded,
                ranks_list[pos],
                self.num_prompt_logprobs,
            )

    def _verify_tokens(
        self, decoded: list[str], tokens: Sequence[int], context_token_ids: list[int]
    ) -> list[str]:
        # A trailing U+FFFD is half a character (byte fallback): rebuild it from context.
        for idx, text in enumerate(decoded):
            if text.endswith(_REPLACEMENT):
                decoded[idx] = self._correct_decoded_token(tokens[idx], context_token_ids)
        return decoded

    def _correct_decoded_token(self, token_id: int, context_token_ids: list[int]) -> str:
        tok = self.tokenizer
        assert tok is not None
        decode = tok.decode
        for num_ctx in range(1, min(len(context_token_ids), 4) + 1):
            context = context_token_ids[-num_ctx:]
            full_decoded = decode([*context, token_id], skip_special_tokens=False)
            if full_decoded.endswith(_REPLACEMENT):
                continue
            # Context tokens that were themselves half characters gave "" when they came;
            # their text belongs to this token.
            clean_end = len(context)
            for j in range(len(context) - 1, -1, -1):
                if decode([context[j]], skip_special_tokens=False).endswith(_REPLACEMENT):
                    clean_end = j
                else:
                    break
            clean_prefix = (
                decode(context[:clean_end], skip_special_tokens=False) if clean_end > 0 else ""
            )
            if full_decoded.startswith(clean_prefix):
                return full_decoded[len(clean_prefix) :]
            common_len = 0
            for a, b in zip(clean_prefix, full_decoded, strict=False):
                if a != b:
                    break
                common_len += 1
            return full_decoded[common_len:]
        return ""


def _sampled_context_ids(
    source: Sequence[dict[int, Logprob] | None] | None, max_context: int = 4
) -> list[int]:
    """The last sampled (or prompt) token ids: the first key of each position."""
    if not source:
        return []
    out: list[int] = []
    for entry in source[max(0, len(source) - max_context) :]:
        if entry:
            out.append(next(iter(entry)))
    return out


def _append_position(
    container: list[Any],
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    decoded: Iterable[str | None],
    rank: int,
    num_logprobs: int,
) -> None:
    if num_logprobs == -1:
        num_logprobs = len(logprobs)
    # The sampled token first with its own rank, then the top-k with ranks 1..k (a sampled
    # token that is also in the top-k is simply written twice into the dict).
    ranks = chain((rank,), range(1, num_logprobs + 1))
    container.append(
        {
            token_id: Logprob(logprob=logprob, rank=r, decoded_token=token)
            for token_id, logprob, r, token in zip(
                token_ids, logprobs, ranks, decoded, strict=False
            )
        }
    )
