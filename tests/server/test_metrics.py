"""The inter-token-latency histogram (plain counts) renders as prometheus_client's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from trio_vllm.server._metrics import _ITL_BUCKETS, ServerMetrics


def test_itl_histogram_renders_as_prometheus_client_does() -> None:
    metrics = ServerMetrics("tiny")
    registry = CollectorRegistry()
    reference = Histogram(
        "vllm:inter_token_latency_seconds",
        "Time between consecutive outputs of a request.",
        ["model_name"],
        buckets=_ITL_BUCKETS,
        registry=registry,
    ).labels(model_name="tiny")
    for seconds, count in [(0.0, 5), (0.01, 1), (0.0100001, 1), (0.3, 2), (80.0, 1), (99.0, 3)]:
        metrics.inter_token(seconds, count)
        for _ in range(count):
            reference.observe(seconds)

    def lines(text: bytes) -> list[str]:
        return [line for line in text.decode().splitlines()
                if "inter_token" in line and "_created" not in line]  # fmt: skip

    ours = lines(metrics.render()[0])
    assert ours == lines(generate_latest(registry))
    assert 'vllm:inter_token_latency_seconds_count{model_name="tiny"} 13.0' in ours
