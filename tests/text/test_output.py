"""Output processing: output kinds, n > 1, logprobs, stop-string aborts (no engine)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from trio_vllm.protocol import (
    EngineCoreOutput,
    FinishReason,
    LogprobsLists,
    LogprobsTensors,
    RequestOutputKind,
    SamplingParams,
)
from trio_vllm.protocol.structs import PrefillStats
from trio_vllm.text import InputProcessor, OutputProcessor, ProcessedRequest, Tokenizer

K = RequestOutputKind


def _setup(
    tok: Tokenizer, prompt: str = "Say: ", **params: Any
) -> tuple[ProcessedRequest, OutputProcessor]:
    inp = InputProcessor(tok, max_model_len=512, generation_config={"eos_token_id": [2, 4]})
    processed = inp.process_inputs("req", prompt, SamplingParams(max_tokens=64, **params))
    out = OutputProcessor(tok)
    processed.register(out)
    return processed, out


def _eco(
    rid: str, ids: list[int], finish: FinishReason | None = None, **kw: Any
) -> EngineCoreOutput:
    return EngineCoreOutput(rid, new_token_ids=ids, finish_reason=finish, **kw)


def _feed(tok: Tokenizer, kind: K, text: str) -> list[Any]:
    processed, out = _setup(tok, output_kind=kind)
    (rid,) = processed.engine_request_ids
    ids = tok.encode(text, add_special_tokens=False)
    results = []
    for i, token_id in enumerate(ids):
        last = i == len(ids) - 1
        res = out.process_outputs([_eco(rid, [token_id], FinishReason.LENGTH if last else None)])
        assert res.reqs_to_abort == []
        results.extend(res.request_outputs)
    assert not out.has_unfinished_requests()
    return results


def test_cumulative_delta_final_only(tiny: Tokenizer) -> None:
    text = "Hi 你好 😀!"
    n_tokens = len(tiny.encode(text, add_special_tokens=False))
    cumulative = _feed(tiny, K.CUMULATIVE, text)
    assert len(cumulative) == n_tokens
    assert cumulative[-1].outputs[0].text == text
    assert all(len(o.outputs[0].token_ids) == i + 1 for i, o in enumerate(cumulative))
    delta = _feed(tiny, K.DELTA, text)
    assert "".join(o.outputs[0].text for o in delta) == text
    assert sum(len(o.outputs[0].token_ids) for o in delta) == n_tokens
    final = _feed(tiny, K.FINAL_ONLY, text)
    assert len(final) == 1
    (only,) = final
    assert only.finished
    assert only.request_id == "req"  # the caller's id, not the engine's
    assert only.prompt == "Say: "
    assert only.outputs[0].text == text
    assert only.outputs[0].finish_reason == "length"
    assert only.outputs[0].stop_reason is None
    assert [o.finished for o in cumulative] == [False] * (n_tokens - 1) + [True]


def test_stop_string_finishes_and_asks_for_an_abort(tiny: Tokenizer) -> None:
    processed, out = _setup(tiny, stop=["world"], output_kind=K.DELTA)
    (rid,) = processed.engine_request_ids
    ids = tiny.encode("hello world and more", add_special_tokens=False)
    res = out.process_outputs([_eco(rid, ids)])  # one step with every token
    assert res.reqs_to_abort == [rid]
    (ro,) = res.request_outputs
    assert ro.finished
    c = ro.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("hello ", "stop", "world")
    assert "more" not in tiny.decode(c.token_ids)  # tokens after the match are dropped
    assert not out.has_request(rid)
    # A late output of the aborted request is ignored.
    assert out.process_outputs([_eco(rid, ids[:1])]).request_outputs == []


def test_engine_finished_stop_needs_no_abort(tiny: Tokenizer) -> None:
    processed, out = _setup(tiny, output_kind=K.FINAL_ONLY)
    (rid,) = processed.engine_request_ids
    ids = tiny.encode("ok", add_special_tokens=False)
    res = out.process_outputs([_eco(rid, [*ids, 4], FinishReason.STOP, stop_reason=4)])
    assert res.reqs_to_abort == []
    c = res.request_outputs[0].outputs[0]
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == ("ok", [*ids, 4], "stop", 4)


def test_n2_children_seeds_and_gathering(tiny: Tokenizer) -> None:
    for kind in K:
        processed, out = _setup(tiny, n=2, seed=10, temperature=1.0, output_kind=kind)
        assert processed.parent is not None
        a, b = processed.requests
        assert a.request_id == f"0_{processed.request_id}"
        assert b.request_id == f"1_{processed.request_id}"
        assert processed.request_id.startswith("req-")
        assert (a.sampling_params.seed, b.sampling_params.seed) == (10, 11)  # type: ignore[union-attr]
        assert a.sampling_params.n == b.sampling_params.n == 1  # type: ignore[union-attr]
        assert a.external_req_id == b.external_req_id == "req"
        x = tiny.encode("ab", add_special_tokens=False)
        r1 = out.process_outputs([_eco(b.request_id, x, FinishReason.LENGTH)])
        r2 = out.process_outputs([_eco(a.request_id, x[:1])])
        r3 = out.process_outputs([_eco(a.request_id, x[1:], FinishReason.LENGTH)])
        if kind == K.FINAL_ONLY:
            assert r1.request_outputs == r2.request_outputs == []
            (final,) = r3.request_outputs
            assert [c.index for c in final.outputs] == [0, 1]
            assert final.finished
        else:
            (o1,) = r1.request_outputs
            assert [c.index for c in o1.outputs] == [1]
            assert not o1.finished  # child 0 still runs
            assert r3.request_outputs[0].finished
            assert r3.request_outputs[0].request_id == "req"
        assert not out.has_unfinished_requests()
        assert out.parent_requests == {}


def test_seedless_n2_children_share_params(tiny: Tokenizer) -> None:
    processed, _ = _setup(tiny, n=3, temperature=1.0)
    seeds = {r.sampling_params.seed for r in processed.requests}  # type: ignore[union-attr]
    assert seeds == {None}
    assert len(processed.requests) == 3


def test_abort_by_external_id_gives_final_abort_outputs(tiny: Tokenizer) -> None:
    processed, out = _setup(tiny, n=2, temperature=1.0, output_kind=K.FINAL_ONLY)
    res = out.abort_requests(["req"], internal=False)
    assert sorted(res.reqs_to_abort) == sorted(processed.engine_request_ids)
    (final,) = res.request_outputs
    assert [c.finish_reason for c in final.outputs] == ["abort", "abort"]
    assert not out.has_unfinished_requests()
    assert out.parent_requests == {}
    processed, out = _setup(tiny, n=2, temperature=1.0, output_kind=K.DELTA)
    res = out.abort_requests([processed.request_id], internal=True)  # the parent id
    assert sorted(res.reqs_to_abort) == sorted(processed.engine_request_ids)
    assert len(res.request_outputs) == 2
    assert out.abort_requests(["nothing"], internal=False).reqs_to_abort == []


def test_logprobs_with_decoded_tokens_and_cumulative(tiny: Tokenizer) -> None:
    processed, out = _setup(tiny, logprobs=1, prompt_logprobs=1, output_kind=K.DELTA)
    (rid,) = processed.engine_request_ids
    ids = tiny.encode("😀 a", add_special_tokens=False)
    other = tiny.encode("b", add_special_tokens=False)[0]
    prompt = processed.prompt_token_ids
    rows = len(prompt) - 1
    plp = LogprobsTensors(
        np.array([[t, other] for t in prompt[1:]], dtype=np.int32),
        np.full((rows, 2), -0.5, dtype=np.float32),
        np.ones(rows, dtype=np.int32),
    )
    collected = []
    for i, token_id in enumerate(ids):
        lp = LogprobsLists(
            np.array([[token_id, other]], dtype=np.int32),
            np.array([[-0.25, -1.0]], dtype=np.float32),
            np.array([3], dtype=np.int32),
        )
        res = out.process_outputs(
            [
                _eco(
                    rid,
                    [token_id],
                    new_logprobs=lp,
                    new_prompt_logprobs_tensors=plp if i == 0 else None,
                    prefill_stats=PrefillStats(num_cached_tokens=2) if i == 0 else None,
                )
            ]
        )
        collected.extend(res.request_outputs)
    first = collected[0]
    assert first.prompt_logprobs is not None
    assert first.prompt_logprobs[0] is None
    assert len(first.prompt_logprobs) == len(prompt)
    assert first.num_cached_tokens == 2
    assert all(not o.prompt_logprobs for o in collected[1:])  # DELTA: given once
    positions = [p for o in collected for p in (o.outputs[0].logprobs or [])]
    assert len(positions) == len(ids)
    sampled = [next(iter(p.items())) for p in positions]
    assert [tid for tid, _ in sampled] == ids
    assert all(lp.rank == 3 and lp.logprob == -0.25 for _, lp in sampled)
    assert all(p[other].rank == 1 for p in positions)
    # The emoji's byte tokens: the last one carries the character (vLLM's correction).
    decoded = "".join(lp.decoded_token or "" for _, lp in sampled)
    assert decoded == "😀 a"
    assert collected[-1].outputs[0].cumulative_logprob == pytest.approx(-0.25 * len(ids))


def test_stream_interval(tiny: Tokenizer) -> None:
    processed, out = _setup(tiny, stream_interval=3, output_kind=K.DELTA)
    (rid,) = processed.engine_request_ids
    ids = tiny.encode("abcdefg", add_special_tokens=False)[:1] * 7
    sizes = []
    for i, token_id in enumerate(ids):
        finish = FinishReason.LENGTH if i == len(ids) - 1 else None
        for o in out.process_outputs([_eco(rid, [token_id], finish)]).request_outputs:
            sizes.append(len(o.outputs[0].token_ids))
    assert sizes == [1, 3, 3]  # the first token, then every third, then the rest at the end
