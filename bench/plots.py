"""Charts from ``trio-vllm bench ... --json`` results, for ``docs/performance.md``.

* ``throughput.png`` from a firehose result: one bar per case (outputs/s, with its
  ratio to the blocking ceiling a), one panel per outputs-per-message setting and
  mode (live, backlog);
* ``latency_cdf.png`` from a latency result run with ``--samples``: the CDF of the
  ADD -> first output round trip of each case, one panel per backend.

Each chart is titled with the machine, the commit measured, the load average and the
date of the run (all from the result's ``machine`` record).

    python bench/plots.py --firehose bench/results/firehose.json \\
        --latency bench/results/latency.json --out docs/images
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
    "transport": ("AsyncSocket only, same sockets", "tab:orange"),
    "stream": ("trio-vllm generate (stream)", "tab:blue"),
    "get_output": ("trio-vllm add_request + get_output", "tab:green"),
}


def _subtitle(result: dict[str, Any]) -> str:
    m = result["machine"]
    load = m.get("load_avg") or ([m["load_1min"]] if m.get("load_1min") is not None else None)
    parts = [
        f"{m['cpu']}, {m['cores']} cores, Python {m['python']}",
        f"commit {m.get('commit') or 'unknown'}",
        "load " + ("/".join(f"{x:.1f}" for x in load) if load else "unknown"),
        m["date"],
    ]
    return " - ".join(parts)


def _case_label(key: str, case: dict[str, Any]) -> str:
    if key in _CASE_STYLE:
        return _CASE_STYLE[key][0]
    backend = "trio" if key.startswith("d") else "asyncio"
    how = ", receive_batch" if key.endswith("+") else ""
    return f"{key[0]}: streams, {case['consumers']} consumers{how}, {backend}"


def _case_color(key: str) -> str:
    if key in _CASE_STYLE:
        return _CASE_STYLE[key][1]
    return "tab:purple" if key.startswith("d") else "tab:olive"


def _short_rate(value: float, _pos: object = None) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.1f}M"
    return f"{value / 1e3:.0f}k" if value else "0"


def plot_throughput(result: dict[str, Any], out: Path) -> Path:
    panels = [(run, mode) for run in result["runs"] for mode in ("live", "backlog") if mode in run]
    cols = min(2, len(panels))
    rows = (len(panels) + cols - 1) // cols
    height = max(len(run[mode]["cases"]) for run, mode in panels) * 0.42 + 1.6
    fig, axes = plt.subplots(rows, cols, figsize=(7.2 * cols, height * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (run, mode) in zip(axes.flat, panels, strict=False):
        cases = run[mode]["cases"]
        ceiling = cases["a"]["outputs_per_s"]
        keys = list(cases)  # the run's order: a first
        rates = [cases[k]["outputs_per_s"] for k in keys]
        ys = range(len(keys))
        ax.barh(ys, rates, color=[_case_color(k) for k in keys], height=0.6, zorder=3)
        for y, rate in zip(ys, rates, strict=True):
            ax.text(rate, y, f"  {rate:,.0f}  ({rate / ceiling:.2f} x a)", va="center",
                    fontsize=8)  # fmt: skip
        ax.set_yticks(list(ys), [_case_label(k, cases[k]) for k in keys], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, max(rates) * 1.45)
        ax.set_xlabel("outputs (tokens) per second")
        how = "live: read while the engine sends" if mode == "live" else "backlog: drain"
        ax.set_title(
            f"{run['batch']} output(s) per engine message, {run['requests']} requests - {how}",
            fontsize=10,
        )
        ax.grid(True, axis="x", alpha=0.3, zorder=0)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(5))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(_short_rate))
    fig.suptitle("Firehose throughput, one run, a fresh reference engine per case\n"
                 + _subtitle(result), fontsize=10)  # fmt: skip
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
            if key not in run["samples_us"]:
                continue
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


_NAMES = {
    "a": "a: blocking pyzmq + decoder (ceiling)",
    "b": "b: trio-vllm `get_output`, trio",
    "b+": "b+: `get_output` + `get_output_nowait` drain, trio",
    "c": "c: trio-vllm `get_output`, asyncio",
    "e": "e: vLLM 0.32 `AsyncMPClient` (asyncio)",
}


def markdown(results: dict[str, dict[str, Any]]) -> str:
    """Markdown tables of the figures (for docs/performance.md)."""
    out: list[str] = []
    fh = results.get("firehose")
    if fh:
        for run in fh["runs"]:
            for mode in ("live", "backlog"):
                if mode not in run:
                    continue
                res = run[mode]
                what = "live" if mode == "live" else f"backlog ({res['backlog_s']:.1f} s pile-up)"
                out.append(f"**{run['batch']} output(s) per message, {what}**\n")
                out.append("| case | outputs/s | messages/s | vs a | client CPU us/msg |")
                out.append("| --- | --: | --: | --: | --: |")
                a = res["cases"]["a"]["outputs_per_s"]
                for key, c in res["cases"].items():
                    name = _NAMES.get(key) or _case_label(key, c)
                    out.append(
                        f"| {name} | {c['outputs_per_s']:,.0f} | {c['messages_per_s']:,.0f} | "
                        f"{c['outputs_per_s'] / a:.2f} | {c['cpu_us_per_message']:.1f} |"
                    )
                parts = [
                    f"{k} {v:.2f} / {res['cpu_ratios'][k]:.2f}"
                    for k, v in res["ratios"].items()
                    if v is not None
                ]
                out.append("\nRatios (throughput / CPU capacity): " + ", ".join(parts) + "\n")
    lat = results.get("latency")
    if lat:
        out.append("| backend | case | p50 us | p99 us | mean us |")
        out.append("| --- | --- | --: | --: | --: |")
        for run in lat["runs"]:
            for key, c in run["cases"].items():
                out.append(
                    f"| {run['backend']} | {_LATENCY_STYLE[key][0]} | {c['p50_us']:.0f} | "
                    f"{c['p99_us']:.0f} | {c['mean_us']:.0f} |"
                )
        for run in lat["runs"]:
            parts = [f"{k} {v:.2f}" for k, v in run["ratios"].items()]
            out.append(f"\n{run['backend']}: " + ", ".join(parts))
        out.append("")
    idle = results.get("idle")
    if idle:
        out.append(f"| case ({idle['seconds']:g} s, scaled to 5 s) | CPU ms per 5 s |")
        out.append("| --- | --: |")
        for name, ms in idle["cpu_ms_per_5s"].items():
            out.append(f"| {name} | {ms:.2f} |")
        out.append("")
    st = results.get("startup")
    if st:
        out.append(
            "| case | ready ms | overhead ms | shutdown ms | spawned ms | last event -> body ms |"
        )
        out.append("| --- | --: | --: | --: | --: | --: |")
        for name, m in st["median"].items():
            label = (
                "engine alone (blocking frontend)" if name == "engine" else f"open_client, {name}"
            )
            cells = [m.get(k) for k in ("ready_ms", "overhead_ms", "shutdown_ms", "to_spawned_ms",
                                        "last_event_to_body_ms")]  # fmt: skip
            out.append(
                f"| {label} | " + " | ".join("" if v is None else f"{v:.1f}" for v in cells) + " |"
            )
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--firehose", type=Path, help="JSON of `trio-vllm bench firehose`")
    parser.add_argument("--latency", type=Path, help="JSON of `trio-vllm bench latency`")
    parser.add_argument("--idle", type=Path, help="JSON of `trio-vllm bench idle`")
    parser.add_argument("--startup", type=Path, help="JSON of `trio-vllm bench startup`")
    parser.add_argument("--out", type=Path, default=Path("docs/images"))
    parser.add_argument("--markdown", action="store_true",
                        help="print markdown tables of the figures instead of charts")  # fmt: skip
    args = parser.parse_args()
    if args.markdown:
        results = {
            name: json.loads(path.read_text())
            for name in ("firehose", "latency", "idle", "startup")
            if (path := getattr(args, name)) is not None
        }
        print(markdown(results))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.firehose:
        print(plot_throughput(json.loads(args.firehose.read_text()), args.out))
    if args.latency:
        print(plot_latency(json.loads(args.latency.read_text()), args.out))


if __name__ == "__main__":
    main()
