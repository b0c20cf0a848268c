"""Coordinated DP ranks (coordinator sockets, counts, finished sets, MoE waves), the
firehose, prompt embeddings on the tiny model, and startup time."""

from __future__ import annotations

import os
import time

import msgspec
import numpy as np
import pytest

from trio_vllm.protocol import EngineCoreOutputs

from ._harness import Frontend, request

pytestmark = pytest.mark.timeout(60)

PROMPT = list(b"abcde")


def _coord_messages(fe: Frontend, count: int, timeout: float = 10) -> list[EngineCoreOutputs]:
    assert fe.coord_pull is not None
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not fe.coord_pull.poll(remaining * 1000):
            raise TimeoutError(f"only {len(got)} coordinator messages: {got}")
        out = fe.codec.decode_outputs(fe.coord_pull.recv_multipart())
        assert isinstance(out, EngineCoreOutputs)
        got.append(out)
    return got


def _coord_until_quiet(fe: Frontend, quiet: float = 0.5) -> list[EngineCoreOutputs]:
    assert fe.coord_pull is not None
    got = []
    while fe.coord_pull.poll(quiet * 1000):
        out = fe.codec.decode_outputs(fe.coord_pull.recv_multipart())
        assert isinstance(out, EngineCoreOutputs)
        got.append(out)
    return got


def _waves(msgs: list[EngineCoreOutputs]) -> list[tuple[int | None, int | None]]:
    return [
        (m.start_wave, m.wave_complete)
        for m in msgs
        if m.start_wave is not None or m.wave_complete is not None
    ]


def _wave_markers(
    fe: Frontend, count: int, timeout: float = 10
) -> list[tuple[int | None, int | None]]:
    """The coordinator's wave markers: read until ``count`` arrived, then until quiet (any
    extra one shows). A quiet spell alone is no end marker: a descheduled engine can
    leave one between two markers."""
    assert fe.coord_pull is not None
    got: list[EngineCoreOutputs] = []
    deadline = time.monotonic() + timeout
    while len(_waves(got)) < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not fe.coord_pull.poll(remaining * 1000):
            raise TimeoutError(f"only these wave markers: {_waves(got)}")
        out = fe.codec.decode_outputs(fe.coord_pull.recv_multipart())
        assert isinstance(out, EngineCoreOutputs)
        got.append(out)
    return _waves(got + _coord_until_quiet(fe))


def test_coordinated_rank_publishes_counts_and_finished_sets(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--data-parallel-size", "2"], coordinator=True)
    # The ready response names the coordinator in 0.33 only; 0.32 leaves those keys out.
    rid = fe.add(request(PROMPT, max_tokens=3))
    got = fe.collect([rid])[rid]
    assert got.tokens == PROMPT[:3]
    # With a coordinator the engine keeps a finished set (PROTOCOL.md §5.6).
    assert got.outputs[-1].finish_reason == 1
    msgs = _coord_messages(fe, 2)
    counts = [
        (m.scheduler_stats.num_running_reqs, m.scheduler_stats.num_waiting_reqs)  # type: ignore[union-attr]
        for m in msgs
    ]
    assert counts[0] == (1, 0)
    assert counts[-1] == (0, 0)
    assert all(m.outputs == [] and m.utility_output is None for m in msgs)


def test_finished_requests_listed_with_coordinator(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--data-parallel-size", "2"], coordinator=True)
    a = request(PROMPT, max_tokens=2)
    b = request(PROMPT, max_tokens=100_000)
    fe.add(a)
    fe.add(b)
    finished: set[str] = set()
    deadline = time.monotonic() + 10
    while a.request_id not in finished:
        assert time.monotonic() < deadline
        out = fe.recv()
        assert isinstance(out, EngineCoreOutputs)
        finished |= out.finished_requests or set()
    # Client aborts show up in the set too, with the next step's message (vLLM sends
    # nothing while idle, so give it another request to step on).
    fe.abort([b.request_id])
    c = request(PROMPT, max_tokens=1)
    fe.add(c)
    while b.request_id not in finished:
        assert time.monotonic() < deadline
        out = fe.recv()
        assert isinstance(out, EngineCoreOutputs)
        finished |= out.finished_requests or set()


def test_moe_waves_with_coordinator(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--data-parallel-size", "2", "--moe"], coordinator=True)
    rid = fe.add(request(PROMPT, max_tokens=2))
    assert fe.collect([rid])[rid].tokens == PROMPT[:2]
    # Rank 0 reports idle -> running, then (rank 0) the end of wave 0.
    assert _wave_markers(fe, 2) == [(0, None), (None, 0)]
    # A request stamped with the finished wave 0 makes the idle engine ask for wave 1.
    rid = fe.add(request(PROMPT, max_tokens=1, current_wave=0))
    fe.collect([rid])
    assert _wave_markers(fe, 2) == [(1, None), (None, 1)]
    # START_DP_WAVE from the coordinator (two frames on its XPUB): an idle rank runs a
    # dummy wave and reports it complete.
    assert fe.coord_pub is not None
    fe.coord_pub.send_multipart([b"\x02", msgspec.msgpack.encode([5, None])])
    done = [m.wave_complete for m in _coord_messages(fe, 1)]
    assert done == [5]


def test_moe_without_coordinator_reports_to_client(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--moe", "--index", "0"])
    fe.start_wave(3, None)  # a client may send START_DP_WAVE directly (§7.5)
    out = fe.recv()
    assert isinstance(out, EngineCoreOutputs)
    assert out.wave_complete == 3
    rid = fe.add(request(PROMPT, max_tokens=2))
    assert fe.collect([rid])[rid].tokens == PROMPT[:2]
    out = fe.recv()
    assert isinstance(out, EngineCoreOutputs)
    assert out.wave_complete == 4


def test_firehose(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--firehose", "8", "--max-model-len", "100000"])
    rid = fe.add(request(PROMPT, max_tokens=100))
    got = fe.collect([rid])[rid]
    assert len(got.tokens) == 100
    assert got.tokens == [PROMPT[k % 5] for k in range(100)]
    sizes = []
    # Each message carries 8 one-token outputs (the last one the remainder).
    rid2 = fe.add(request(PROMPT, max_tokens=20))
    while True:
        out = fe.recv()
        assert isinstance(out, EngineCoreOutputs)
        sizes.append(len(out.outputs))
        assert all(len(o.new_token_ids) == 1 for o in out.outputs)
        if out.outputs[-1].finish_reason is not None:
            break
    assert sizes == [8, 8, 4]
    assert out.outputs[-1].request_id == rid2
    # A long firehose stops on ABORT; utilities keep working meanwhile.
    rid3 = fe.add(request(PROMPT, max_tokens=10**9))
    fe.recv()
    assert fe.call("is_sleeping") == (None, False)
    fe.abort([rid3])
    deadline = time.monotonic() + 10
    while not fe.no_output(0.3):
        assert time.monotonic() < deadline
        fe.recv()


@pytest.mark.timeout(150)  # the tiny model's torch import: seconds idle, more under load
def test_tiny_prompt_embeds_match_token_ids(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(model="tiny", args=["--device", "cpu"])
    prompt = list(b"embed me")
    by_ids = fe.generate(request(prompt, max_tokens=8)).tokens
    failure, rows = fe.call("collective_rpc", "embed_tokens", None, [prompt], None)
    assert failure is None
    embeds = np.asarray(rows[0], dtype=np.float32)
    by_embeds = fe.generate(request(None, prompt_embeds=embeds, max_tokens=8)).tokens  # type: ignore[arg-type]
    assert by_embeds == by_ids
    mixed = fe.generate(
        request(
            prompt,
            prompt_embeds=embeds,
            max_tokens=8,
            prompt_is_token_ids=[i % 2 == 0 for i in range(len(prompt))],
        )
    )
    assert mixed.tokens == by_ids


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_echo_engine_starts_and_answers_fast(spawn) -> None:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    fe = spawn()
    r = fe.generate(request(PROMPT, max_tokens=1))
    wall = time.monotonic() - t0
    cpu = _cpu_seconds(fe.proc.pid)
    assert r.tokens == PROMPT[:1]
    # The target is "answers a first request in under 2 s on CPU". Wall time depends on
    # how busy the machine is (~0.6 s idle here), so assert the engine's own CPU time
    # for startup + first answer, and only loosely the wall time.
    assert cpu < 2.0, (cpu, wall)
    assert wall < 15.0, (cpu, wall)


def test_firehose_never_blocks_the_engine(spawn) -> None:  # type: ignore[no-untyped-def]
    import signal

    fe = spawn(["--firehose", "64"], control=True)
    fe.add(request(PROMPT, max_tokens=10**9))
    # Nobody reads: the queues (engine HWM, receiver HWM, kernel buffers) fill up and
    # the engine stops stepping, but keeps serving its control socket and signals.
    steps = -1
    deadline = time.monotonic() + 30
    while True:
        assert time.monotonic() < deadline, "the firehose never stopped"
        ping = fe.control("ping")
        # (The control socket can answer before the engine has read the ADD.)
        if ping["firehose"] == 1 and ping["steps"] == steps:
            break
        steps = ping["steps"]
        time.sleep(0.5)
    t0 = time.monotonic()
    fe.signal(signal.SIGTERM)
    # ~0.5 s of bounded flush and linger for the undeliverable tail (printed); a blocked
    # engine never exits, so the bound is a hang guard.
    assert fe.wait_exit(15) == 0
    print(f"exited {time.monotonic() - t0:.2f} s after SIGTERM")


@pytest.mark.parametrize(("protocol", "expected"), [("0.32.0", []), ("0.33.0", [(0, None)])])
def test_moe_rank1_wave_reports(spawn, protocol: str, expected: list[tuple[int, int]]) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--data-parallel-size", "2", "--moe"], coordinator=True, index=1, protocol=protocol)
    rid = fe.add(request(PROMPT, max_tokens=2))
    assert fe.collect([rid])[rid].tokens == PROMPT[:2]
    # Only rank 0 reports wave_complete with a coordinator; in 0.33 an idle rank that
    # gets a request asks for a wave itself.
    assert _wave_markers(fe, len(expected)) == expected
