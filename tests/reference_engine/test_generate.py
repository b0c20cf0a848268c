"""Generation through a real engine process: exact echo outputs, stop conditions, abort,
batching, logprobs, sampling, pooling, prompt embeddings, error outputs."""

from __future__ import annotations

import time

import numpy as np
import pytest

from trio_vllm.protocol import EngineCoreOutputs, PoolingParams
from trio_vllm.reference_engine import EOS_TOKEN_ID, HIDDEN_SIZE, echo_continuation

from ._harness import Frontend, request

pytestmark = pytest.mark.timeout(60)

PROMPT = list(b"abcde")


def test_echo_exact_tokens_and_length(echo_engine: Frontend) -> None:
    r = echo_engine.generate(request(PROMPT, max_tokens=12))
    assert r.tokens == echo_continuation(PROMPT, 12)
    assert r.tokens == list(b"abcdeabcdeab")
    assert r.finish_reason == 1  # LENGTH
    assert r.stop_reason is None
    # One token per step: every output carries exactly one new token.
    assert [len(o.new_token_ids) for o in r.outputs] == [1] * 12


def test_stop_token_ids(echo_engine: Frontend) -> None:
    r = echo_engine.generate(request(PROMPT, max_tokens=20, stop_token_ids=[ord("d")]))
    assert r.tokens == list(b"abcd")  # the stop token is included
    assert r.finish_reason == 0  # STOP
    assert r.stop_reason == ord("d")


def test_eos_and_ignore_eos(echo_engine: Frontend) -> None:
    prompt = [*b"xy", EOS_TOKEN_ID, *b"z"]
    r = echo_engine.generate(
        request(
            prompt, max_tokens=10, _eos_token_id=EOS_TOKEN_ID, _all_stop_token_ids={EOS_TOKEN_ID}
        )
    )
    assert r.tokens == [*b"xy", EOS_TOKEN_ID]
    assert r.finish_reason == 0
    assert r.stop_reason is None  # EOS: no stop_reason
    r = echo_engine.generate(
        request(prompt, max_tokens=6, ignore_eos=True, _eos_token_id=EOS_TOKEN_ID)
    )
    assert r.tokens == echo_continuation(prompt, 6)
    assert r.finish_reason == 1
    # Without _eos_token_id the engine never stops on EOS (PROTOCOL.md §4.3).
    r = echo_engine.generate(request(prompt, max_tokens=5))
    assert r.tokens == echo_continuation(prompt, 5)


def test_min_tokens_suppresses_stop_ids(echo_engine: Frontend) -> None:
    prompt = list(b"ab")
    # Without min_tokens the stop id 'a' ends the request at once.
    r = echo_engine.generate(request(prompt, max_tokens=8, stop_token_ids=[ord("a")]))
    assert r.tokens == [ord("a")]
    # With min_tokens=3 'a' is masked for the first three tokens: the echo model's only
    # likely token is gone, so greedy takes the lowest id of the rest (0).
    r = echo_engine.generate(request(prompt, max_tokens=8, min_tokens=3, stop_token_ids=[ord("a")]))
    # Echo continues from the sequence (s[n mod 2]); 'a' is allowed again from token 4.
    assert r.tokens == [0, ord("b"), 0, ord("b"), ord("a")]
    assert (r.finish_reason, r.stop_reason) == (0, ord("a"))


def test_abort_mid_generation(echo_engine: Frontend) -> None:
    keep = request(PROMPT, max_tokens=30)
    victim = request(PROMPT, max_tokens=900_000)  # minutes: still running at the abort
    echo_engine.add(victim)
    echo_engine.add(keep)
    seen = 0
    while seen < 5:
        out = echo_engine.recv()
        assert isinstance(out, EngineCoreOutputs)
        echo_engine.pending.append(out)
        seen += sum(o.request_id == victim.request_id for o in out.outputs)
    echo_engine.abort([victim.request_id, "no-such-request"])
    got = echo_engine.collect([keep.request_id])
    assert got[keep.request_id].tokens == echo_continuation(PROMPT, 30)
    # A client abort produces no output for the request (PROTOCOL.md §3.4): after the
    # abort is processed nothing more arrives for it, and it never finishes.
    echo_engine.pending.clear()
    while not echo_engine.no_output(0.3):
        out = echo_engine.recv()
        assert isinstance(out, EngineCoreOutputs)
        for o in out.outputs:
            assert o.request_id != victim.request_id or o.finish_reason is None
    ok, _value = echo_engine.call("get_supported_tasks")
    assert ok is None


def test_continuous_batching_and_limits(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--max-num-seqs", "2", "--max-num-batched-tokens", "8"])
    reqs = [request(list(bytes([65 + i])) * 6, max_tokens=4) for i in range(4)]
    for r in reqs:
        fe.add(r)
    got = fe.collect([r.request_id for r in reqs])
    for r in reqs:
        assert got[r.request_id].tokens == echo_continuation(r.prompt_token_ids, 4)
    # Scheduler stats show the running set never exceeded max_num_seqs.
    assert fe.ready_response.max_num_seqs == 2
    # Long prompt: chunked over several steps (budget 8), still exactly right.
    long = request(list(range(40, 90)), max_tokens=3)
    r = fe.generate(long)
    assert r.tokens == echo_continuation(long.prompt_token_ids, 3)
    assert r.outputs[0].prefill_stats is not None
    assert r.outputs[0].prefill_stats.num_prompt_tokens == 50


def test_stats_respect_max_num_seqs(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--max-num-seqs", "2"])
    reqs = [request(list(b"hello"), max_tokens=5) for _ in range(5)]
    # All five are in before the first step, whatever the machine's speed (the engine
    # could otherwise finish the first two before the last ones arrive): the scheduler
    # is paused while they go in, on the same socket, so in that order.
    assert fe.call("pause_scheduler", "keep") == (None, None)
    for r in reqs:
        fe.add(r)
    assert fe.call("resume_scheduler") == (None, None)
    open_ids = {r.request_id for r in reqs}
    max_running = 0
    waiting_seen = 0
    while open_ids:
        out = fe.recv()
        assert isinstance(out, EngineCoreOutputs)
        if out.scheduler_stats is not None:
            max_running = max(max_running, out.scheduler_stats.num_running_reqs)
            waiting_seen = max(waiting_seen, out.scheduler_stats.num_waiting_reqs)
        for o in out.outputs:
            if o.finish_reason is not None:
                open_ids.discard(o.request_id)
    assert max_running == 2
    assert waiting_seen >= 1


def test_logprobs_and_prompt_logprobs(echo_engine: Frontend) -> None:
    r = echo_engine.generate(request(PROMPT, max_tokens=3, logprobs=2, prompt_logprobs=1))
    first = r.outputs[0]
    lp = first.new_logprobs
    assert lp is not None
    ids = np.asarray(lp.logprob_token_ids)
    vals = np.asarray(lp.logprobs)
    assert ids.shape == (1, 3)
    assert vals.shape == (1, 3)
    assert ids[0, 0] == ord("a")
    assert ids[0, 1] == ord("a")
    assert vals[0, 0] == pytest.approx(0.0, abs=1e-4)
    assert vals[0, 2] < -90
    assert list(np.asarray(lp.sampled_token_ranks)) == [1]
    plp = first.new_prompt_logprobs_tensors
    assert plp is not None
    pids = np.asarray(plp.logprob_token_ids)
    assert pids.shape == (len(PROMPT) - 1, 2)
    assert list(pids[:, 0]) == PROMPT[1:]
    # Prompt logprobs come only with the first output.
    assert all(o.new_prompt_logprobs_tensors is None for o in r.outputs[1:])
    assert all(o.new_logprobs is not None for o in r.outputs)


def test_seeded_sampling_is_reproducible(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(model="tiny", args=["--device", "cpu"])

    def run(seed: int | None) -> list[int]:
        return fe.generate(request(PROMPT, max_tokens=12, temperature=1.0, seed=seed)).tokens

    a, b = run(7), run(7)
    assert a == b
    assert run(8) != a or run(9) != a
    # Greedy is deterministic too and differs from sampling at temperature 2 (seeded).
    g1 = fe.generate(request(PROMPT, max_tokens=12)).tokens
    g2 = fe.generate(request(PROMPT, max_tokens=12)).tokens
    assert g1 == g2
    topk1 = fe.generate(request(PROMPT, max_tokens=12, temperature=1.5, top_k=1, seed=3)).tokens
    assert topk1 == g1  # top_k=1 is greedy whatever the temperature


def test_tiny_greedy_identical_across_runs(spawn) -> None:  # type: ignore[no-untyped-def]
    outputs = []
    engines = [
        spawn(model="tiny", args=["--device", "cpu", "--seed", "5"], start=False) for _ in range(2)
    ]
    for fe in engines:
        fe.start()
    for fe in engines:
        reqs = [
            request(list(b"the quick brown fox"), max_tokens=16),
            request(list(b"hello"), max_tokens=16),
        ]
        for r in reqs:
            fe.add(r)
        got = fe.collect([r.request_id for r in reqs])
        outputs.append([got[r.request_id].tokens for r in reqs])
    assert outputs[0] == outputs[1]
    assert outputs[0][0] != outputs[0][1]
    assert all(0 <= t < 260 for row in outputs[0] for t in row)


def test_pooling_embed(echo_engine: Frontend) -> None:
    req = request(list(b"ab"), pooling_params=PoolingParams(task="embed"))
    r = echo_engine.generate(req)
    assert r.finish_reason == 0
    assert r.tokens == []
    out = np.asarray(r.outputs[0].pooling_output)
    expected = np.zeros(HIDDEN_SIZE, dtype=np.float32)
    expected[ord("b") % HIDDEN_SIZE] = 1.0  # last-token pooling of the one-hot state
    assert np.allclose(out, expected)
    req = request(
        list(b"ab"),
        pooling_params=PoolingParams(task="token_embed", dimensions=8, use_activation=False),
    )
    out = np.asarray(echo_engine.generate(req).outputs[0].pooling_output)
    assert out.shape == (2, 8)


def test_prompt_embeds(echo_engine: Frontend) -> None:
    embeds = np.zeros((3, HIDDEN_SIZE), dtype=np.float32)
    embeds[:, 0] = [ord("x"), ord("y"), ord("z")]
    req = request(None, prompt_embeds=embeds, max_tokens=5)  # type: ignore[arg-type]
    r = echo_engine.generate(req)
    assert r.tokens == list(b"xyzxy")


def test_preprocessing_errors_finish_with_error(echo_engine: Frontend) -> None:
    bad = request([1, 2, 300], max_tokens=3)  # token outside the vocabulary
    rid = echo_engine.add(bad, validate=False)
    r = echo_engine.collect([rid])[rid]
    assert r.finish_reason == 3
    assert r.tokens == []
    # The engine keeps serving.
    assert echo_engine.generate(request(PROMPT, max_tokens=2)).tokens == PROMPT[:2]


def test_two_clients_routed_by_client_index(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(clients=2)
    r0 = request(list(b"zero"), max_tokens=3, client_index=0)
    r1 = request(list(b"one"), max_tokens=3, client_index=1)
    fe.add(r0, client=0)
    fe.add(r1, client=1)
    assert fe.collect([r0.request_id], client=0)[r0.request_id].tokens == list(b"zer")
    assert fe.collect([r1.request_id], client=1)[r1.request_id].tokens == list(b"one")
    failure, value = fe.call("get_weight_version", client=1)
    assert (failure, value) == (None, "default")


def test_max_model_len(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--max-model-len", "16"])
    assert fe.ready_response.max_model_len == 16
    r = fe.generate(request(list(range(40, 50)), max_tokens=100))
    assert r.tokens == echo_continuation(list(range(40, 50)), 6)  # 10 + 6 = 16
    assert r.finish_reason == 1
    too_long = request(list(range(40, 56)), max_tokens=2)  # not shorter than the limit
    rid = fe.add(too_long, validate=False)
    assert fe.collect([rid])[rid].finish_reason == 3


def test_preemption_keeps_outputs_exact(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--num-gpu-blocks", "6", "--block-size", "4"])
    reqs = [request(list(bytes([65 + i])) * 8, max_tokens=12) for i in range(3)]
    for r in reqs:
        fe.add(r)
    got = fe.collect([r.request_id for r in reqs])
    events = []
    for r in reqs:
        assert got[r.request_id].tokens == echo_continuation(r.prompt_token_ids, 12)
        events += [int(e.type) for o in got[r.request_id].outputs for e in (o.events or [])]
    assert 3 in events  # PREEMPTED: blocks ran out and a request was recomputed


def test_request_that_never_fits_does_not_spin(spawn) -> None:  # type: ignore[no-untyped-def]
    fe = spawn(["--num-gpu-blocks", "2", "--block-size", "4"])
    big = request(list(range(40, 60)), max_tokens=2)  # needs 5 blocks of 4, has 2
    fe.add(big)
    assert fe.no_output(0.5)  # waits; sends no empty steps
    with open(f"/proc/{fe.proc.pid}/stat") as f:
        ticks = sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])
    time.sleep(1.0)
    with open(f"/proc/{fe.proc.pid}/stat") as f:
        assert sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13]) - ticks < 20
    fe.abort([big.request_id])
    assert fe.generate(request(list(b"ab"), max_tokens=2)).tokens == list(b"ab")
