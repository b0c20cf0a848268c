"""Smoke tests: each ``trio-vllm bench`` subcommand runs with tiny sizes and prints one
valid JSON object with the fields the docs and ``bench/plots.py`` rely on.

Not timed tests: nothing here asserts a speed, only that the benchmarks run end to
end against real engine processes and report figures that are consistent.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest

from ._scripts import load_script

if TYPE_CHECKING:
    from pathlib import Path

CLI = [sys.executable, "-m", "trio_vllm.cli", "bench"]


def bench(*args: str, timeout: float = 110) -> dict[str, Any]:
    proc = subprocess.run(
        [*CLI, *args, "--json"], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # one JSON object, nothing else on stdout
    result: dict[str, Any] = json.loads(lines[0])
    assert result["machine"]["cores"] >= 1
    assert result["machine"]["date"].endswith("UTC")
    return result


def load_plots() -> Any:
    return load_script("plots.py", "bench_plots")


def check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert 10_000 < len(data) < 400_000  # a real chart, and small enough to commit


@pytest.mark.timeout(240)
def test_firehose(tmp_path: Path) -> None:
    result = bench("firehose", "--batch", "3", "--messages", "60", "--requests", "2",
                   "--consumers", "4", timeout=230)  # fmt: skip
    plots = load_plots()
    check_png(plots.plot_throughput(result, tmp_path))
    assert "| a: blocking pyzmq + decoder (ceiling) |" in plots.markdown({"firehose": result})
    assert result["bench"] == "firehose"
    (run,) = result["runs"]
    assert run["batch"] == 3
    assert run["live"]["backlog_s"] == 0
    # The backlog wait is derived from the live ceiling's duration.
    assert run["backlog"]["backlog_s"] == pytest.approx(
        1.5 * run["live"]["cases"]["a"]["seconds"] + 0.5
    )
    for mode in ("live", "backlog"):
        cases = run[mode]["cases"]
        assert set(cases) == {"a", "b", "b+", "c", "d4", "d4+"}
        # a, b, c: 2 requests x 90 outputs; d: 4 streams x max(32, 180 // 4) outputs.
        for key in ("a", "b", "b+", "c"):
            assert cases[key]["outputs"] == 2 * 90
            assert cases[key]["messages"] == 60  # 3 outputs per message, none left over
            assert cases[key]["outputs_per_s"] > 0
            assert cases[key]["cpu_s"] > 0
        for key in ("d4", "d4+"):
            if mode == "live":
                assert cases[key]["outputs"] == 4 * 45
            else:  # only what arrived after the pile-up is counted
                assert 0 < cases[key]["outputs"] <= 4 * 45
        ratios = run[mode]["ratios"]
        assert ratios["b/a"] == pytest.approx(
            cases["b"]["outputs_per_s"] / cases["a"]["outputs_per_s"]
        )
        assert run[mode]["cpu_ratios"]["b/a"] == pytest.approx(
            cases["a"]["cpu_s"] / cases["b"]["cpu_s"]
        )
        assert ratios["b/e"] is None  # no --vllm-python


@pytest.mark.timeout(120)
def test_latency(tmp_path: Path) -> None:
    result = bench("latency", "--rounds", "20", "--samples")
    check_png(load_plots().plot_latency(result, tmp_path))
    assert [r["backend"] for r in result["runs"]] == ["trio", "asyncio"]
    for run in result["runs"]:
        for case in ("raw", "transport", "stream", "get_output"):
            stats = run["cases"][case]
            assert 0 < stats["p50_us"] <= stats["p99_us"]
            assert len(run["samples_us"][case]) == 20
        assert run["ratios"]["stream/raw p50"] == pytest.approx(
            run["cases"]["stream"]["p50_us"] / run["cases"]["raw"]["p50_us"]
        )


@pytest.mark.timeout(120)
def test_idle() -> None:
    result = bench("idle", "--seconds", "0.3", "--engines", "1", "--backend", "trio")
    cpu = result["cpu_ms_per_5s"]
    assert set(cpu) == {"anchor blocking poll", "trio event loop alone",
                        "trio client, 1 idle engines"}  # fmt: skip
    assert all(v >= 0 for v in cpu.values())


@pytest.mark.timeout(120)
def test_startup() -> None:
    result = bench("startup", "--rounds", "1", "--backend", "asyncio")
    med = result["median"]
    assert med["engine"]["ready_ms"] > 0
    assert med["asyncio"]["ready_ms"] > 0
    assert med["asyncio"]["shutdown_ms"] >= 0
    # One round: the median of one per-round difference is that difference.
    assert med["asyncio"]["overhead_ms"] == pytest.approx(
        med["asyncio"]["ready_ms"] - med["engine"]["ready_ms"]
    )
    assert 0 < med["asyncio"]["to_spawned_ms"] < med["asyncio"]["ready_ms"]
    assert 0 <= med["asyncio"]["last_event_to_body_ms"] < med["asyncio"]["ready_ms"]


@pytest.mark.timeout(120)
def test_sync() -> None:
    result = bench("sync", "--tokens", "200", "--rounds", "1", "--backend", "trio,asyncio")
    assert result["tokens"] == 200
    for backend in ("trio", "asyncio"):
        row = result["backends"][backend]
        for case in ("sync", "async"):
            assert row[case]["outputs_per_s"] > 0
            assert row[case]["cpu_us_per_output"] >= 0
        assert row["ratio_sync_async"] == pytest.approx(
            row["sync"]["outputs_per_s"] / row["async"]["outputs_per_s"]
        )


def test_help_lists_benchmarks() -> None:
    proc = subprocess.run([*CLI, "--help"], capture_output=True, text=True, timeout=30,
                          check=True)  # fmt: skip
    for name in ("firehose", "latency", "idle", "startup", "sync"):
        assert name in proc.stdout


@pytest.mark.timeout(240)
def test_firehose_asyncio_streams_and_the_run_record(tmp_path: Path) -> None:
    # f: the stream case on asyncio (what bench/bench_client.py measured before it was
    # merged into `trio-vllm bench firehose`).
    result = bench("firehose", "--batch", "3", "--messages", "60", "--requests", "2",
                   "--consumers", "4", "--mode", "live", "--stream-backends", "trio,asyncio",
                   timeout=230)  # fmt: skip
    (run,) = result["runs"]
    cases = run["live"]["cases"]
    assert set(cases) == {"a", "b", "b+", "c", "d4", "d4+", "f4"}
    assert cases["f4"]["consumers"] == 4
    assert cases["f4"]["outputs"] == cases["d4"]["outputs"] == 4 * 45
    assert run["live"]["ratios"]["f4/c"] > 0
    machine = result["machine"]
    assert len(machine["load_avg"]) == 3
    assert machine["commit"] is None or len(machine["commit"].split("+")[0]) == 12
    plots = load_plots()
    subtitle = plots._subtitle(result)
    assert f"commit {machine['commit'] or 'unknown'}" in subtitle
    assert "load " in subtitle
    assert machine["date"] in subtitle
    check_png(plots.plot_throughput(result, tmp_path))
    assert "| f: streams, 4 consumers, asyncio |" in plots.markdown({"firehose": result})


@pytest.mark.timeout(120)
def test_firehose_cases_subset() -> None:
    # --cases runs only the named cases; the ratios of the missing ones are null, and
    # the printed table does without the ceiling's column.
    args = ["firehose", "--batch", "2", "--messages", "40", "--requests", "2", "--mode", "live"]
    result = bench(*args, "--cases", "b,c", timeout=110)
    (run,) = result["runs"]
    assert set(run["live"]["cases"]) == {"b", "c"}
    assert run["live"]["cpu_ratios"]["c/a"] is None
    assert run["live"]["cpu_ratios"]["b/e"] is None
    proc = subprocess.run(
        [*CLI, *args, "--cases", "a,b", "-q"],
        capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "b/a " in proc.stdout
    assert "c  trio-vllm" not in proc.stdout


def test_firehose_gc_threshold_is_set_per_case_and_restored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--gc-threshold: each case sets the first threshold after freezing its heap and
    puts Python's back afterwards (the option must not leak into later cases)."""
    import gc

    from trio_vllm.bench import _firehose
    from trio_vllm.bench._profile import Profile

    before = gc.get_threshold()
    monkeypatch.setattr(_firehose, "_gc_threshold", 12345)
    _firehose._freeze_heap()
    try:
        assert gc.get_threshold() == (12345, *before[1:])
    finally:
        _firehose._finish({"messages": 1}, Profile(False))
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
