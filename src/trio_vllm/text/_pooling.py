"""Pooling requests and outputs (embeddings, classification), sans-I/O.

vLLM's frontend for a pooling model: a prompt becomes an ``EngineCoreRequest`` with
``PoolingParams`` (its defaults filled in, its rules checked against the model), and
the engine's one final output becomes a `PoolingRequestOutput` (``LLM.encode``) or an
`EmbeddingRequestOutput` (``LLM.embed``), as ``vllm.outputs`` shapes them. The engine
does the pooling and the normalisation (``use_activation``, on by default as vLLM's
``PoolingParams.verify`` sets it); nothing here changes the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._exceptions import InvalidRequestError
from ..protocol.rules import POOLING, PoolingModel, with_pooling_defaults
from ..protocol.structs import FinishReason, PoolingParams

if TYPE_CHECKING:
    from collections.abc import Mapping

    import numpy.typing as npt

    from ..protocol.rules import Limits
    from ..protocol.structs import EngineCoreOutput

__all__ = [
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "PoolingOutput",
    "PoolingRequestOutput",
    "pooling_model_of",
    "prepare_pooling",
    "to_pooling_output",
]


@dataclass(slots=True)
class PoolingOutput:
    """What the engine pooled for one request (vLLM's ``PoolingOutput``): ``data`` is
    ``[hidden]`` for embed/classify, ``[tokens, hidden]`` for the per-token tasks."""

    data: npt.NDArray[Any]


@dataclass(slots=True)
class PoolingRequestOutput:
    """One pooling request's result (vLLM's ``PoolingRequestOutput``)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int
    finished: bool
    prompt: str | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """One embedding (vLLM's ``EmbeddingOutput``): a list of floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """One embedding request's result (vLLM's ``EmbeddingRequestOutput``)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int
    finished: bool
    prompt: str | None = None

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        """vLLM's ``EmbeddingRequestOutput.from_base``: the pooled vector as floats;
        `InvalidRequestError` if it is not one vector (a per-token task)."""
        data = output.outputs.data
        if data.ndim != 1:
            raise InvalidRequestError("pooled_data should be a 1-D embedding vector")
        return cls(
            output.request_id,
            EmbeddingOutput([float(x) for x in data.tolist()]),
            output.prompt_token_ids,
            output.num_cached_tokens,
            output.finished,
            output.prompt,
        )


def pooling_model_of(name: str, config: Mapping[str, Any]) -> PoolingModel | None:
    """What the pooling rules read of a model (``config.json``'s text config): its
    embedding size and Matryoshka support, as vLLM's ``ModelConfig`` reads them."""
    hidden = config.get("hidden_size")
    if not isinstance(hidden, int):
        return None
    dims = config.get("matryoshka_dimensions")
    matryoshka = bool(dims) or bool(config.get("is_matryoshka", False))
    return PoolingModel(
        name, hidden, matryoshka, tuple(int(d) for d in dims) if isinstance(dims, list) else None
    )


def prepare_pooling(params: PoolingParams | None, task: str, limits: Limits) -> PoolingParams:
    """``params`` (default: ``PoolingParams()``) for ``task`` with vLLM's frontend
    defaults, checked against the model (``limits.pooling_model``) and the engines'
    tasks (``limits.supported_tasks``). `InvalidRequestError` with vLLM's message."""
    if params is None:
        params = PoolingParams()
    elif not isinstance(params, PoolingParams):
        raise InvalidRequestError(f"params must be a PoolingParams, not {type(params).__name__}")
    if params.task is not None and params.task != task:
        raise InvalidRequestError(
            f"You cannot overwrite pooling_params.task={params.task!r} with {task!r}!"
        )
    prepared = with_pooling_defaults(params, task)
    POOLING.raise_for(prepared, limits)
    return prepared


def to_pooling_output(
    output: EngineCoreOutput,
    *,
    request_id: str,
    prompt_token_ids: list[int],
    prompt: str | None,
) -> PoolingRequestOutput:
    """The caller's view of a pooling request's final engine output.

    Raises `InvalidRequestError` when the engine finished it without a result (an
    ERROR finish: the engine refused the input) and ``RuntimeError`` for an abort."""
    if output.finish_reason == FinishReason.ABORT:
        raise RuntimeError(f"pooling request {request_id!r} was aborted")
    if output.pooling_output is None:
        raise InvalidRequestError(f"pooling request {request_id!r} finished without a result")
    data = np.asarray(output.pooling_output)
    prefill = output.prefill_stats
    cached = prefill.num_cached_tokens if prefill is not None else 0
    return PoolingRequestOutput(
        request_id, PoolingOutput(data), prompt_token_ids, cached, True, prompt
    )
