"""Prometheus metrics of one server app, in a registry of its own.

Names follow vLLM's (``vllm:...`` with a ``model_name`` label) so dashboards built for
``vllm serve`` keep working; ``trio_vllm:http_requests_total`` counts responses by
endpoint and status. ``prometheus_client`` is imported when an app is built, never by
``import trio_vllm``.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

__all__ = ["ServerMetrics"]

# vLLM's buckets (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class ServerMetrics:
    """The app's collectors; every method is synchronous and cheap (no I/O)."""

    def __init__(self, model_name: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry: CollectorRegistry = CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = {"model_name": model_name}
        self._http = Counter(
            "trio_vllm:http_requests",
            "HTTP responses by endpoint and status code.",
            ["endpoint", "status"],
            registry=r,
        )
        # Several API servers (trio-vllm serve --api-server-count N) write their values
        # to PROMETHEUS_MULTIPROC_DIR, and /metrics in each of them shows the sums, as
        # vllm serve's multiprocess metrics do.
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self._running = Gauge(
            "vllm:num_requests_running",
            "Generation requests in flight in this server.",
            ["model_name"],
            registry=r,
            multiprocess_mode="livesum",
        ).labels(**labels)
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed.", ["model_name"], registry=r
        ).labels(**labels)
        self._generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens.", ["model_name"], registry=r
        ).labels(**labels)
        self._success = Counter(
            "vllm:request_success",
            "Finished generation requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time from receiving the request to its first generated token.",
            ["model_name"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        ).labels(**labels)
        self._itl: _CountsHistogram | _RepeatedHistogram
        if self.multiprocess:  # values in the shared files, not in this process
            self._itl = _RepeatedHistogram(
                Histogram(
                    "vllm:inter_token_latency_seconds",
                    "Time between consecutive outputs of a request.",
                    ["model_name"],
                    buckets=_ITL_BUCKETS,
                    registry=r,
                ).labels(**labels)
            )
        else:
            counts = _CountsHistogram(
                "vllm:inter_token_latency_seconds",
                "Time between consecutive outputs of a request.",
                model_name,
                _ITL_BUCKETS,
            )
            r.register(counts)
            self._itl = counts
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from receiving the request to its last output.",
            ["model_name"],
            buckets=_E2E_BUCKETS,
            registry=r,
        ).labels(**labels)
        self._model = model_name

    def http_response(self, endpoint: str, status: int) -> None:
        self._http.labels(endpoint, str(status)).inc()

    def request_started(self) -> None:
        self._running.inc()

    def request_ended(self) -> None:
        self._running.dec()

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def inter_token(self, seconds: float, count: int = 1) -> None:
        """``count`` observations of ``seconds`` (a batch's outputs after its first: 0)."""
        self._itl.observe(seconds, count)

    def finished(self, reason: str, prompt_tokens: int, generated: int, seconds: float) -> None:
        self._success.labels(self._model, reason).inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(generated)
        self._e2e.observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        if self.multiprocess:
            from prometheus_client.multiprocess import MultiProcessCollector

            merged = CollectorRegistry()
            MultiProcessCollector(merged)  # type: ignore[no-untyped-call]  # all servers, summed
            return generate_latest(merged), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _RepeatedHistogram:
    """``observe(seconds, count)`` on a prometheus_client histogram (multiprocess mode)."""

    def __init__(self, histogram: Any) -> None:
        self.histogram = histogram

    def observe(self, seconds: float, count: int = 1) -> None:
        for _ in range(count):
            self.histogram.observe(seconds)


class _CountsHistogram:
    """A histogram as plain bucket counts, collected by the registry: observed once per
    engine output, where ``prometheus_client``'s takes a lock and walks its buckets per
    observation. Written and collected on the event loop's thread only."""

    def __init__(self, name: str, documentation: str, model_name: str,
                 buckets: Sequence[float]) -> None:  # fmt: skip
        self.name = name
        self.documentation = documentation
        self.model_name = model_name
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: +Inf only
        self.sum = 0.0

    def observe(self, seconds: float, count: int = 1) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += count
        self.sum += seconds * count

    def describe(self) -> list[Metric]:
        from prometheus_client.core import HistogramMetricFamily

        return [HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])]

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import HistogramMetricFamily

        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, count in zip([*self.bounds, float("inf")], self.counts, strict=True):
            cumulative += count
            # As prometheus_client writes ``le`` for these bounds (repr; "+Inf").
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        family.add_metric([self.model_name], buckets, self.sum)
        yield family
