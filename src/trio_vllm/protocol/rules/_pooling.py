"""`POOLING`: a pooling request a stock engine can run."""

from __future__ import annotations

from typing import Final

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
    is_int,
)

# ------------------------------------------------------------------------------- pooling


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
