"""Engine sources for the data-parallel tests."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from trio_vllm.client import ReferenceEngines

# A model step at most every millisecond: a "long" request (LONG, 100,000 tokens) runs
# at least 100 s, longer than any test here waits (unpaced it took ~4 s, and a request
# that had to outlive an add_engines or a kill could end first); and engines running
# long requests send at most 1,000 messages a second each, so they do not bury a
# loaded client under a backlog that new requests' outputs queue behind.
LONG_ARGS = ("--max-model-len", "1000000", "--step-interval-ms", "1")
COUNTING_ENGINE = str(Path(__file__).with_name("_counting_engine.py"))


class CountingEngines(ReferenceEngines):
    """Reference engines that also report what they received (``dp_counts``)."""

    def __init__(self, count: int = 1, **kwargs: Any) -> None:
        kwargs.setdefault("model", "echo")
        # "Long" requests (max_tokens 100,000) must not end at the default 2048.
        kwargs["extra_args"] = [*LONG_ARGS, *kwargs.get("extra_args", ())]
        super().__init__(count, **kwargs)

    def command(self, handshake_address: str, rank: int) -> list[str]:
        cmd = super().command(handshake_address, rank)
        return [sys.executable, COUNTING_ENGINE, *cmd[3:]]


def counting_command(handshake_address: str, rank: int, *extra: str) -> list[str]:
    """The command line of one counting engine started by hand (external engines)."""
    return [
        sys.executable,
        COUNTING_ENGINE,
        "--handshake-address",
        handshake_address,
        "--index",
        str(rank),
        "--model",
        "echo",
        *LONG_ARGS,
        *extra,
    ]
