"""The text layer's public data types, shaped as vLLM's (``vllm.outputs``, ``vllm.logprobs``).

Field names, order and meaning are vLLM 0.32.0's, so code written against
``vllm.RequestOutput`` reads the same here. These are plain msgspec structs (cheap to build,
encodable with msgspec for the server); nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NotRequired, TypeAlias, TypedDict

import msgspec

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


class Logprob(msgspec.Struct):
    """One token's log probability (vLLM's ``Logprob``).

    ``rank`` is the token's rank in the vocabulary (1 = most likely); ``decoded_token`` is
    the token decoded on its own (vLLM's ``convert_ids_list_to_tokens``), ``None`` when the
    request does not detokenize.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: One dict per generated token: token id -> Logprob (the sampled token first, then top-k).
SampleLogprobs: TypeAlias = list[dict[int, Logprob]]
#: One entry per prompt token; the first is ``None`` (nothing predicts the first token).
PromptLogprobs: TypeAlias = list[dict[int, Logprob] | None]


class CompletionOutput(msgspec.Struct):
    """One completion (one of the ``n`` samples) of a request (vLLM's ``CompletionOutput``).

    With ``RequestOutputKind.DELTA`` ``text``, ``token_ids`` and ``logprobs`` hold only
    what is new since the previous output of this completion; otherwise everything so far.
    ``finish_reason`` is ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` (or
    ``"repetition"``) once finished, else ``None``; ``stop_reason`` is the stop token id or
    stop string that ended it (``None`` for EOS and every other reason).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """Whether this completion is finished (a method, as in vLLM)."""
        return self.finish_reason is not None


class RequestOutput(msgspec.Struct):
    """The output of one request at one point of its generation (vLLM's ``RequestOutput``).

    ``request_id`` is the caller's (external) id, never the internal one sent to the
    engine. ``outputs`` holds the completions this output is about: all ``n`` for
    CUMULATIVE and FINAL_ONLY; for DELTA with ``n > 1`` only the completions that changed,
    each with its ``index``. ``finished`` is true once every completion is finished.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None

    def add(self, next_output: RequestOutput, *, aggregate: bool) -> None:
        """Merge a later output of the same request into this one (vLLM's ``add``).

        With ``aggregate`` (DELTA outputs that a slow consumer has not taken yet) the
        completions with the same index are concatenated; otherwise the later completion
        replaces the earlier one. Completions of new indexes are appended.
        """
        self.finished |= next_output.finished
        for nxt in next_output.outputs:
            for i, cur in enumerate(self.outputs):
                if cur.index == nxt.index:
                    if aggregate:
                        cur.text += nxt.text
                        cur.token_ids = [*cur.token_ids, *nxt.token_ids]
                        if nxt.logprobs:
                            cur.logprobs = [*(cur.logprobs or ()), *nxt.logprobs]
                        cur.cumulative_logprob = nxt.cumulative_logprob
                        cur.finish_reason = nxt.finish_reason
                        cur.stop_reason = nxt.stop_reason
                    else:
                        self.outputs[i] = nxt
                    break
            else:
                self.outputs.append(nxt)


class TextPrompt(TypedDict):
    """A text prompt: ``{"prompt": "..."}`` (vLLM's ``TextPrompt``)."""

    prompt: str


class TokensPrompt(TypedDict):
    """A token-id prompt: ``{"prompt_token_ids": [...]}`` (vLLM's ``TokensPrompt``);
    ``prompt`` optionally carries its text for the outputs."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


#: What ``generate`` takes as a prompt: text, token ids, or one of the two TypedDicts.
Prompt: TypeAlias = str | list[int] | TextPrompt | TokensPrompt

#: An OpenAI-shaped chat message: ``{"role": "user", "content": "..."}``; ``content`` may be
#: a list of ``{"type": "text", "text": "..."}`` parts (flattened to text, as vLLM's
#: "string" content format does). Other keys (``name``, ``tool_calls``...) reach the
#: template as they are.
ChatMessage: TypeAlias = Mapping[str, object]
