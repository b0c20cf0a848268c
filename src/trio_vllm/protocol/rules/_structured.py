"""`STRUCTURED`: a ``StructuredOutputsParams`` a stock engine can compile."""

from __future__ import annotations

from typing import Final

from ..structs import (
    StructuredOutputsParams,
)
from ._core import (
    STRUCTURED_OUTPUT_BACKENDS,
    Fail,
    Family,
    Limits,
    not_a,
)

# ------------------------------------------------------------------ structured outputs


STRUCTURED: Final[Family[StructuredOutputsParams]] = Family(
    "structured", lambda **kw: StructuredOutputsParams(**kw)
)
"""A ``StructuredOutputsParams`` a stock engine can compile (one constraint, a backend
it can instantiate: a wrong one kills the engine)."""


@STRUCTURED.rule("structured_outputs", param="structured_outputs", example={"_backend": "x"})
def _one_constraint(so: StructuredOutputsParams, limits: Limits) -> Fail | None:
    given: object = so  # a caller's struct may hold anything
    if not isinstance(given, StructuredOutputsParams):
        return not_a("structured_outputs", "a StructuredOutputsParams", given)
    count = sum(
        c is not None
        for c in (
            so.json,
            so.regex,
            so.choice,
            so.grammar,
            so.json_object or None,
            so.structural_tag,
        )
    )
    if count != 1:
        return (
            "structured_outputs must set exactly one constraint (json, regex, choice, "
            f"grammar, json_object, structural_tag), got {count}.",
            None,
        )
    return None


@STRUCTURED.rule(
    "structured_outputs._backend",
    param="structured_outputs",
    example={"regex": "a+", "_backend": "gbnf"},
)
def _backend(so: StructuredOutputsParams, limits: Limits) -> Fail | None:
    backend = so._backend
    if backend is None or backend not in STRUCTURED_OUTPUT_BACKENDS:
        return (
            "structured_outputs._backend must name the engine's backend, one of "
            f"{sorted(STRUCTURED_OUTPUT_BACKENDS)}, got {backend!r}.",
            None,
        )
    wanted = limits.structured_output_backend
    if wanted is not None and backend != wanted:
        return (
            f"structured_outputs._backend must be the engine's configured backend "
            f"{wanted!r}, got {backend!r}.",
            None,
        )
    return None
