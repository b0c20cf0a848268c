"""Public names report the module users import them from (as trio does).

A class defined in ``trio_vllm.client._client`` but used as ``trio_vllm.EngineCoreClient``
says ``trio_vllm`` in its ``__module__``, so reprs, tracebacks, pickles and
documentation name the public path, not a private file that may move.

msgspec structs keep their own module: msgspec resolves their annotations in it.
"""

from __future__ import annotations

import sys

__all__ = ["publish"]


def publish(module: str, namespace: dict[str, object], names: list[str]) -> None:
    """Set ``__module__`` to ``module`` on each class or function named in ``names``
    that trio-vllm defines (constants, msgspec structs and foreign objects are left
    alone)."""
    # Without msgspec imported nothing can be a struct: ``import trio_vllm`` stays free of
    # it (the CLI's Ctrl-C handler must be in place before anything heavy is imported).
    msgspec = sys.modules.get("msgspec")
    struct: type | None = None if msgspec is None else msgspec.Struct
    for name in names:
        obj = namespace.get(name)
        if struct is not None and isinstance(obj, type) and issubclass(obj, struct):
            continue
        current = getattr(obj, "__module__", None)
        if (
            isinstance(current, str)
            and current.startswith("trio_vllm.")
            and (isinstance(obj, type) or callable(obj))
        ):
            try:  # noqa: SIM105 - contextlib is one import more for ``import trio_vllm``
                obj.__module__ = module
            except (AttributeError, TypeError):  # e.g. a builtin
                pass
