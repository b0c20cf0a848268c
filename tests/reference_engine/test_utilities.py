"""Every utility of PROTOCOL.md §6.3 against a real engine process."""

from __future__ import annotations

import os
import time

import pytest

from trio_vllm.protocol import EngineCoreOutputs, LoRARequest

from ._harness import Frontend, request

pytestmark = pytest.mark.timeout(60)

PROMPT = list(b"abcde")


def test_simple_utilities(spawn, tmp_path) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--max-loras", "2"])
    assert fe.call("get_supported_tasks") == (
        None,
        ["generate", "embed", "token_embed", "classify", "token_classify"],
    )
    assert fe.call("profile", True, "prefix", None, None) == (None, None)
    assert fe.call("profile", False) == (None, None)
    assert fe.call("reset_mm_cache") == (None, None)
    assert fe.call("reset_encoder_cache") == (None, None)
    assert fe.call("reset_prefix_cache") == (None, True)
    assert fe.call("reset_prefix_cache", True, False) == (None, True)
    assert fe.call("execute_dummy_batch") == (None, None)
    assert fe.call("get_weight_version") == (None, "default")
    assert fe.call("set_weight_version", "v2") == (None, None)
    assert fe.call("get_weight_version") == (None, "v2")
    r = fe.generate(request(PROMPT, max_tokens=2))
    assert r.tokens == PROMPT[:2]
    failure, sums = fe.call("compute_weight_checksums")
    assert failure is None
    assert isinstance(sums, list)
    assert len(sums) == 1
    assert fe.call("collective_rpc", "check_health", None, [], None) == (None, [None])
    failure, info = fe.call("collective_rpc", "reference_engine_info", None, [], None)
    assert failure is None
    assert info[0]["eos_token_id"] == 257
    assert info[0]["model"] == "echo"
    failure, _ = fe.call("collective_rpc", "no_such_method", None, [], None)
    assert failure == (
        "Call to collective_rpc method failed: 'Worker' object has no attribute 'no_such_method'"
    )
    failure, meta = fe.call("get_kv_cache_group_metadata")
    assert failure is None
    assert meta[0]["block_size"] == 16
    assert fe.call("save_sharded_state", str(tmp_path / "shards")) == (None, None)
    assert os.listdir(tmp_path / "shards")
    failure, _ = fe.call("no_such_method")
    assert (
        failure == "Call to no_such_method method failed: 'EngineCoreProc' object has no "
        "attribute 'no_such_method'"
    )
    failure, _ = fe.call("reset_mm_cache", 1, 2)  # more args than parameters
    assert failure == "Call to reset_mm_cache method failed: "
    # Any exception inside a utility comes back as a failure; the engine carries on.
    failure, _ = fe.call("wake_up", 5)
    assert failure is not None
    assert failure.startswith("Call to wake_up method failed: ")
    failure, _ = fe.call("collective_rpc", "echo", None, [1], {"unexpected": 1})
    assert failure is not None
    assert fe.call("collective_rpc", "echo", None, [1, "a"], None) == (None, [[1, "a"]])
    failure, _ = fe.call("reinitialize_distributed", {})
    assert failure is not None
    assert failure.startswith("Call to reinitialize_distributed")


@pytest.mark.parametrize("protocol", ["0.25.1", "0.32.0", "0.33.0"])
def test_lora_bookkeeping(spawn, protocol: str) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--max-loras", "2"], protocol=protocol)
    if protocol != "0.25.1":  # 0.25.1's ready response has no LoRA keys
        assert fe.ready_response.supports_lora is True
        assert fe.ready_response.max_loras == 2
    a = LoRARequest("a", 1, "/loras/a")
    b = LoRARequest("b", 2, "/loras/b")
    c = LoRARequest("c", 3, "/loras/c")
    assert fe.call("add_lora", a) == (None, True)
    assert fe.call("add_lora", a) == (None, False)  # already loaded
    assert fe.call("add_lora", b) == (None, True)
    assert fe.call("list_loras") == (None, [1, 2])
    assert fe.call("pin_lora", 1) == (None, True)
    failure, _ = fe.call("pin_lora", 9)
    assert failure == "Call to pin_lora method failed: Pinning failed. LoRA 9 is not registered."
    assert fe.call("add_lora", c) == (None, True)  # evicts the unpinned adapter 2
    assert fe.call("list_loras") == (None, [1, 3])
    assert fe.call("remove_lora", 3) == (None, True)
    assert fe.call("remove_lora", 3) == (None, False)
    # A request with an adapter loads it on demand and shows up in the LoRA stats.
    r = fe.generate(request(PROMPT, max_tokens=2, lora_request=b))
    assert r.tokens == PROMPT[:2]
    assert fe.call("list_loras") == (None, [1, 2])


def test_lora_disabled(echo_engine: Frontend, spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn()
    assert fe.ready_response.supports_lora is False
    failure, _ = fe.call("list_loras")
    assert failure is not None
    assert "LoRA is not enabled" in failure


def test_pause_modes_and_resume(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn()
    # keep: requests freeze in place and continue after resume.
    long = request(PROMPT, max_tokens=900_000)  # minutes: still running at the abort below
    fe.add(long)
    out = fe.recv()
    assert isinstance(out, EngineCoreOutputs)
    assert fe.call("pause_scheduler", "keep", False) == (None, None)
    assert fe.call("is_scheduler_paused") == (None, True)
    fe.pending.clear()
    while not fe.no_output(0.2):
        fe.recv()  # drain what was in flight
    assert fe.no_output(0.3)  # frozen
    queued = request(PROMPT, max_tokens=3)
    fe.add(queued)  # accepted and queued while paused
    assert fe.no_output(0.3)
    assert fe.call("resume_scheduler") == (None, None)
    assert fe.call("is_scheduler_paused") == (None, False)
    assert fe.collect([queued.request_id])[queued.request_id].tokens == PROMPT[:3]
    # abort: every request is finished as ABORT (outputs + finished_requests), then paused.
    call_id = fe.send_call("pause_scheduler", "abort", True)
    aborted = fe.collect([long.request_id])[long.request_id]
    assert aborted.finish_reason == 2
    assert aborted.outputs[-1].new_token_ids == []
    assert fe.wait_reply(call_id) == (None, None)
    assert fe.call("is_scheduler_paused") == (None, True)
    fe.call("resume_scheduler")
    # wait: the reply comes only once in-flight requests finished.
    r = request(PROMPT, max_tokens=40)
    fe.add(r)
    first = fe.recv()  # running now; a request still waiting would stay queued
    assert isinstance(first, EngineCoreOutputs)
    fe.pending.append(first)
    call_id = fe.send_call("pause_scheduler", "wait", False)
    got = fe.collect([r.request_id])[r.request_id]
    assert got.finish_reason == 1
    assert len(got.tokens) == 40
    assert fe.wait_reply(call_id) == (None, None)
    failure, _ = fe.call("pause_scheduler", "bogus")
    assert failure is not None
    assert failure.startswith("Call to pause_scheduler method failed")
    fe.call("resume_scheduler")


def test_sleep_and_wake_up(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(model="tiny", args=["--device", "cpu"])
    before = fe.generate(request(PROMPT, max_tokens=6)).tokens
    assert fe.call("is_sleeping") == (None, False)
    assert fe.call("sleep", 0) == (None, None)
    assert fe.call("is_sleeping") == (None, True)
    assert fe.call("is_scheduler_paused") == (None, True)
    assert fe.call("wake_up", ["scheduling"]) == (None, True)
    assert fe.call("is_sleeping") == (None, False)
    assert fe.call("sleep", 2, "abort") == (None, None)
    assert fe.call("is_sleeping") == (None, True)
    assert fe.call("wake_up", ["kv_cache"]) == (None, False)  # weights still asleep
    assert fe.call("wake_up") == (None, True)
    assert fe.generate(request(PROMPT, max_tokens=6)).tokens == before
    assert fe.call("sleep", 1) == (None, None)
    assert fe.call("wake_up", None) == (None, True)
    assert fe.generate(request(PROMPT, max_tokens=6)).tokens == before


def test_release_kv_cache_memory(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn()
    failure, _ = fe.call("release_kv_cache_memory")
    assert failure is not None  # needs a completed pause
    fe.call("pause_scheduler", "abort", True)
    assert fe.call("release_kv_cache_memory") == (None, None)
    assert fe.call("is_sleeping") == (None, True)
    assert fe.call("wake_up", ["kv_cache"]) == (None, True)


def test_utilities_by_protocol(spawn) -> None:  # type: ignore[no-untyped-def]
    old = spawn(protocol="0.25.1")
    assert old.call("wake_up") == (None, None)  # 0.25.1 returns nil
    failure, _ = old.call("get_weight_version")
    assert failure is not None  # not in 0.25.1
    failure, _ = old.call("profile", True, None, None, None)
    assert failure == "Call to profile method failed: "  # 0.25.1 takes two args
    new = spawn(protocol="0.33.0")
    assert new.call("pause_generation", "abort", False) == (None, None)
    r = request(PROMPT, max_tokens=3)
    got = new.collect([new.add(r)])[r.request_id]
    assert got.finish_reason == 3
    err = got.outputs[-1].error
    assert err is not None
    assert err.code == "engine_paused"
    assert err.retryable is True
    new.call("resume_scheduler")
    assert new.generate(request(PROMPT, max_tokens=3)).tokens == PROMPT[:3]


def test_deferred_replies_can_come_out_of_order(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn()
    # Minutes long, so it holds the pause until the abort below (60 tokens could be
    # done before the pause was read: the pause was then answered first).
    r = request(PROMPT, max_tokens=900_000)
    fe.add(r)
    fe.recv()
    slow = fe.send_call("pause_scheduler", "wait", False)
    fast = fe.send_call("get_weight_version")
    replies: list[int] = []
    deadline = time.monotonic() + 30
    while len(replies) < 2 and time.monotonic() < deadline:
        out = fe.recv()
        assert isinstance(out, EngineCoreOutputs)
        if out.utility_output is not None:
            replies.append(out.utility_output.call_id)
            if len(replies) == 1:
                fe.abort([r.request_id])  # nothing runs any more: the pause completes
    assert replies == [fast, slow]
