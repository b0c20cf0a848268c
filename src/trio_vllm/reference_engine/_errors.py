"""The reference engine's exceptions and its log line: a leaf every other module may import."""

from __future__ import annotations

import os
import sys

__all__ = ["EngineExit", "FatalEngineError", "UtilityError", "WireError", "log"]


class FatalEngineError(Exception):
    """An error vLLM raises in its busy loop: ENGINE_CORE_DEAD, then exit 1."""


class EngineExit(Exception):
    """Leave the busy loop with this exit status."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class UtilityError(Exception):
    """A utility failed; ``str(exc)`` is the text after ``"Call to X method failed: "``."""


class WireError(Exception):
    """A message could not be decoded (the protocol layer's ProtocolError, re-raised)."""


def log(msg: str) -> None:
    """One line on stderr, tagged with the engine's pid."""
    print(f"[reference-engine pid {os.getpid()}] {msg}", file=sys.stderr, flush=True)
