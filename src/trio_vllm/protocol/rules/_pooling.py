"""`POOLING`: a pooling request a stock engine can run."""

from __future__ import annotations

from typing import Final

import msgspec

from ..structs import (
    PoolingParams,
)
from ._core import (
    OUTPUT_KINDS,
    POOLING_TASKS,
    UINT64_MAX,
    Fail,
    Family,
    Limits,
    PoolingModel,
    is_int,
)

# vLLM's PoolingParams.valid_parameters: what each task may set.
_VALID_PARAMETERS: Final = {
    "embed": ("dimensions", "use_activation"),
    "classify": ("use_activation",),
    "token_embed": ("dimensions", "use_activation"),
    "token_classify": ("use_activation",),
}
_EXAMPLE_MODEL: Final = PoolingModel("tiny", 64)

# ------------------------------------------------------------------------------- pooling


def with_pooling_defaults(params: PoolingParams, task: str | None = None) -> PoolingParams:
    """A copy of ``params`` with what vLLM's frontend fills in (``PoolingParams.verify``)
    before the engine sees it: ``task`` (``task`` if given), ``use_activation`` ``True``
    unless set (the engine then normalises an embedding, applies a classifier's
    activation), ``skip_reading_prefix_cache`` ``True`` for the per-token tasks and
    ``False`` for the others. Checks nothing (`POOLING` does)."""
    chosen = task if task is not None else params.task
    changes: dict[str, object] = {"task": chosen}
    if params.use_activation is None and chosen in _VALID_PARAMETERS:
        changes["use_activation"] = True
    if params.skip_reading_prefix_cache is None and chosen in _VALID_PARAMETERS:
        changes["skip_reading_prefix_cache"] = chosen in ("token_embed", "token_classify")
    return msgspec.structs.replace(params, **changes)


POOLING: Final[Family[PoolingParams]] = Family(
    "pooling", lambda **kw: PoolingParams(**{"task": "embed", **kw})
)
"""A pooling request a stock engine can run (a missing or unsupported task kills it)."""


@POOLING.rule("pooling_params.task", example={"task": None})
def _task(p: PoolingParams, limits: Limits) -> Fail | None:
    task = p.task
    if task is None:
        return (
            "pooling_params.task must be set (a stock engine dies on a pooling request "
            "without a task).",
            None,
        )
    if task not in POOLING_TASKS:
        return f"pooling_params.task must be one of {sorted(POOLING_TASKS)}, got {task!r}.", None
    supported = limits.supported_tasks
    if supported is not None and task not in supported:
        return f"Unsupported task: {task!r} Supported tasks: {sorted(supported)}", None
    return None


@POOLING.rule("pooling_params.dimensions", example={"dimensions": 0})
def _dimensions(p: PoolingParams, limits: Limits) -> Fail | None:
    d = p.dimensions
    if d is None or (is_int(d) and 1 <= d <= UINT64_MAX):
        return None
    return f"pooling_params.dimensions must be None or an integer >= 1, got {d!r}.", None


@POOLING.rule("pooling_params.output_kind", example={"output_kind": 9})
def _pooling_output_kind(p: PoolingParams, limits: Limits) -> Fail | None:
    kind = p.output_kind
    if is_int(kind) and kind in OUTPUT_KINDS:
        return None
    return f"pooling_params.output_kind must be a RequestOutputKind, got {kind!r}.", None


@POOLING.rule(
    "pooling_params.dimensions",
    engine=False,
    example={"dimensions": 8},
    limits={"pooling_model": _EXAMPLE_MODEL},
)
def _matryoshka(p: PoolingParams, limits: Limits) -> Fail | None:
    # vLLM's PoolingParams._set_default_parameters, run by its frontend (the engine
    # would just cut the vector): only a Matryoshka model may shorten its embeddings.
    model = limits.pooling_model
    d = p.dimensions
    if d is None or model is None or p.task not in ("embed", "token_embed"):
        return None
    if not model.is_matryoshka:
        return (
            f"Model {model.name!r} does not support Matryoshka embeddings; dimensions "
            f"must be unset (received dimensions={d}).",
            None,
        )
    if not 1 <= d <= model.embedding_size:
        return (
            f"Model {model.name!r} only supports dimensions in range "
            f"[1, {model.embedding_size}], got {d}.",
            None,
        )
    mds = model.matryoshka_dimensions
    if mds is not None and d not in mds:
        return (
            f"Model {model.name!r} only supports Matryoshka dimensions {list(mds)}, got {d}.",
            None,
        )
    return None


@POOLING.rule("pooling_params", engine=False, example={"task": "classify", "dimensions": 8})
def _task_parameters(p: PoolingParams, limits: Limits) -> Fail | None:
    # vLLM's PoolingParams._verify_valid_parameters (frontend): a classifier has no
    # dimensions to cut.
    valid = _VALID_PARAMETERS.get(str(p.task))
    if valid is None:
        return None
    invalid = [
        k for k in ("dimensions", "use_activation") if k not in valid and getattr(p, k) is not None
    ]
    if not invalid:
        return None
    return (
        f"Task {p.task!r} only supports {list(valid)} parameters, does not support "
        f"{invalid} parameters",
        None,
    )
