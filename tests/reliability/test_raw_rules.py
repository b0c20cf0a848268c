"""Nothing a stock engine could die on leaves the raw client, at any raw entry point
(issue 23, part 3).

The values the issue found going out (top_p 0, 1.5 or NaN, min_p NaN, top_k -2 or 2**70,
a prompt id 2**63; at temperature 0 too, where vLLM checks them before greedy sampling
resets them) and the example of every rule of the table that protects the engine go
through each raw entry point; each refuses them before anything is sent, with the
table's message:

* ``make_request`` (its keywords, or a ``SamplingParams``) and ``prepare_sampling_params``;
* the codec's ``encode_add`` (what the in-process adapter sends through);
* ``client.add_request``, ``client.generate``, ``add_request(rank=1)`` and a request
  pinned with ``data_parallel_rank`` on two data-parallel peers, which must receive no
  ADD (the client stays usable);
* ``SyncClient.add_request`` and ``SyncClient.generate`` on a reference engine, which
  then serves a good request and nothing else;
* the ``add_lora`` utility, for a LoRA reference.
"""

from __future__ import annotations

import math
import time
from typing import Any

import anyio
import msgspec
import pytest

from trio_vllm import (
    ClientCodec,
    EngineCoreClient,
    EngineCoreRequest,
    InvalidRequestError,
    LoRARequest,
    ReferenceEngines,
    SamplingParams,
    SyncClient,
    make_request,
    prepare_sampling_params,
)
from trio_vllm.protocol import newest_profile
from trio_vllm.protocol import rules as R
from trio_vllm.protocol.validation import check_request

from ._peer import peers_client

pytestmark = pytest.mark.timeout(300)

GOOD = [1, 2, 3]
# What the raw clients below know: a context of 256, the echo vocabulary, no LoRA.
LIMITS = R.Limits(max_model_len=256, vocab_size=260, num_clients=1, supports_lora=False)
# The issue's values: (keywords for make_request / SamplingParams, vLLM's text, the
# temperatures it is refused at: vLLM checks before greedy sampling resets top_p, top_k
# and min_p, and a huge top_k is then harmless, reset to 0).
ISSUE_VALUES: list[tuple[dict[str, Any], str, tuple[float, ...]]] = [
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)", (1.0, 0.0)),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5. (parameter=top_p, value=1.5)", (1.0, 0.0)),
    ({"top_p": math.nan}, "top_p must be in (0, 1], got nan. (parameter=top_p, value=nan)",
     (1.0, 0.0)),
    ({"min_p": math.nan}, "min_p must be in [0, 1], got nan.", (1.0, 0.0)),
    ({"top_k": -2}, "top_k must be 0 (disable), or at least 1, got -2.", (1.0, 0.0)),
    ({"top_k": 2**70}, f"top_k must be between -2**63 and 2**64 - 1, got {2**70}.", (1.0,)),
]  # fmt: skip
BAD_PROMPT = ([1, 2**63], "Token id 9223372036854775808 is out of vocabulary")


def _sampling_cases() -> list[tuple[str, SamplingParams, str]]:
    """(name, params, the message) for the issue's values, at temperature 1 and 0, and
    for the example of every engine-protecting rule over a SamplingParams."""
    cases = []
    for fields, message, temperatures in ISSUE_VALUES:
        for temperature in temperatures:
            params = SamplingParams(max_tokens=4, temperature=temperature, **fields)
            cases.append((f"{fields} t={temperature}", params, message))
    for family in (R.SAMPLING, R.SAMPLING_LIMITS, R.SAMPLING_WIRE, R.SAMPLING_RAW):
        for rule in family:
            params = family.example_subject(rule)
            violation = family.check(params, LIMITS)
            if rule.engine and violation is not None:
                cases.append((rule.name, params, str(violation)))
    for rule in R.STRUCTURED:
        params = SamplingParams(max_tokens=4, structured_outputs=R.STRUCTURED.example_subject(rule))
        violation = R.STRUCTURED.check(params.structured_outputs, LIMITS)  # type: ignore[arg-type]
        if rule is R.STRUCTURED["backend_selection"]:
            # Needs the configured backend, which a raw client does not know.
            assert violation is None
            continue
        assert violation is not None
        cases.append((rule.name, params, str(violation)))
    return cases


def _requests() -> list[tuple[str, EngineCoreRequest, str]]:
    """Hand-built requests: one bad part each (sampling, prompt, envelope, pooling,
    LoRA), and the message."""
    out = [
        (name, _request(sampling_params=params), message)
        for name, params, message in _sampling_cases()
    ]
    out.append(("prompt 2**63", _request(prompt_token_ids=BAD_PROMPT[0]), BAD_PROMPT[1]))
    families: list[tuple[R.Family[Any], str]] = [
        (R.PROMPT, "prompt_token_ids"),
        (R.REQUEST, ""),
        (R.POOLING, "pooling_params"),
        (R.LORA, "lora_request"),
    ]
    for family, field in families:
        for rule in family:
            subject = family.example_subject(rule)
            violation = family.check(subject, LIMITS)
            if not rule.engine or violation is None:
                continue
            if family is R.REQUEST:
                request = subject
            elif family is R.PROMPT:
                request = _request(prompt_token_ids=list(subject.ids or ()))
            elif family is R.POOLING:
                request = _request(sampling_params=None, pooling_params=subject)
            else:
                request = _request(**{field: subject})
            out.append((rule.name, request, str(violation)))
    return out


def _request(**fields: Any) -> EngineCoreRequest:
    base: dict[str, Any] = {
        "request_id": "bad",
        "prompt_token_ids": GOOD,
        "sampling_params": SamplingParams(max_tokens=4),
        "arrival_time": time.time(),
    }
    return EngineCoreRequest(**{**base, **fields})


def _refused(message: str, where: str, call: Any, *args: Any, **kwargs: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        call(*args, **kwargs)
    assert str(info.value) == message, where


def test_make_request_and_prepare_refuse_what_vllm_refuses_at_construction() -> None:
    assert make_request(GOOD, top_k=2**70).sampling_params.top_k == 0  # type: ignore[union-attr]
    for fields, message, temperatures in ISSUE_VALUES:
        for temperature in temperatures:
            where = f"{fields} t={temperature}"
            _refused(message, where, make_request, GOOD, temperature=temperature, **fields)
            params = SamplingParams(max_tokens=4, temperature=temperature, **fields)
            _refused(message, where, make_request, GOOD, sampling_params=params)
            _refused(message, where, prepare_sampling_params, params)
    _refused(BAD_PROMPT[1], "prompt", make_request, BAD_PROMPT[0])
    # the rest (vocabulary, wire types) are checked where the limits are known: on send
    for name, params, message in _sampling_cases():
        rule_family = next((f for f in R.FAMILIES if name.startswith(f"{f.name}.")), None)
        if rule_family in (R.SAMPLING, R.SAMPLING_RAW) or rule_family is None:
            _refused(message, name, make_request, GOOD, sampling_params=params)


def test_the_codec_refuses_before_encoding() -> None:
    """``ClientCodec.encode_add`` (validating, as the in-process adapter calls it) knows no
    limits: what a stock engine could die on whatever the model is."""
    codec = ClientCodec(newest_profile())
    refused = 0
    for name, request, _ in _requests():
        violation = check_request(request, R.NO_LIMITS)
        if violation is None:  # needs a limit (the vocabulary, the context)
            codec.encode_add(request)
            continue
        _refused(str(violation), name, codec.encode_add, request)
        refused += 1
    assert refused > 40
    for fields, message, _ in ISSUE_VALUES:
        request = _request(sampling_params=SamplingParams(max_tokens=4, **fields))
        _refused(message, str(fields), codec.encode_add, request)
    _refused(BAD_PROMPT[1], "prompt", codec.encode_add, _request(prompt_token_ids=BAD_PROMPT[0]))


async def _send(client: EngineCoreClient, api: str, request: EngineCoreRequest) -> None:
    if api == "generate":
        async with client.generate(request):
            pytest.fail("must be refused")
    elif api == "rank=1":
        await client.add_request(request, rank=1)
    elif api == "data_parallel_rank=1":
        await client.add_request(msgspec.structs.replace(request, data_parallel_rank=1))
    else:
        await client.add_request(request)


@pytest.mark.anyio
async def test_client_entry_points_send_nothing() -> None:
    async with peers_client(2, vocab_size=260) as (client, peers):
        assert client.live_ranks == [0, 1]
        count = 0
        for name, request, message in _requests():
            for api in ("add_request", "generate", "rank=1", "data_parallel_rank=1"):
                with pytest.raises(InvalidRequestError) as info:
                    await _send(client, api, request)
                assert str(info.value) == message, (name, api)
                count += 1
        with pytest.raises(InvalidRequestError, match="lora_name must be a non-empty str"):
            await client.add_lora(LoRARequest("", 1, "/a"))
        assert count > 4 * 40  # not vacuous: the table's engine rules and the issue's values
        assert client.live_requests == []
        with anyio.fail_after(30):  # usable, and the engines got nothing before this
            for rank in (0, 1):
                assert await client.call_utility("echo", rank, rank=rank) == [rank]
        for peer in peers:
            assert peer.requests() == [], peer.rank
            assert len(peer.received) == 1, peer.received


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_sync_client_sends_nothing(backend: str) -> None:
    cases = _requests()
    engines = ReferenceEngines(model="echo", extra_args=["--max-model-len", "256"])
    with SyncClient(engines, backend=backend, ready_timeout=60, vocab_size=260) as client:
        for name, request, message in cases:
            ids = {request.request_id}
            _refused(message, name, client.add_request, request)
            with pytest.raises(InvalidRequestError), client.generate(request):
                pytest.fail("must be refused")
        assert client.live_requests == []
        # The engine serves the next request, and only that one: had a refused request
        # gone out, its outputs would come first (the engine serves in order).
        client.add_request(make_request([104, 105], max_tokens=3, request_id="good"))
        seen: set[str] = set()
        finished = False
        while not finished:
            for out in client.get_output(timeout=30).outputs:
                seen.add(out.request_id)
                finished = finished or (out.request_id == "good" and out.finished)
        assert seen == {"good"}, seen - ids
        assert not client.dead
