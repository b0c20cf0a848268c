"""The request-rule table walked through every entry point (issue 24): one bad value,
one message, everywhere.

For every rule of ``trio_vllm.protocol.rules``, its example (a bad value) goes through
each entry point the rule applies to, and each refuses it with the same text, the
table's verdict, which is vLLM's message:

* the raw API: ``make_request`` (the rules vLLM checks when a ``SamplingParams`` is made,
  and the prompt), ``client.add_request`` / ``client.generate`` / ``add_request(rank=)``
  of a hand-built ``EngineCoreRequest`` (every rule that protects the engine, with the
  limits the raw client knows), against an in-process engine peer that must receive
  nothing;
* the text layer: ``open_llm``'s ``generate`` and ``chat`` (every rule but the raw
  client's own), raising at the call, before anything is sent;
* the server: the HTTP 400 of ``trio-vllm serve``'s app (rules with an ``http``
  example), with the rule's ``param``.

Where a rule needs a limit an entry point does not know (the raw client has no
``max_logprobs``), that entry point lets the value through: it is not the rule's
entry point, and the walk skips it there. tests/vllm_tier/test_error_parity.py checks
the server's answers against ``vllm serve`` itself.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import trio_vllm as tv
from server._util import raw_request, serving
from trio_vllm import EngineCoreRequest, InvalidRequestError, SamplingParams, make_request
from trio_vllm.llm import open_llm
from trio_vllm.protocol import rules as R

from ._peer import peer_client

if TYPE_CHECKING:
    from trio_vllm.llm import LLM

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

LIMITS = R.EXAMPLE_LIMITS
# What the raw client knows of the peer: no max_logprobs, no LoRA.
RAW_LIMITS = R.Limits(max_model_len=256, vocab_size=260, num_clients=1, supports_lora=False)
GOOD_PROMPT = [1, 2, 3]
MESSAGES = [{"role": "user", "content": "hi"}]
ALL_RULES = [rule for family in R.FAMILIES for rule in family]
WALKED: dict[str, set[str]] = {}  # rule -> the entry points its example went through
# The families whose subject is a SamplingParams (STRUCTURED rides in one).
_SAMPLING = (R.SAMPLING, R.SAMPLING_LIMITS, R.SAMPLING_WIRE, R.SAMPLING_RAW)
_TEXT = (R.SAMPLING, R.SAMPLING_LIMITS, R.SAMPLING_WIRE, R.STRUCTURED, R.PROMPT, R.PROMPT_TEXT)

# Duties the text layer does itself (max_tokens, the structured-output backend): their
# examples cannot reach it broken.
_NOT_TEXT = (R.SAMPLING_WIRE["max_tokens_set"], R.SAMPLING_WIRE["structured_backend"])


def _params(rule: R.Rule[Any]) -> SamplingParams:
    if rule.family is R.STRUCTURED:
        return SamplingParams(max_tokens=4, structured_outputs=R.STRUCTURED.example_subject(rule))
    if rule.family in _SAMPLING:
        return rule.family.example_subject(rule)
    return SamplingParams(max_tokens=4)


def _expected(rule: R.Rule[Any], limits: R.Limits, subject: Any = None) -> R.Violation | None:
    """The table's verdict on the rule's example under an entry point's ``limits``
    (``None``: that entry point does not know what the rule needs)."""
    if subject is None:
        subject = rule.family.example_subject(rule)
    return rule.family.check(subject, limits)


def _raw_request(rule: R.Rule[Any], request_id: str) -> EngineCoreRequest:
    """A request by hand whose only fault is ``rule``'s example."""
    family = rule.family
    if family is R.REQUEST:
        return R.REQUEST.example_subject(rule)
    fields: dict[str, Any] = {
        "request_id": request_id,
        "prompt_token_ids": GOOD_PROMPT,
        "sampling_params": _params(rule),
        "arrival_time": time.time(),
    }
    if family is R.PROMPT:
        fields["prompt_token_ids"] = list(rule.example["ids"])  # type: ignore[call-overload]
    elif family is R.POOLING:
        fields["sampling_params"] = None
        fields["pooling_params"] = R.POOLING.example_subject(rule)
    elif family is R.LORA:
        fields["lora_request"] = R.LORA.example_subject(rule)
    return EngineCoreRequest(**fields)


def _refusal(exc: BaseException) -> tuple[str, str | None]:
    assert isinstance(exc, InvalidRequestError), repr(exc)
    return str(exc), exc.param


def test_issue_examples_get_vllms_messages() -> None:
    """The issue's examples, with vLLM 0.32.0's texts (as ``vllm serve`` answers them;
    tests/vllm_tier/test_error_parity.py checks against it live)."""
    cases = {
        "temperature": ({"temperature": -1}, "temperature must be non-negative, got -1.0."),
        "top_p": ({"top_p": 2}, "top_p must be in (0, 1], got 2.0."),
        "max_tokens": ({"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
    }
    for param, (fields, message) in cases.items():
        value = next(iter(fields.values()))
        with pytest.raises(InvalidRequestError) as info:
            make_request(GOOD_PROMPT, **{"temperature": 1.0, **fields})  # type: ignore[arg-type]
        shown = float(value) if param != "max_tokens" else value
        assert str(info.value) == f"{message} (parameter={param}, value={shown})"
        assert info.value.param == param


async def _walk_raw(failures: list[str]) -> None:
    async with peer_client(vocab_size=260) as (client, peer):
        for i, rule in enumerate(ALL_RULES):
            if not rule.engine:
                continue
            want = _expected(rule, RAW_LIMITS)
            if rule.family in (R.SAMPLING, R.SAMPLING_RAW):
                # make_request checks what vLLM checks when a SamplingParams is made.
                try:
                    make_request(GOOD_PROMPT, sampling_params=_params(rule))
                    got: tuple[str, str | None] | None = None
                except Exception as exc:
                    got = _refusal(exc)
                _compare(failures, rule, "make_request", want, got)
            if rule.family is R.PROMPT:
                try:
                    make_request(rule.example["ids"], max_model_len=256)  # type: ignore[arg-type]
                    got = None
                except Exception as exc:
                    got = _refusal(exc)
                _compare(failures, rule, "make_request", want, got)
            if want is None:
                continue  # the raw client does not know the limit this rule needs
            for api in ("add_request", "generate", "add_request(rank=0)"):
                request = _raw_request(rule, f"walk-{i}")
                try:
                    if api == "generate":
                        async with client.generate(request):
                            pytest.fail("must be refused")
                    else:
                        await client.add_request(request, rank=0 if "rank" in api else None)
                    got = None
                except Exception as exc:
                    got = _refusal(exc)
                _compare(failures, rule, f"client.{api}", want, got)
        assert client.live_requests == []
        with anyio.fail_after(30):  # the client works, and the engine got nothing else
            assert await client.call_utility("echo", "sentinel") == ["sentinel"]
        assert peer.requests() == []
        assert len(peer.received) == 1


def _compare(
    failures: list[str],
    rule: R.Rule[Any],
    entry: str,
    want: R.Violation | None,
    got: tuple[str, str | None] | None,
) -> None:
    expected = None if want is None else (str(want), want.param)
    WALKED.setdefault(rule.name, set()).add(entry)
    if got != expected:
        failures.append(f"{rule.name} via {entry}: expected {expected!r}, got {got!r}")


def _text_call(llm: LLM, rule: R.Rule[Any], chat: bool) -> None:
    family = rule.family
    params = _params(rule)
    prompt: Any = GOOD_PROMPT
    if family is R.PROMPT:
        prompt = {"prompt_token_ids": list(rule.example["ids"])}  # type: ignore[call-overload]
    elif family is R.PROMPT_TEXT:
        prompt = rule.example["text"]
    if chat:
        llm.chat(MESSAGES, params)  # refused before the context manager exists
    else:
        llm.generate(prompt, params)


async def _walk_text_and_server(failures: list[str]) -> None:
    engines = tv.ReferenceEngines(1, model="echo", extra_args=["--max-model-len", "256"])
    async with open_llm(engines) as llm, serving(llm) as served:
        assert llm.max_model_len == LIMITS.max_model_len
        text_limits = R.Limits(
            max_model_len=256,
            vocab_size=260,
            max_token_id=max(259, llm.tokenizer.max_token_id),
            max_logprobs=20,
            structured_output_backend="auto",
        )
        chars = llm.tokenizer.max_chars_per_token
        for rule in ALL_RULES:
            family = rule.family
            subject = None
            if family is R.PROMPT_TEXT:
                subject = R.PromptText(str(rule.example["text"]), chars)
            want = _expected(rule, text_limits, subject)
            if family in _TEXT and rule not in _NOT_TEXT:
                chats = [False, True] if family in (R.SAMPLING, R.SAMPLING_LIMITS) else [False]
                for chat in chats:
                    try:
                        _text_call(llm, rule, chat)
                        got: tuple[str, str | None] | None = None
                    except Exception as exc:
                        got = _refusal(exc)
                    _compare(failures, rule, "llm.chat" if chat else "llm.generate", want, got)
            if rule.http is not None:
                await _walk_server(failures, served.port, rule, want)
        assert llm.client.live_requests == []


async def _walk_server(failures: list[str], port: int, rule: R.Rule[Any], want: Any) -> None:
    http = dict(rule.http or {})
    completions, chat = "/v1/completions", "/v1/chat/completions"
    if rule.family is R.CHAT:
        paths = [chat]
    elif rule.family is R.COMPLETION or "prompt" in http or "logprobs" in http:
        paths = [completions]  # a prompt, or an int logprobs: completions only
    else:
        paths = [completions, chat]
    for path in paths:
        body: dict[str, Any] = {"prompt": GOOD_PROMPT} if path == completions else {}
        if path == chat:
            body["messages"] = MESSAGES
        body.update(http)
        status, _, data = await raw_request(
            port, "POST", path, json.dumps(body).encode(), {"content-type": "application/json"}
        )
        error = json.loads(data).get("error", {}) if status != 200 else {}
        got = (status, error.get("message"), error.get("param"), error.get("type"))
        expected = (400, str(want), want.param, "BadRequestError")
        WALKED.setdefault(rule.name, set()).add(f"POST {path}")
        if got != expected:
            failures.append(f"{rule.name} via POST {path}: expected {expected!r}, got {got!r}")


async def test_every_rule_gets_one_message_at_every_entry_point() -> None:
    """The walk: every rule's example through the raw client, the text layer and the
    server; the same text (and ``param``) everywhere, nothing sent."""
    failures: list[str] = []
    WALKED.clear()
    await _walk_raw(failures)
    await _walk_text_and_server(failures)
    assert failures == [], "\n".join(failures)
    # Not vacuous: every rule went through its entry points.
    for rule in ALL_RULES:
        entries = WALKED.get(rule.name, set())
        if rule.http is not None:
            assert "POST /v1/completions" in entries or "POST /v1/chat/completions" in entries
        if rule.family in _TEXT and rule not in _NOT_TEXT:
            assert "llm.generate" in entries, rule.name
        needs_more = rule.family is R.SAMPLING_LIMITS and _expected(rule, RAW_LIMITS) is None
        if rule.engine and not needs_more:
            assert "client.add_request" in entries, rule.name
        if rule.family in (R.SAMPLING, R.SAMPLING_RAW, R.PROMPT):
            assert "make_request" in entries, rule.name
    # ... and the ones the raw client lets through are those needing max_logprobs.
    let_through = {r.name for r in ALL_RULES if r.engine and not WALKED[r.name] & _RAW_SENDS}
    assert let_through == {
        "sampling_limits.logprobs_max",
        "sampling_limits.prompt_logprobs_max",
    }, let_through


_RAW_SENDS = {"client.add_request", "client.generate", "client.add_request(rank=0)"}
