"""``--profile`` for the benchmarks: a cProfile top-N of the measured section.

Standard library only, so that ``_vllm_firehose.py`` (run by vLLM's python) can load
it by path as well. cProfile sees the calling thread only (the event loop's, in every
client case); libzmq's I/O threads are not in it. Profiled figures are slower than
unprofiled ones (cProfile adds a cost to every Python call), so a profiled run
tells where the time goes, and an unprofiled run how much there is.
"""

from __future__ import annotations

import cProfile
import pstats
from typing import Any

__all__ = ["Profile"]


class Profile:
    """Enable around the measured section (``start``/``stop``); ``top`` summarises."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._profiler: cProfile.Profile | None = cProfile.Profile() if enabled else None

    def start(self) -> None:
        if self._profiler is not None:
            self._profiler.enable()

    def stop(self) -> None:
        if self._profiler is not None:
            self._profiler.disable()

    def top(self, n: int = 10, per: float = 1.0) -> list[dict[str, Any]]:
        """The ``n`` functions with the most self time; times also per ``per`` units
        (engine messages) in microseconds."""
        if self._profiler is None:
            return []
        stats = pstats.Stats(self._profiler)
        rows: list[dict[str, Any]] = []
        raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
        total = sum(v[2] for v in raw.values()) or 1.0
        for (path, line, name), (_cc, ncalls, tottime, cumtime, _callers) in sorted(
            raw.items(), key=lambda kv: kv[1][2], reverse=True
        )[:n]:
            where = name if path == "~" else f"{_short(path)}:{line}({name})"
            rows.append(
                {
                    "function": where,
                    "calls": ncalls,
                    "self_s": tottime,
                    "cum_s": cumtime,
                    "self_share": tottime / total,
                    "self_us_per_message": tottime / per * 1e6,
                    "calls_per_message": ncalls / per,
                }
            )
        return rows


def _short(path: str) -> str:
    for marker in ("site-packages/", "/src/", "/lib/python"):
        i = path.rfind(marker)
        if i >= 0:
            return path[i + len(marker) :]
    return path


def format_top(rows: list[dict[str, Any]]) -> list[str]:
    """Table lines for ``rows`` from :meth:`Profile.top`."""
    lines = [f"      {'self %':>6s} {'us/msg':>8s} {'calls/msg':>9s}  function"]
    for r in rows:
        lines.append(
            f"      {r['self_share'] * 100:6.1f} {r['self_us_per_message']:8.2f}"
            f" {r['calls_per_message']:9.2f}  {r['function']}"
        )
    return lines
