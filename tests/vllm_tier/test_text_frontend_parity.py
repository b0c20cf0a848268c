"""Text in, text out: trio-vllm's frontend on a stock engine == vLLM's own ``LLM``.

trio-vllm's :func:`~trio_vllm.open_llm` drives a stock headless vLLM 0.32.0 engine core
(tiny-llama, dummy weights: seeded, so deterministic) and runs each case; then vLLM's own
``LLM.generate`` / ``LLM.chat`` runs the same cases in vLLM's python on the same model
(tests/vllm_tier/llm_reference.py). Text, token ids, finish and stop reasons, logprob
values, ranks and decoded tokens, prompt logprobs and cumulative logprobs must be equal.

The cases cover prompts whose characters split over tokens (CJK, emoji) and outputs
drawn only from partial UTF-8 pieces, stop strings with and without
``include_stop_str_in_output``, ``min_tokens`` deferring a stop string, ``n = 2`` with a
seed, ``skip_special_tokens=False`` with special tokens in the output, sample and prompt
logprobs, and a chat conversation. Stop strings are taken from the model's own greedy
output (first run here), so they do occur.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest

import trio_vllm as tv
from trio_vllm.client import VllmEngines
from trio_vllm.protocol import RequestOutputKind

from .conftest import ENGINE_ARGS, ENGINE_ENV, EXPECTED_GREEDY, TINY_MODEL, vllm_python
from .llm_reference import request_output_json

pytestmark = pytest.mark.timeout(900)

REFERENCE = Path(__file__).with_name("llm_reference.py")
# The engine loads the tokenizer as `vllm serve` and LLM() do.
OUR_ENGINE_ARGS = [a for a in ENGINE_ARGS if a != "--skip-tokenizer-init"]
CJK = "日本語のテキスト 🎉 and ☃ split"
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi 日本"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Again? 🎉"},
]


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value))  # tuples -> lists, int keys -> as vLLM's side


async def _our_side(python: str) -> tuple[list[dict[str, Any]], list[Any], list[str]]:
    """Start a stock engine, derive the stop-string cases, run every case; returns the
    cases, our outputs, and our DELTA-streamed texts of the streaming checks."""
    engines = VllmEngines(str(TINY_MODEL), python=python, extra_args=OUR_ENGINE_ARGS,
                          env=ENGINE_ENV)  # fmt: skip
    # A loaded machine can take more than the default 5 s to stop a stock engine; a
    # SIGKILLed one leaves its shared memory behind (the tier's teardown check).
    async with tv.open_llm(engines, model=TINY_MODEL, ready_timeout=500, shutdown_grace=60) as llm:
        tok = llm.tokenizer
        base = await llm.generate_final(
            {"prompt_token_ids": [1, 5, 7, 9]}, tv.SamplingParams(temperature=0, max_tokens=8)
        )
        assert base.outputs[0].token_ids == EXPECTED_GREEDY
        greedy = await llm.generate_final(
            "The quick brown fox", tv.SamplingParams(temperature=0, max_tokens=40)
        )
        text = greedy.outputs[0].text
        assert len(text) > 12, text
        stop = next(
            text[k : k + 3] for k in range(6, len(text) - 3) if text.find(text[k : k + 3]) == k
            and not text[k : k + 3].isspace()
        )  # fmt: skip
        # Tokens of CJK's characters are partial UTF-8 pieces: sampling only among them
        # makes an output whose characters split (and may not decode at all).
        pieces = sorted({t for t in tok.encode(CJK, add_special_tokens=False)})
        cases: list[dict[str, Any]] = [
            {"kind": "generate", "prompt": CJK, "params": {"temperature": 0, "max_tokens": 32}},
            {"kind": "generate", "prompt": "The quick brown fox",
             "params": {"temperature": 0, "max_tokens": 40, "stop": [stop]}},
            {"kind": "generate", "prompt": "The quick brown fox",
             "params": {"temperature": 0, "max_tokens": 40, "stop": [stop],
                        "include_stop_str_in_output": True}},
            {"kind": "generate", "prompt": "The quick brown fox",
             "params": {"temperature": 0, "max_tokens": 40, "stop": [stop], "min_tokens": 12}},
            {"kind": "generate", "prompt": CJK,
             "params": {"temperature": 1.0, "seed": 11, "n": 2, "max_tokens": 20}},
            {"kind": "generate", "prompt": "special",
             "params": {"temperature": 1.0, "seed": 5, "max_tokens": 24, "ignore_eos": True,
                        "allowed_token_ids": [0, 1, 2, 3, 4, 300, 301, 302],
                        "skip_special_tokens": False}},
            {"kind": "generate", "prompt": "special",
             "params": {"temperature": 1.0, "seed": 5, "max_tokens": 24, "ignore_eos": True,
                        "allowed_token_ids": [0, 1, 2, 3, 4, 300, 301, 302]}},
            {"kind": "generate", "prompt": CJK,
             "params": {"temperature": 1.0, "seed": 3, "max_tokens": 30,
                        "allowed_token_ids": pieces}},
            {"kind": "generate", "prompt": {"prompt_token_ids": [1, 5, 7, 9]},
             "params": {"temperature": 0, "max_tokens": 8, "logprobs": 3,
                        "prompt_logprobs": 2}},
            {"kind": "generate", "prompt": CJK,
             "params": {"temperature": 1.0, "seed": 9, "max_tokens": 12, "logprobs": 2}},
            {"kind": "chat", "messages": CHAT, "params": {"temperature": 0, "max_tokens": 24}},
        ]  # fmt: skip
        ours: list[Any] = []
        for case in cases:
            params = tv.SamplingParams(**case["params"])
            if case["kind"] == "chat":
                out = await llm.chat_final(case["messages"], params)
            else:
                out = await llm.generate_final(case["prompt"], params)
            ours.append(_json(request_output_json(out)))
        # Streaming (DELTA) gives the same text, piece by piece, as the final output.
        streamed: list[str] = []
        for index in (0, 7):
            case = cases[index]
            params = tv.SamplingParams(**case["params"], output_kind=RequestOutputKind.DELTA)
            pieces_seen = []
            async with llm.generate(case["prompt"], params) as stream:
                async for out in stream:
                    pieces_seen.append(out.outputs[0].text)
            streamed.append("".join(pieces_seen))
        assert llm.num_requests == 0
    return cases, ours, streamed


def _vllm_side(python: str, cases: list[dict[str, Any]]) -> list[Any]:
    proc = subprocess.run(
        ["nice", "-n", "10", python, str(REFERENCE), str(TINY_MODEL)],
        input=json.dumps(cases), capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, **ENGINE_ENV, "VLLM_LOGGING_LEVEL": "ERROR",
             "TOKENIZERS_PARALLELISM": "false"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    marker = proc.stdout.rindex("@@RESULT@@")
    result: list[Any] = json.loads(proc.stdout[marker + len("@@RESULT@@") :])
    return result


def test_text_frontend_matches_vllm_llm() -> None:
    python = vllm_python()
    cases, ours, streamed = anyio.run(_our_side, python, backend="trio")
    theirs = _vllm_side(python, cases)
    assert len(theirs) == len(cases)
    for case, mine, expected in zip(cases, ours, theirs, strict=True):
        assert mine == expected, f"case {case}:\nours   {mine}\nvLLM's {expected}"
    assert streamed == [theirs[0]["outputs"][0]["text"], theirs[7]["outputs"][0]["text"]]
    # The cases do what they are for (against vLLM's own results):
    plain_stop, kept, deferred = theirs[1]["outputs"][0], theirs[2]["outputs"][0], theirs[3]
    assert plain_stop["finish_reason"] == "stop"
    assert plain_stop["stop_reason"] == cases[1]["params"]["stop"][0]
    assert kept["text"] == plain_stop["text"] + cases[1]["params"]["stop"][0]
    assert deferred["outputs"][0]["text"] != plain_stop["text"]  # min_tokens moved it
    assert len(theirs[4]["outputs"]) == 2
    specials = theirs[5]["outputs"][0]
    assert any(t in (0, 1, 2, 3, 4) for t in specials["token_ids"])
    assert specials["text"] != theirs[6]["outputs"][0]["text"]  # skip_special_tokens matters
    assert theirs[8]["prompt_logprobs"] is not None
    assert theirs[8]["outputs"][0]["logprobs"] is not None
