"""What the engine puts on the wire, per emulated release, compared with PROTOCOL.md."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from trio_vllm.protocol import EngineCoreOutputs, PoolingParams, profile_for_version

from ._harness import request

pytestmark = pytest.mark.timeout(60)

PROMPT = list(b"abcde")
PROTOCOLS = ["0.25.1", "0.32.0", "0.33.0"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_handshake_and_frames_per_protocol(spawn, protocol: str) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(protocol=protocol, index=3, transport="tcp")
    profile = profile_for_version(protocol)
    # HELLO / READY of a headless engine; the identity is the rank, 2 bytes LE (checked
    # by the harness); READY has no parallel_config_hash at DP size 1.
    assert (fe.hello.local, fe.hello.headless) == (False, True)
    assert (fe.ready.local, fe.ready.headless, fe.ready.parallel_config_hash) == (False, True, None)
    raw = msgspec.msgpack.decode(fe.ready_response_raw)
    assert list(raw) == list(profile.map_keys["EngineCoreReadyResponse"])
    assert raw["vllm_version"] == protocol
    if protocol == "0.25.1":
        assert "data_parallel_rank" not in raw
    else:
        assert raw["data_parallel_rank"] == 3

    rid = fe.add(request(PROMPT, max_tokens=3))
    frames = [fe.recv_raw() for _ in range(3)]
    expect_outputs = len(profile.layouts["EngineCoreOutputs"])
    expect_output = len(profile.layouts["EngineCoreOutput"])
    for f in frames:
        assert len(f) == 1  # no tensors, no aux frames
        top = msgspec.msgpack.decode(f[0])
        assert isinstance(top, list)
        assert len(top) == expect_outputs
        assert top[0] == 3  # engine_index = rank
        assert len(top[1]) == 1
        assert len(top[1][0]) == expect_output
        stats = top[2]
        assert isinstance(stats, dict)
        assert set(stats) == set(profile.map_keys["SchedulerStats"])
        if protocol != "0.25.1":
            assert top[8] == "default"  # weight_version on every step result
    decoded = [fe.codec.decode_outputs(f) for f in frames]
    tokens = [o.new_token_ids[0] for m in decoded for o in m.outputs]  # type: ignore[union-attr]
    assert tokens == PROMPT[:3]
    assert decoded[-1].outputs[0].finish_reason == 1  # type: ignore[union-attr]
    assert all(m.outputs[0].request_id == rid for m in decoded)  # type: ignore[union-attr]
    failure, value = fe.call("is_sleeping")
    assert (failure, value) == (None, False)
    # Tensors and arrays (logprobs, prompt logprobs, pooling) decode in every layout.
    r = fe.generate(request(PROMPT, max_tokens=2, logprobs=3, prompt_logprobs=2))
    first = r.outputs[0]
    assert first.new_logprobs is not None
    assert np.asarray(first.new_logprobs.logprob_token_ids).shape == (1, 4)
    assert first.new_prompt_logprobs_tensors is not None
    assert np.asarray(first.new_prompt_logprobs_tensors.logprobs).shape == (4, 3)
    pooled = fe.generate(request(PROMPT, pooling_params=PoolingParams(task="token_embed")))
    assert np.asarray(pooled.outputs[0].pooling_output).shape == (5, 64)
    embeds = np.zeros((20, 64), dtype=np.float32)  # 5 KiB: travels in an aux frame
    embeds[:, 0] = np.arange(65, 85)
    r = fe.generate(request(None, prompt_embeds=embeds, max_tokens=3))  # type: ignore[arg-type]
    assert r.tokens == [65, 66, 67]
    # A contained pre-processing error: ERROR, and in 0.33 a structured error.
    rid = fe.add(request([1, 2, 999], max_tokens=2), validate=False)
    err = fe.collect([rid])[rid]
    assert err.finish_reason == 3
    if protocol == "0.33.0":
        assert err.outputs[-1].error is not None
        assert err.outputs[-1].error.code == "validation_error"
    else:
        assert err.outputs[-1].error is None


def test_message_shape_matches_stock_vllm(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn()
    rid = fe.add(request(PROMPT, max_tokens=4, trace_headers={"traceparent": "x"}))
    msgs: list[EngineCoreOutputs] = []
    while len(msgs) < 4:
        out = fe.recv()
        assert isinstance(out, EngineCoreOutputs)
        msgs.append(out)
    outs = [m.outputs[0] for m in msgs]
    # Events: QUEUED then SCHEDULED, on the first output only, monotonic timestamps.
    assert [int(e.type) for e in outs[0].events] == [1, 2]
    assert outs[0].events[0].timestamp <= outs[0].events[1].timestamp <= msgs[0].timestamp
    assert all(o.events is None for o in outs[1:])
    # prefill_stats on the first output only.
    assert outs[0].prefill_stats is not None
    assert outs[0].prefill_stats.num_prompt_tokens == 5
    assert all(o.prefill_stats is None for o in outs[1:])
    # Stats on every step; counters are per-step snapshots; finish LENGTH, no stop_reason.
    assert all(m.scheduler_stats is not None for m in msgs)
    assert msgs[0].scheduler_stats.num_running_reqs == 1  # type: ignore[union-attr]
    assert msgs[-1].scheduler_stats.num_running_reqs == 0  # type: ignore[union-attr]
    assert msgs[0].scheduler_stats.prefix_cache_stats.queries == 5  # type: ignore[union-attr]
    assert msgs[1].scheduler_stats.prefix_cache_stats.queries == 0  # type: ignore[union-attr]
    assert [int(o.finish_reason) if o.finish_reason is not None else None for o in outs] == [
        None,
        None,
        None,
        1,
    ]
    assert all(o.trace_headers == {"traceparent": "x"} for o in outs)
    assert all(o.request_id == rid and o.num_nans_in_logits == 0 for o in outs)
    # DP=1 without a coordinator: finished_requests stays nil on normal finishes.
    assert all(m.finished_requests is None for m in msgs)
    assert all(m.utility_output is None and m.wave_complete is None for m in msgs)
    timestamps = [m.timestamp for m in msgs]
    assert timestamps == sorted(timestamps)
    # Utility replies carry no stats, no weight_version and no outputs.
    call_id = fe.send_call("is_sleeping")
    out = fe.recv()
    assert isinstance(out, EngineCoreOutputs)
    assert out.utility_output is not None
    assert out.utility_output.call_id == call_id
    assert out.outputs == []
    assert out.scheduler_stats is None
    assert out.weight_version is None
    # An idle engine sends nothing.
    assert fe.no_output(0.5)


def test_prefix_cache_hits_show_in_stats(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn()
    prompt = list(range(40, 80))  # 40 tokens: two full 16-token blocks
    fe.generate(request(prompt, max_tokens=1))
    rid = fe.add(request(prompt, max_tokens=1))
    out = fe.recv()
    assert isinstance(out, EngineCoreOutputs)
    assert out.outputs[0].request_id == rid
    assert out.outputs[0].prefill_stats.num_cached_tokens == 32  # type: ignore[union-attr]
    assert out.scheduler_stats.prefix_cache_stats.hits == 32  # type: ignore[union-attr]
    assert fe.call("reset_prefix_cache") == (None, True)
    rid = fe.add(request(prompt, max_tokens=1))
    out = fe.recv()
    assert out.scheduler_stats.prefix_cache_stats.reset is True  # type: ignore[union-attr]
    assert out.outputs[0].prefill_stats.num_cached_tokens == 0  # type: ignore[union-attr]


def test_disable_log_stats(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--disable-log-stats"])
    r = fe.generate(request(PROMPT, max_tokens=3))
    assert all(o.events is None and o.prefill_stats is None for o in r.outputs)
    fe.add(request(PROMPT, max_tokens=2))
    out = fe.recv()
    assert isinstance(out, EngineCoreOutputs)
    assert out.scheduler_stats is None


def test_direct_mode_and_local_flag(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(direct=True)
    assert fe.ready_response is not None
    assert fe.ready_response.vllm_version == "0.32.0"
    assert fe.generate(request(PROMPT, max_tokens=3)).tokens == PROMPT[:3]
    local = spawn(["--local"])
    assert (local.hello.local, local.hello.headless) == (True, False)
    assert (local.ready.local, local.ready.headless) == (True, False)


def test_dp_rank_ready_hash(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--data-parallel-size", "2"], index=1)
    assert fe.ready.parallel_config_hash is not None
    assert fe.ready_response.data_parallel_size == 2
    assert fe.ready_response.data_parallel_rank == 1
