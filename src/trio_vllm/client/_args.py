"""Argument checks for the client's options (``_options.py`` has the table), the engine
sources and ``add_engines``.

The checks of the sources themselves, which know their classes, are in ``_engines.py``
and use the helpers here.

Every argument is checked up front, before a socket is bound or a process started, and
a bad one raises ``TypeError`` (wrong type: a string for seconds, a bool for a count, a
bare string for an argument list) or ``ValueError`` (NaN, infinity, negative, out of
range, unknown choice), naming the argument. Unchecked, such values fail late and far
away: ``shutdown_grace="5"`` raised only at exit, inside an exception group, after the
engine had been left running; ``nan`` left it a zombie.

Bounds are generous sanity limits, not policy: they refuse what can only be a mistake
(a grace period of hours is a value in milliseconds).
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Final

from ..protocol.profiles import ProtocolProfile, profile_for_version

__all__ = [
    "DEFAULT_READY_TIMEOUT",
    "MAX_READY_TIMEOUT",
    "MAX_SHUTDOWN_GRACE",
    "MAX_STREAM_BUFFER",
    "RANK_LIMIT",
    "argument_list",
    "check_max_pending",
    "check_rank",
    "choice",
    "environment",
    "flag",
    "integer",
    "path",
    "profile",
    "ready_timeout",
    "seconds",
    "text",
    "type_name",
]

#: ``ready_timeout`` when neither the caller nor ``VLLM_ENGINE_READY_TIMEOUT_S`` sets it.
DEFAULT_READY_TIMEOUT: Final = 600.0
#: ``ready_timeout`` at most (11.6 days): anything larger is a unit mistake.
MAX_READY_TIMEOUT: Final = 1e6
#: ``shutdown_grace`` at most (one hour).
MAX_SHUTDOWN_GRACE: Final = 3600.0
#: ``stream_buffer`` and ``max_pending`` at most.
MAX_STREAM_BUFFER: Final = 1 << 24
# An engine's routing identity is its rank in 2 bytes (docs/protocol.md §2.2).
RANK_LIMIT: Final = 1 << 16
_READY_TIMEOUT_ENV: Final = "VLLM_ENGINE_READY_TIMEOUT_S"


def type_name(value: object) -> str:
    return type(value).__name__


def seconds(name: str, value: object, *, maximum: float, allow_zero: bool, what: str = "") -> float:
    """``value`` as float seconds: a real number (not a bool, not a string), finite,
    positive (or zero when allowed) and at most ``maximum``."""
    where = what or name
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where} must be a number of seconds, got {value!r}")
    number = float(value)
    if math.isnan(number):
        raise ValueError(f"{where} must be a number of seconds, got NaN")
    if math.isinf(number):
        raise ValueError(f"{where} must be finite (at most {maximum:g} s), got {value!r}")
    if number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{where} must be {bound} seconds, got {value!r}")
    if number > maximum:
        raise ValueError(
            f"{where} must be at most {maximum:g} seconds, got {value!r} (a value in milliseconds?)"
        )
    return number


def integer(name: str, value: object, *, minimum: int, maximum: int) -> int:
    """``value`` as an int (not a bool, not a float) in ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    number = int(value)
    if not minimum <= number <= maximum:
        raise ValueError(f"{name} must be an int in [{minimum}, {maximum}], got {value!r}")
    return number


def flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def text(name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type_name(value)} {value!r}")
    if not value.strip():
        raise ValueError(f"{name} must be a non-empty str, got {value!r}")


def path(name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    text(name, value)


def choice(name: str, value: object, choices: Sequence[str], *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {list(choices)}, got {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _arguments(name: str, value: object) -> None:
    if isinstance(value, (str, bytes)):
        raise TypeError(
            f"{name} must be a list of command-line arguments, got the str {value!r} "
            f"(it would be split into characters; pass [{value!r}])"
        )
    if not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of str, got {type_name(value)}")
    for item in value:
        if not isinstance(item, str):
            raise TypeError(f"{name} must hold str only, got {item!r}")


def _environment(name: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a mapping of str to str, got {type_name(value)}")
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise TypeError(f"{name} must map str to str, got {key!r}: {item!r}")
        if not key or "=" in key or "\0" in key or "\0" in item:
            raise ValueError(f"{name} has an invalid variable {key!r}={item!r}")


def argument_list(name: str, value: object) -> list[str]:
    """A list of command-line arguments (a bare str is refused: it would be split)."""
    _arguments(name, value)
    assert isinstance(value, Sequence)
    return list(value)


def environment(name: str, value: object) -> dict[str, str]:
    """Environment variables to add for engine processes (``None``: none)."""
    _environment(name, value)
    return dict(value) if isinstance(value, Mapping) else {}


def check_max_pending(value: object) -> None:
    """``generate(max_pending=...)``: ``None`` (the client's ``stream_buffer``) or an int
    >= 1 (0 used to mean the default silently, ``True`` a buffer of one)."""
    if value is not None:
        integer("max_pending", value, minimum=1, maximum=MAX_STREAM_BUFFER)


def check_rank(rank: object, name: str = "rank") -> None:
    """A data-parallel rank given by a caller: an int (not a bool) that fits an identity."""
    integer(name, rank, minimum=0, maximum=RANK_LIMIT - 1)


def ready_timeout(value: object, name: str = "ready_timeout") -> float:
    """The timeout to use: ``value``, or ``VLLM_ENGINE_READY_TIMEOUT_S``, or 600 s."""
    if value is not None:
        return seconds(name, value, maximum=MAX_READY_TIMEOUT, allow_zero=False)
    raw = os.environ.get(_READY_TIMEOUT_ENV)
    if raw:
        try:
            number = float(raw)
        except ValueError:
            raise ValueError(f"{_READY_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
        return seconds(
            name,
            number,
            maximum=MAX_READY_TIMEOUT,
            allow_zero=False,
            what=f"{_READY_TIMEOUT_ENV} (the default of {name})",
        )
    return DEFAULT_READY_TIMEOUT


def profile(name: str, value: object) -> None:
    """``None``, a `ProtocolProfile`, or a vLLM version string it resolves now."""
    if value is None or isinstance(value, ProtocolProfile):
        return
    if not isinstance(value, str):
        raise TypeError(
            f"{name} must be None, a ProtocolProfile or a vLLM version str, got {value!r}"
        )
    # Resolve it now (an unknown layout must not surface after the engines started);
    # a newer-release warning is passed on, not swallowed.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            profile_for_version(value)
        except Exception as exc:
            raise ValueError(f"{name} {value!r}: {exc}") from exc
    for warning in caught:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
