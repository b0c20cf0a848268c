"""Each fault flag, the control socket, SIGTERM/SIGINT and the vLLM failure modes."""

from __future__ import annotations

import signal
import time

import pytest

from trio_vllm.protocol import EngineCoreDead, EngineCoreOutputs
from trio_vllm.protocol.structs import ENGINE_CORE_DEAD

from ._harness import STARTUP_TIMEOUT, request

pytestmark = pytest.mark.timeout(60)

PROMPT = list(b"abcde")


def test_die_after_steps(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--die-after-steps", "3"])
    fe.add(request(PROMPT, max_tokens=100))
    assert fe.wait_exit(10) == 1
    # No ENGINE_CORE_DEAD on this path: at most the three step outputs arrived.
    frames = []
    while not fe.no_output(0.2):
        frames.append(fe.recv_raw())
    assert len(frames) <= 3
    assert all(f != [ENGINE_CORE_DEAD] for f in frames)


def test_dead_after_steps(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--dead-after-steps", "2"])
    rid = fe.add(request(PROMPT, max_tokens=100))
    messages = []
    while True:
        out = fe.recv()
        messages.append(out)
        if isinstance(out, EngineCoreDead):
            break
    assert len(messages) == 3  # two steps, then the dead frame
    assert all(o.request_id == rid for m in messages[:2] for o in m.outputs)  # type: ignore[union-attr]
    assert fe.wait_exit(10) == 1


def test_stall_after_steps(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--stall-after-steps", "2"], control=True)
    rid = fe.add(request(PROMPT, max_tokens=100))
    # Two steps' outputs, then nothing (a quiet second as the end marker would cut the
    # count short whenever the engine is descheduled that long between two steps).
    steps = [fe.recv(), fe.recv()]
    assert all(len(m.outputs) == 1 and m.outputs[0].request_id == rid for m in steps)  # type: ignore[union-attr]
    assert fe.control("ping")["stalled"] is True
    assert fe.no_output(0.5)
    assert fe.proc.poll() is None  # still alive, silent
    fe.send_raw(fe.codec.encode_utility(0, 1, "is_sleeping", []))
    assert fe.no_output(0.5)  # does not read input either
    with open(f"/proc/{fe.proc.pid}/stat") as f:
        ticks = sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])
    time.sleep(1.0)
    with open(f"/proc/{fe.proc.pid}/stat") as f:
        # ...and does not spin on the unread message meanwhile.
        assert sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13]) - ticks < 20
    assert fe.control("ping")["stalled"] is True
    assert fe.control("unstall") == {"ok": True}
    failure, value = fe.wait_reply(1)
    assert (failure, value) == (None, False)
    # SIGTERM works while stalled.
    fe.control("stall")
    fe.signal(signal.SIGTERM)
    assert fe.wait_exit(10) == 0


def test_startup_delay_and_crash(spawn) -> None:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    fe = spawn(["--startup-delay", "1.0"])
    assert time.monotonic() - t0 >= 1.0
    assert fe.generate(request(PROMPT, max_tokens=2)).tokens == PROMPT[:2]
    crash = spawn(["--crash-on-startup", "boom: injected"], start=False)
    crash.start_time = time.monotonic()
    import subprocess

    crash.proc = subprocess.Popen(crash.cmd, stderr=crash._stderr)
    ident, _payload = crash._recv(crash.handshake_sock, 10, "HELLO")
    from trio_vllm.protocol import (
        EngineHandshakeMetadata,
        EngineZmqAddresses,
        encode_handshake_metadata,
    )

    crash.handshake_sock.send_multipart(
        [
            ident,
            encode_handshake_metadata(
                EngineHandshakeMetadata(EngineZmqAddresses(crash.input_addrs, crash.output_addrs))
            ),
        ]
    )
    assert crash.wait_exit(10) == 1
    err = crash.stderr()
    assert "boom: injected" in err
    assert "EngineCore failed to start." in err
    # A failed startup sends nothing on any socket (PROTOCOL.md §2.4).
    assert not crash.handshake_sock.poll(200)
    assert not crash.inputs[0].poll(0)


def test_handshake_timeout(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--handshake-timeout", "0.5"], start=False)
    fe._do_handshake = False
    fe.start()
    assert fe.wait_exit(10) == 1
    assert "Did not receive response from front-end process" in fe.stderr()


def test_garbage_after_steps(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--garbage-after-steps", "1"])
    rid = fe.add(request(PROMPT, max_tokens=3))
    first = fe.recv()
    assert isinstance(first, EngineCoreOutputs)
    assert first.outputs[0].request_id == rid
    garbage = fe.recv_raw()
    from trio_vllm import ProtocolError

    with pytest.raises(ProtocolError):
        fe.codec.decode_outputs(garbage)
    # ...and then the engine carries on normally.
    got = fe.collect([rid])[rid]
    assert got.tokens == PROMPT[1:3]


def test_fail_utility_and_output_delay(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--fail-utility", "is_sleeping", "--output-delay-ms", "300"])
    t0 = time.monotonic()
    failure, _ = fe.call("is_sleeping")
    assert time.monotonic() - t0 >= 0.3
    assert failure == "Call to is_sleeping method failed: injected failure of is_sleeping"
    assert fe.call("is_scheduler_paused") == (None, False)
    t0 = time.monotonic()
    r = fe.generate(request(PROMPT, max_tokens=5))
    assert r.tokens == PROMPT  # order kept
    assert time.monotonic() - t0 >= 0.3


def test_step_interval_paces_steps(spawn) -> None:  # type: ignore[no-untyped-def]
    # A lower bound only (a loaded machine makes steps later, never earlier): 20 tokens,
    # one per step, 50 ms apart.
    fe = spawn(["--step-interval-ms", "50"])
    t0 = time.monotonic()
    r = fe.generate(request(PROMPT, max_tokens=20))
    assert len(r.tokens) == 20
    assert time.monotonic() - t0 >= 19 * 0.05


def test_control_socket_commands(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(control=True)
    ping = fe.control("ping")
    assert ping["ok"]
    assert ping["pid"] == fe.proc.pid
    assert fe.control("delay", ms=200)["ok"]
    t0 = time.monotonic()
    fe.call("is_sleeping")
    assert time.monotonic() - t0 >= 0.2
    fe.control("delay", ms=0)
    fe.control("fail_utility", name="get_weight_version")
    assert fe.call("get_weight_version")[0] is not None
    fe.control("unfail_utility", name="get_weight_version")
    assert fe.call("get_weight_version") == (None, "default")
    fe.control("garbage")
    from trio_vllm import ProtocolError

    with pytest.raises(ProtocolError):
        fe.codec.decode_outputs(fe.recv_raw())
    assert fe.control("nope")["ok"] is False
    rid = fe.add(request(PROMPT, max_tokens=100_000))
    fe.recv()
    assert fe.control("dead")["ok"]
    while True:
        out = fe.recv()
        if isinstance(out, EngineCoreDead):
            break
        assert all(o.request_id == rid for o in out.outputs)
    assert fe.wait_exit(10) == 1


def test_control_kill(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(control=True)
    assert fe.control("kill", code=7)["ok"]
    assert fe.wait_exit(10) == 7


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly(spawn, signum: int) -> None:  # type: ignore[no-untyped-def]
    fe = spawn()
    # 900,000 tokens (minutes): still running at the signal however late it comes
    # (100,000 took ~4 s).
    rid = fe.add(request(PROMPT, max_tokens=900_000))
    fe.recv()
    t0 = time.monotonic()
    fe.signal(signum)
    # Specified: within a second; printed, and only a hang fails (the wall clock of a
    # loaded machine is not the engine's).
    code = fe.wait_exit(30)
    print(f"exited {time.monotonic() - t0:.3f} s after the signal")
    assert code == 0
    # Unfinished requests were finished as ABORT (shutdown_timeout 0), no DEAD frame:
    # sent before the exit, so it is read whole (a quiet spell is no end marker).
    finished = None
    while finished is None:
        out = fe.recv()
        assert isinstance(out, EngineCoreOutputs)
        for o in out.outputs:
            if o.finish_reason is not None:
                finished = (o.request_id, int(o.finish_reason), out.finished_requests)
    assert finished == (rid, 2, {rid})
    assert fe.no_output(0.2)


def test_duplicate_request_id_is_fatal(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn()
    req = request(PROMPT, max_tokens=100_000)
    fe.add(req)
    fe.add(req)
    while True:
        out = fe.recv()
        if isinstance(out, EngineCoreDead):
            break
    assert fe.wait_exit(10) == 1


def test_undecodable_input_kills_the_input_thread(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn()
    fe.send_raw([b"\x00", b"\xc1garbage"])
    fe.send_raw(fe.codec.encode_utility(0, 5, "is_sleeping", []))
    # vLLM: the input thread dies silently; nothing is sent and the process stays up.
    assert fe.no_output(1.0)
    assert fe.proc.poll() is None
    with open(f"/proc/{fe.proc.pid}/stat") as f:
        ticks = sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])
    time.sleep(1.0)
    with open(f"/proc/{fe.proc.pid}/stat") as f:
        # No spinning on the messages it will never read.
        assert sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13]) - ticks < 20
    deadline = time.monotonic() + 15  # written when it read the frame, however late
    while "input thread died" not in fe.stderr():
        assert time.monotonic() < deadline, fe.stderr()
        time.sleep(0.05)


def test_bad_client_index_kills_output(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn()
    fe.add(request(PROMPT, max_tokens=3, client_index=5), validate=False)
    deadline = time.monotonic() + 10
    while "output thread died" not in fe.stderr():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # Like vLLM's dead output thread: nothing is ever sent again.
    fe.send_raw(fe.codec.encode_utility(0, 5, "is_sleeping", []))
    assert fe.no_output(1.0)
    assert fe.proc.poll() is None


def test_unsupported_pooling_task_is_fatal(spawn) -> None:  # type: ignore[no-untyped-def]
    from trio_vllm.protocol import PoolingParams

    fe = spawn(["--supported-tasks", "generate"])
    fe.add(request(PROMPT, pooling_params=PoolingParams(task="embed")), validate=False)
    assert isinstance(fe.recv(), EngineCoreDead)
    assert fe.wait_exit(10) == 1


def test_sigterm_drain_mode(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--shutdown-timeout", "30"])
    running = request(PROMPT, max_tokens=10**9)
    fe.add(running)
    fe.recv()
    fe.signal(signal.SIGTERM)
    # Draining once utilities fail so (a fixed sleep could end before the engine
    # handled the signal; the late ADD was then served as usual).
    deadline = time.monotonic() + 30
    while fe.call("is_sleeping")[0] != "Server shutting down":
        assert time.monotonic() < deadline, "the SIGTERM was never handled"
    late = request(PROMPT, max_tokens=5)
    fe.add(late)
    call_id = fe.send_call("is_sleeping")
    got = fe.collect([late.request_id])
    assert got[late.request_id].finish_reason == 2  # new ADDs are answered with ABORT
    assert got[late.request_id].tokens == []
    assert fe.wait_reply(call_id) == ("Server shutting down", None)
    # The running request keeps going after the signal (drain) ...
    fe.pending.clear()
    before = fe.recv()
    assert isinstance(before, EngineCoreOutputs)
    assert before.outputs[0].request_id == running.request_id
    assert before.outputs[0].finish_reason is None
    assert fe.proc.poll() is None
    # ... and once nothing is left the process exits 0.
    fe.abort([running.request_id])
    assert fe.wait_exit(5) == 0


def test_internal_request_types(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn()
    fe.send_raw([b"\x05", b"\x90"])  # WAKEUP: ignored
    assert fe.call("is_sleeping") == (None, False)
    fe.send_raw([b"\x04", b"\x90"])  # EXECUTOR_FAILED: fatal, like vLLM's busy loop
    assert isinstance(fe.recv(), EngineCoreDead)
    assert fe.wait_exit(10) == 1


def test_help_documents_every_fault_flag() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "trio_vllm.reference_engine", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    for flag in (
        "--die-after-steps",
        "--dead-after-steps",
        "--stall-after-steps",
        "--startup-delay",
        "--crash-on-startup",
        "--garbage-after-steps",
        "--fail-utility",
        "--output-delay-ms",
        "--step-interval-ms",
        "--control-address",
        "--firehose",
        "--protocol",
        "--input-address",
        "--output-address",
        "--device",
    ):
        assert flag in out


@pytest.mark.timeout(150)  # the tiny model's torch import: seconds idle, more under load
def test_cuda_without_a_gpu_fails_startup(spawn) -> None:  # type: ignore[no-untyped-def]
    import shutil

    if shutil.which("nvidia-smi"):
        pytest.skip("a GPU may be present; this checks the failure path")
    fe = spawn(["--device", "cuda"], model="tiny", start=False)
    fe._do_handshake = False
    fe.start()
    ident, _ = fe._recv(fe.handshake_sock, STARTUP_TIMEOUT, "HELLO")
    from trio_vllm.protocol import (
        EngineHandshakeMetadata,
        EngineZmqAddresses,
        encode_handshake_metadata,
    )

    fe.handshake_sock.send_multipart(
        [
            ident,
            encode_handshake_metadata(
                EngineHandshakeMetadata(EngineZmqAddresses(fe.input_addrs, fe.output_addrs))
            ),
        ]
    )
    assert fe.wait_exit(STARTUP_TIMEOUT) == 1
    assert "EngineCore failed to start." in fe.stderr()
    assert not fe.inputs[0].poll(0)  # nothing was sent


def test_dead_frame_follows_delayed_outputs(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--output-delay-ms", "300", "--dead-after-steps", "2"])
    rid = fe.add(request(PROMPT, max_tokens=100))
    first, second, last = fe.recv(), fe.recv(), fe.recv()
    assert isinstance(first, EngineCoreOutputs)
    assert isinstance(second, EngineCoreOutputs)
    assert [o.request_id for o in first.outputs + second.outputs] == [rid, rid]
    assert isinstance(last, EngineCoreDead)
    assert fe.wait_exit(10) == 1
