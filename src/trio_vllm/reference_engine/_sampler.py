"""Sampling as vLLM's v1 sampler does it, for the parameters the reference engine supports.

Order per row (vLLM's): logprobs are taken from the *raw* logits (vLLM's default
``logprobs_mode="raw_logprobs"``); then ``allowed_token_ids``, ``_bad_words_token_ids``,
the ``min_tokens`` stop-id mask, ``logit_bias`` and the repetition/frequency/presence
penalties change the logits; then temperature < 1e-5 means greedy (``argmax``, lowest id on
ties), otherwise temperature, ``min_p``, ``top_k``, ``top_p`` and a draw by the
exponential race vLLM uses (``argmax(probs / q)``, ``q ~ Exp(1)``). Seeded requests draw
from their own generator, created once from ``seed``, so the same seed gives the same
tokens whatever else is in the batch. Everything is NumPy on CPU (the logits of a
260-token vocabulary are tiny), which keeps torch out of the echo model's path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["Sampled", "SamplingState", "prompt_logprobs", "sample_rows"]

_GREEDY_EPS = 1e-5


@dataclass(eq=False)
class SamplingState:
    """One request's sampling parameters in the form the sampler uses them."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    min_tokens: int = 0
    min_tokens_stop_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    rng: np.random.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def __post_init__(self) -> None:
        self.is_plain = self.plain

    @property
    def plain(self) -> bool:
        """Greedy with nothing that changes logits and no logprobs: argmax of raw logits."""
        return (
            self.greedy
            and self.logprobs is None
            and not self.logit_bias
            and self.allowed_token_ids is None
            and not self.bad_words_token_ids
            and self.min_tokens == 0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
            and self.repetition_penalty == 1.0
        )


@dataclass(frozen=True, slots=True)
class Sampled:
    """A sampled token and, when requested, its logprob row (sampled id first)."""

    token_id: int
    logprob_token_ids: npt.NDArray[np.int32] | None = None
    logprobs: npt.NDArray[np.float32] | None = None
    rank: int = 0


def _log_softmax(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    m = np.max(x, axis=-1, keepdims=True)
    shifted = x - m
    out: npt.NDArray[np.float32] = shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))
    return out.astype(np.float32, copy=False)


def _softmax(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    finite = np.isfinite(x)
    m = np.max(x[finite]) if finite.any() else 0.0
    e = np.where(finite, np.exp(x - m), 0.0)
    return e / e.sum()  # type: ignore[no-any-return]


def _top_k_ids(lp: npt.NDArray[np.float32], k: int) -> npt.NDArray[np.int64]:
    # Stable descending order so equal logprobs list the lower id first.
    return np.argsort(-lp, kind="stable")[:k]


def _process(
    raw: npt.NDArray[np.float32],
    state: SamplingState,
    prompt: list[int],
    output: list[int],
) -> npt.NDArray[np.float64]:
    x = raw.astype(np.float64)
    vocab = x.shape[0]
    if state.allowed_token_ids is not None:
        keep = np.zeros(vocab, dtype=bool)
        keep[[t for t in state.allowed_token_ids if 0 <= t < vocab]] = True
        x[~keep] = -np.inf
    if state.bad_words_token_ids:
        for word in state.bad_words_token_ids:
            if not word:
                continue
            prefix = word[:-1]
            matches = not prefix or (
                len(output) >= len(prefix) and output[-len(prefix) :] == prefix
            )
            if matches and 0 <= word[-1] < vocab:
                x[word[-1]] = -np.inf
    if len(output) < state.min_tokens and state.min_tokens_stop_ids:
        x[[t for t in state.min_tokens_stop_ids if 0 <= t < vocab]] = -np.inf
    if state.logit_bias:
        for token, bias in state.logit_bias.items():
            if 0 <= token < vocab:
                x[token] += bias
    if state.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(prompt + output, dtype=np.int64))
        seen = seen[(seen >= 0) & (seen < vocab)]
        vals = x[seen]
        x[seen] = np.where(
            vals > 0, vals / state.repetition_penalty, vals * state.repetition_penalty
        )
    if output and (state.frequency_penalty != 0.0 or state.presence_penalty != 0.0):
        counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=vocab)[:vocab]
        x -= state.frequency_penalty * counts
        x -= state.presence_penalty * (counts > 0)
    return x


def _draw(x: npt.NDArray[np.float64], state: SamplingState, rng: np.random.Generator) -> int:
    x = x / max(state.temperature, 0.01)
    vocab = x.shape[0]
    if state.min_p > 0.0:
        probs = _softmax(x)
        x = np.where(probs < state.min_p * probs.max(), -np.inf, x)
    if 0 < state.top_k < vocab:
        kth = np.sort(x)[-state.top_k]
        x = np.where(x < kth, -np.inf, x)
    if state.top_p < 1.0:
        probs = _softmax(x)
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        cut = cumulative - probs[order] > state.top_p
        x[order[cut]] = -np.inf
    probs = _softmax(x)
    q = rng.exponential(size=vocab)
    return int(np.argmax(probs / q))


def sample_rows(
    logits: npt.NDArray[np.float32],
    states: list[SamplingState],
    prompts: list[list[int]],
    outputs: list[list[int]],
    default_rng: np.random.Generator,
) -> list[Sampled]:
    """Sample one token per row of ``logits`` ``[B, V]``; pure apart from the generators."""
    results: list[Sampled] = []
    for row, state in enumerate(states):
        raw = logits[row]
        if state.is_plain:
            results.append(Sampled(int(np.argmax(raw))))
            continue
        x = _process(raw, state, prompts[row], outputs[row])
        if state.greedy:
            token = int(np.argmax(x))
        else:
            token = _draw(x, state, state.rng if state.rng is not None else default_rng)
        if state.logprobs is None:
            results.append(Sampled(token))
            continue
        lp = _log_softmax(raw)
        k = raw.shape[0] if state.logprobs < 0 else state.logprobs
        ids = np.concatenate(([token], _top_k_ids(lp, k))).astype(np.int32)
        rank = int(np.sum(lp > lp[token])) + 1
        results.append(Sampled(token, ids, lp[ids].astype(np.float32), rank))
    return results


def prompt_logprobs(
    logits: npt.NDArray[np.float32], prompt: list[int], k: int
) -> tuple[Any, Any, Any]:
    """Rows for prompt positions 1..P-1: ``(token_ids int32, logprobs float32, ranks int64)``.

    Row ``i`` scores prompt token ``i + 1`` from the logits at position ``i``; columns are
    the actual token then the top ``k`` (``k = -1``: the whole vocabulary).
    """
    vocab = logits.shape[1]
    k = vocab if k < 0 else k
    rows = len(prompt) - 1
    ids = np.zeros((rows, k + 1), dtype=np.int32)
    vals = np.zeros((rows, k + 1), dtype=np.float32)
    ranks = np.zeros((rows,), dtype=np.int64)
    if rows > 0:
        lp = _log_softmax(logits[:rows])
        for i in range(rows):
            target = prompt[i + 1]
            ids[i, 0] = target
            ids[i, 1:] = _top_k_ids(lp[i], k)
            vals[i] = lp[i][ids[i]]
            ranks[i] = int(np.sum(lp[i] > lp[i][target])) + 1
    return ids, vals, ranks
