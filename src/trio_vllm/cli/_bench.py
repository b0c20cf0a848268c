"""``trio-vllm bench ...``: benchmarks that run their anchor in the same run.

Absolute numbers on shared machines are noise; each benchmark measures trio-vllm
next to a blocking pyzmq anchor (and, for firehose, vLLM's own client) in one
run and prints ratios. --json prints one JSON object instead of the table.

* ``firehose``: output throughput: raw ceiling, raw API on trio and asyncio,
  per-request streams, vLLM's ``AsyncMPClient`` (with ``--vllm-python``).
* ``latency``: ADD -> first output round trip, p50/p99, next to blocking pyzmq.
* ``idle``: CPU time of a client with open, idle engines.
* ``startup``: ``open_client`` entry -> ready, minus the engine's own readiness
  time; and shutdown time.

The implementations live in ``trio_vllm.bench``'s private submodules, imported only
when run.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["add_parser", "run"]

_BACKENDS = ("trio", "asyncio")


# Checked by argparse, so a bad value is a usage error before anything starts.
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _int_list(text: str) -> str:
    """A comma list of positive integers, returned as given (the benchmarks split it)."""
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("give at least one value")
    for item in items:
        _positive_int(item)
    return text


def _choices(*allowed: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("give at least one value")
        bad = [t for t in items if t not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, bad))} (choose from {', '.join(allowed)})"
            )
        return ",".join(items)

    return check


def add_parser(commands: Any) -> None:
    """Add the ``bench`` subcommand to the ``trio-vllm`` subparsers ``commands``."""
    bench = commands.add_parser(
        "bench",
        help="benchmarks (with their anchors and ratios)",
        description=__doc__.split("\n\n")[1],
    )
    subs = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)

    def common(p: Any) -> None:
        p.add_argument("--json", action="store_true", help="print one JSON object")
        p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")

    fh = subs.add_parser(
        "firehose",
        help="output throughput vs the raw ceiling and vLLM's AsyncMPClient",
        description=(
            "Reference engine in firehose mode. Cases: (a) blocking pyzmq + decoder, "
            "(b) get_output on trio (b+: draining with get_output_nowait after each), (c) "
            "on asyncio, (d) per-request streams with C consumers on trio (d+: consumers "
            "calling receive_batch; f: on asyncio, with --stream-backends trio,asyncio), "
            "(e) vLLM's AsyncMPClient with --vllm-python. Prints outputs/s, messages/s "
            "and the ratios b/a, b+/a, c/a, b/e, e/a, d/b, d+/b (f/c)."
        ),
    )
    fh.add_argument(
        "--batch",
        default="1,64",
        type=_int_list,
        metavar="B[,B]",
        help="outputs per engine message; comma list (default 1,64)",
    )
    fh.add_argument(
        "--messages",
        type=_positive_int,
        default=None,
        metavar="M",
        help="engine messages per case (outputs = M x batch; default 60000 / batch, "
        "at least 20000)",
    )
    fh.add_argument(
        "--requests",
        type=_positive_int,
        default=8,
        metavar="N",
        help="concurrent requests for cases a, b, c, e (default 8)",
    )
    fh.add_argument(
        "--consumers",
        default="256,4096",
        type=_int_list,
        metavar="C[,C]",
        help="stream consumers for case d; comma list (default 256,4096)",
    )
    fh.add_argument(
        "--vllm-python", metavar="PY", help="a python with vLLM: also measure vLLM's AsyncMPClient"
    )
    fh.add_argument(
        "--gc-threshold",
        type=_positive_int,
        default=None,
        metavar="N",
        help="every case (vLLM's too) sets the collector's first threshold to N after "
        "freezing its startup heap (default: Python's, 700; docs/performance.md)",
    )
    fh.add_argument(
        "--stream-backends",
        default="trio",
        type=_choices(*_BACKENDS),
        metavar="B[,B]",
        help="backends of the stream cases: d on trio (default), f on asyncio",
    )
    fh.add_argument(
        "--mode",
        default="live,backlog",
        type=_choices("live", "backlog"),
        metavar="M[,M]",
        help="live: read while the engine sends; backlog: drain after the engine sent "
        "everything (the client's own capacity); default live,backlog",
    )
    fh.add_argument(
        "--cases",
        default="a,b,b+,c,d,e",
        type=_choices("a", "b", "b+", "c", "d", "e"),
        metavar="K[,K]",
        help="cases to run (d: the stream cases d, d+ and f; e needs --vllm-python); default all",
    )
    fh.add_argument(
        "--profile",
        action="store_true",
        help="run each case under cProfile and print its top-10 (self time; also in the "
        "JSON); profiled figures are slower than unprofiled ones",
    )
    common(fh)

    lat = subs.add_parser(
        "latency",
        help="ADD -> first output round trip vs blocking pyzmq",
        description=(
            "Round trips against the echo model (max_tokens=1), interleaved with a "
            "blocking pyzmq round trip against another engine on the same kind of "
            "sockets. Prints p50/p99 and ratios to the blocking anchor."
        ),
    )
    lat.add_argument("--rounds", type=_positive_int, default=2000, help="round trips per case")
    lat.add_argument(
        "--backend",
        default="trio,asyncio",
        type=_choices(*_BACKENDS),
        metavar="B[,B]",
        help="anyio backends, comma list (default trio,asyncio)",
    )
    lat.add_argument(
        "--samples",
        action="store_true",
        help="include every sample (us) in the JSON, for latency CDF plots",
    )
    common(lat)

    idle = subs.add_parser(
        "idle",
        help="CPU time of a client with open, idle engines",
        description=(
            "CPU seconds this process uses while a client with open, idle engines "
            "sleeps (all threads, zmq I/O threads included), next to the same sleep "
            "without a client and a blocking pyzmq poll on the same engine sockets."
        ),
    )
    idle.add_argument(
        "--seconds", type=_positive_float, default=5.0, help="idle window (default 5)"
    )
    idle.add_argument(
        "--engines", type=_positive_int, default=2, help="engines to open (default 2)"
    )
    idle.add_argument(
        "--backend", default="trio,asyncio", type=_choices(*_BACKENDS), metavar="B[,B]"
    )
    common(idle)

    st = subs.add_parser(
        "startup",
        help="open_client overhead over the engine's own readiness; shutdown time",
        description=(
            "Time from open_client entry to ready, minus the engine's own readiness "
            "time (spawn to ready message, measured with a blocking pyzmq frontend "
            "in the same run); and the time open_client takes to exit."
        ),
    )
    st.add_argument("--rounds", type=_positive_int, default=5, help="rounds per case (default 5)")
    st.add_argument("--backend", default="trio,asyncio", type=_choices(*_BACKENDS), metavar="B[,B]")
    common(st)

    sy = subs.add_parser(
        "sync",
        help="a blocking SyncRequestStream consumer against async for, per output",
        description=(
            "Drains the buffered outputs of one request with SyncRequestStream and, "
            "in the same rounds on the same client and engine, with async for in the "
            "client's event loop. Prints outputs/s, CPU per output and sync/async."
        ),
    )
    sy.add_argument("--tokens", type=_positive_int, default=5000, help="outputs per request")
    sy.add_argument(
        "--rounds", type=_positive_int, default=5, help="rounds per backend (default 5)"
    )
    sy.add_argument("--backend", default="trio,asyncio", type=_choices(*_BACKENDS), metavar="B[,B]")
    common(sy)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark named by ``args.bench_command``; returns the exit status."""
    if args.bench_command == "firehose":
        from ..bench import _firehose

        return _firehose.run(args)
    if args.bench_command == "latency":
        from ..bench import _latency

        return _latency.run(args)
    if args.bench_command == "idle":
        from ..bench import _idle

        return _idle.run(args)
    if args.bench_command == "startup":
        from ..bench import _startup

        return _startup.run(args)
    if args.bench_command == "sync":
        from ..bench import _sync

        return _sync.run(args)
    raise AssertionError(f"unhandled bench {args.bench_command!r}")
