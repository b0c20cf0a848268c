"""The request-rule table, without I/O: every rule has an example that breaks it, and
the families' fast path gives the verdicts of the rules run one by one.

The entry points (raw client, text layer, server) are walked in
tests/reliability/test_request_rules.py.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_vllm.protocol import EngineCoreRequest, RequestOutputKind, SamplingParams
from trio_vllm.protocol import rules as R

ALL_RULES = [rule for family in R.FAMILIES for rule in family]


def _slow_check(family: R.Family[Any], subject: Any, limits: R.Limits) -> R.Violation | None:
    """The family's verdict with every rule run in order (no fast path)."""
    for rule in family:
        violation = rule(subject, limits)
        if violation is not None:
            return violation
    return None


def _check_fast_paths(family: R.Family[Any], subject: Any, limits: R.Limits) -> None:
    """A fast expression that holds vouches for its rule: the rule accepts the subject
    (rules in order, up to the first broken one: a rule may assume those before it)."""
    for rule in family:
        fast = family.fast_path(rule)
        violation = rule(subject, limits)
        if fast is not None and fast(subject, limits):
            assert violation is None, (rule.name, violation)
        if violation is not None:
            return


def _same(a: R.Violation | None, b: R.Violation | None) -> bool:
    if a is None or b is None:
        return a is b
    return (a.rule, str(a), a.param) == (b.rule, str(b), b.param)


def test_every_rule_has_an_example_that_breaks_it() -> None:
    """Each rule's example breaks that very rule and is the first its family finds;
    its fast expression (if any) does not vouch for it."""
    names = [rule.name for rule in ALL_RULES]
    assert len(names) == len(set(names))
    for rule in ALL_RULES:
        family = rule.family
        subject = family.example_subject(rule)
        violation = family.check(subject, rule.example_limits)
        assert violation is not None, rule.name
        assert violation.rule is rule, (rule.name, violation)
        assert _same(violation, _slow_check(family, subject, rule.example_limits))
        if violation.param is not None:
            assert f"(parameter={violation.param}" in str(violation)
        assert family[rule.name.split(".", 1)[1]] is rule
        fast = family.fast_path(rule)
        if fast is not None:
            assert not fast(subject, rule.example_limits), rule.name


def test_the_module_documents_every_family() -> None:
    assert R.__doc__ is not None
    for family in R.FAMILIES:
        name = next(k for k, v in vars(R).items() if v is family)
        assert f"`{name}`" in R.__doc__, name


def test_good_requests_pass_every_family() -> None:
    params = SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, top_k=40, seed=1)
    for family in (R.SAMPLING, R.SAMPLING_LIMITS, R.SAMPLING_WIRE, R.SAMPLING_RAW):
        assert family.check(params, R.EXAMPLE_LIMITS) is None
    request = EngineCoreRequest("r", prompt_token_ids=[1, 2], sampling_params=params)
    assert R.REQUEST.check(request, R.EXAMPLE_LIMITS) is None
    assert R.PROMPT.check(R.PromptInput([1, 2], 2), R.EXAMPLE_LIMITS) is None


# Values around every rule's edges, good and bad, of the right type and not.
_FLOATS = st.sampled_from(
    [0.0, -0.0, 1e-9, 0.5, 1.0, 1.5, 2.0, 2.5, -1.0, -2.0, -2.5, 3.0, math.inf, -math.inf,
     math.nan, 1, 0, -3, True]
)  # fmt: skip
_INTS = st.sampled_from(
    [0, 1, 2, -1, -2, 16, 16384, 16385, 2**63, 2**64, 2**70, -(2**63) - 1, 1.0, None, True]
)
_IDS = st.sampled_from([[], [1], [0, 259], [260], [-1], [1, 2**63], [1.5], [5] * 20, [1] * 129])
_SAMPLING_FIELDS = {
    "n": _INTS, "presence_penalty": _FLOATS, "frequency_penalty": _FLOATS,
    "repetition_penalty": _FLOATS, "temperature": _FLOATS, "top_p": _FLOATS, "top_k": _INTS,
    "min_p": _FLOATS, "seed": _INTS, "max_tokens": _INTS, "min_tokens": _INTS,
    "logprobs": _INTS, "prompt_logprobs": _INTS, "stream_interval": _INTS,
    "stop_token_ids": _IDS, "allowed_token_ids": st.one_of(st.none(), _IDS),
    "logprob_token_ids": st.one_of(st.none(), _IDS), "thinking_token_budget": _INTS,
    "routed_experts_prompt_start": _INTS,
    "stop": st.sampled_from([None, [], ["a"], [""], ["a", ""]]),
    "bad_words": st.sampled_from([None, [], ["x"], [""]]),
    "output_kind": st.sampled_from([RequestOutputKind.DELTA, 0, 2, 7, -1]),
    "logit_bias": st.sampled_from([None, {}, {1: 1.0}, {600: 1.0}, {1: math.inf}, {-1: 0.5}]),
    "extra_args": st.sampled_from([None, {}, {"k": 1}, {"k": 2**64}, {1: "x"}]),
    "_all_stop_token_ids": st.sampled_from([set(), {2}, {-5}, {2**40}]),
    "_eos_token_id": st.sampled_from([None, 2, -1, 600]),
}  # fmt: skip
_LIMITS = st.sampled_from(
    [R.NO_LIMITS, R.EXAMPLE_LIMITS, R.Limits(max_logprobs=-1, vocab_size=32000)]
)


@settings(max_examples=400, deadline=None)
@given(st.fixed_dictionaries({}, optional=_SAMPLING_FIELDS), _LIMITS)
def test_fast_path_gives_the_rules_verdicts_on_sampling_params(
    fields: dict[str, Any], limits: R.Limits
) -> None:
    try:
        params = SamplingParams(**fields)
    except (TypeError, ValueError):  # __post_init__ comparisons on nonsense types
        return
    for family in (R.SAMPLING, R.SAMPLING_LIMITS, R.SAMPLING_WIRE, R.SAMPLING_RAW):
        for engine_only in (False, True):
            got = family.check(params, limits, engine_only=engine_only)
            assert _same(got, _slow_check(family, params, limits)), (family, got)
        _check_fast_paths(family, params, limits)


_REQUEST_FIELDS = {
    "request_id": st.sampled_from(["r", "", 5]),
    "prompt_token_ids": st.one_of(st.none(), _IDS),
    "client_index": _INTS, "priority": _INTS, "current_wave": _INTS,
    "data_parallel_rank": _INTS, "arrival_time": _FLOATS,
    "cache_salt": st.sampled_from([None, "s", 5]),
    "external_req_id": st.sampled_from([None, "e", 5]),
    "trace_headers": st.sampled_from([None, {"a": "b"}, {"a": 1}]),
    "resumable": st.sampled_from([False, True, 1]),
    "sampling_params": st.sampled_from([SamplingParams(max_tokens=2), None, SamplingParams(n=2)]),
}  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({}, optional=_REQUEST_FIELDS), _LIMITS)
def test_fast_path_gives_the_rules_verdicts_on_requests(
    fields: dict[str, Any], limits: R.Limits
) -> None:
    request = msgspec.structs.replace(
        EngineCoreRequest("r", prompt_token_ids=[1], sampling_params=SamplingParams()),
        **fields,
    )
    got = R.REQUEST.check(request, limits)
    assert _same(got, _slow_check(R.REQUEST, request, limits)), got
    _check_fast_paths(R.REQUEST, request, limits)
    length = R.request_prompt_length(request)
    prompt = R.PromptInput(request.prompt_token_ids, length)
    assert _same(R.PROMPT.check(prompt, limits), _slow_check(R.PROMPT, prompt, limits))
