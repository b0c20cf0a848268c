"""Charts from ``trio-vllm bench ... --json`` results, for ``docs/performance.md``.

* ``throughput.png`` from a firehose result: outputs/s against concurrency (requests
  or stream consumers in flight), one panel per outputs-per-message setting, every
  case of the run with its ratio to the blocking ceiling (a).
* ``latency_cdf.png`` from a latency result run with ``--samples``: the CDF of the
  ADD -> first output round trip of each case, one panel per backend.

Each chart is titled with the machine and the date the figures were measured.

    python bench/plots.py --firehose bench/results/firehose.json \\
        --latency bench/results/latency.json --out bench/results
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

_CASE_STYLE = {
    "a": ("a: blocking pyzmq + decoder (ceiling)", "black", "s"),
    "b": ("b: get_output, trio", "tab:blue", "o"),
    "b+": ("b+: get_output + nowait drain, trio", "tab:cyan", "o"),
    "c": ("c: get_output, asyncio", "tab:green", "^"),
    "e": ("e: vLLM AsyncMPClient", "tab:red", "D"),
}
_LATENCY_STYLE = {
    "raw": ("blocking pyzmq + decoder (anchor)", "black"),
    "stream": ("trio-vllm generate (stream)", "tab:blue"),
    "get_output": ("trio-vllm add_request + get_output", "tab:green"),
}


def _subtitle(result: dict[str, Any]) -> str:
    m = result["machine"]
    return f"{m['cpu']}, {m['cores']} cores, Python {m['python']} - {m['date']}"


def plot_throughput(result: dict[str, Any], out: Path) -> Path:
    runs = result["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(6.2 * len(runs), 4.8), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        cases = run["cases"]
        ceiling = cases["a"]["outputs_per_s"]
        for key, (label, color, marker) in _CASE_STYLE.items():
            if key not in cases:
                continue
            rate = cases[key]["outputs_per_s"]
            ax.scatter([run["requests"]], [rate], color=color, marker=marker, s=60, zorder=3,
                       label=f"{label}  ({rate / ceiling:.2f} x a)")  # fmt: skip
        streams = sorted(
            (c["consumers"], c["outputs_per_s"]) for k, c in cases.items() if k.startswith("d")
        )
        if streams:
            xs, ys = zip(*streams, strict=True)
            ratios = ", ".join(f"{y / ceiling:.2f}" for y in ys)
            ax.plot(xs, ys, color="tab:purple", marker="v", markersize=8,
                    label=f"d: one stream per request, trio  ({ratios} x a)")  # fmt: skip
        ax.axhline(ceiling, color="black", linewidth=0.8, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("requests in flight (a, b, c, e) / stream consumers (d)")
        ax.set_ylabel("outputs (tokens) per second")
        ax.set_title(f"{run['batch']} output(s) per engine message")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    fig.suptitle("Firehose throughput, one run, same reference engine\n" + _subtitle(result),
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    path = out / "throughput.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_latency(result: dict[str, Any], out: Path) -> Path:
    runs = result["runs"]
    if not all("samples_us" in r for r in runs):
        raise SystemExit("the latency result has no samples: run it with --samples")
    fig, axes = plt.subplots(1, len(runs), figsize=(6.2 * len(runs), 4.4), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        for key, (label, color) in _LATENCY_STYLE.items():
            values = sorted(run["samples_us"][key])
            n = len(values)
            stats = run["cases"][key]
            tag = f"p50 {stats['p50_us']:.0f}, p99 {stats['p99_us']:.0f} us"
            ax.step(values, [(i + 1) / n for i in range(n)], where="post", color=color,
                    label=f"{label}: {tag}")  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("ADD -> first output (microseconds, log scale)")
        ax.set_ylabel("fraction of round trips")
        ax.set_title(f"{run['backend']} ({len(run['samples_us']['raw'])} rounds)")
        ax.axhline(0.5, color="grey", linewidth=0.6, linestyle=":")
        ax.axhline(0.99, color="grey", linewidth=0.6, linestyle=":")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("Round-trip latency CDF, echo model, interleaved rounds\n" + _subtitle(result),
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    path = out / "latency_cdf.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--firehose", type=Path, help="JSON of `trio-vllm bench firehose`")
    parser.add_argument("--latency", type=Path, help="JSON of `trio-vllm bench latency`")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.firehose:
        print(plot_throughput(json.loads(args.firehose.read_text()), args.out))
    if args.latency:
        print(plot_latency(json.loads(args.latency.read_text()), args.out))


if __name__ == "__main__":
    main()
