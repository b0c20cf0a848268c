"""A LoRA adapter served by name: ``trio-vllm serve --lora-modules`` gives the tokens
``vllm serve --enable-lora --lora-modules`` gives with the same adapter (a random PEFT
adapter from ``trio_vllm.testing.write_lora_adapter``), ``/v1/models`` lists it alike,
an unknown adapter name gets the same 404 (and the adapter's tokens differ from the
base model's, so the equality is not vacuous); and ``open_llm(...).generate_final(...,
lora_request=...)`` equals vLLM's ``LLM.generate(..., lora_request=...)``.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio

import trio_vllm as tv
from trio_vllm.client import VllmEngines
from trio_vllm.protocol import LoRARequest, SamplingParams
from trio_vllm.testing import write_lora_adapter

from ._servers import SERVED, serve_pair, vllm_lock
from .conftest import ENGINE_ARGS, ENGINE_ENV, TINY_MODEL, vllm_python

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.timeout(1500)

LORA_ARGS = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
NAME = "tiny-lora"
PROMPTS = ["The quick brown fox", "Once upon a time 日本"]


def _run(port: int) -> list[Any]:
    out: list[Any] = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
        cards = http.get("/v1/models").json()["data"]
        out.append([(c["id"], c["root"], c["parent"], c["max_model_len"]) for c in cards])
        for model in (NAME, SERVED):
            for prompt in PROMPTS:
                r = http.post("/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                    "return_token_ids": True})  # fmt: skip
                assert r.status_code == 200, r.text
                c = r.json()["choices"][0]
                out.append({"model": r.json()["model"], "text": c["text"],
                            "token_ids": c["token_ids"]})  # fmt: skip
        r = http.post("/v1/chat/completions", json={
            "model": NAME, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 8, "temperature": 0})  # fmt: skip
        out.append(r.json()["choices"][0]["message"]["content"])
        r = http.post("/v1/completions", json={"model": "no-such-lora", "prompt": "a"})
        out.append({"status": r.status_code, "message": r.json()["error"]["message"]})
    return out


def test_lora_by_name_matches_vllm_serve(tmp_path: Path) -> None:
    adapter = write_lora_adapter(tmp_path / "adapter", TINY_MODEL)
    module = f"{NAME}={adapter}"
    expected, got = serve_pair(
        _run,
        stock_args=["--lora-modules", module],
        our_args=["--lora-modules", module],
        engine_args=LORA_ARGS,
    )
    assert got == expected
    lora_outputs, base_outputs = expected[1:3], expected[3:5]
    assert all(o["model"] == NAME and o["token_ids"] for o in lora_outputs)
    assert all(o["model"] == SERVED and o["token_ids"] for o in base_outputs)
    # not vacuous: for every prompt the adapter changes the greedy tokens (in both
    # servers, as they are equal), so equal LoRA tokens show the adapter was applied
    for lora_out, base_out in zip(lora_outputs, base_outputs, strict=True):
        assert lora_out["token_ids"] != base_out["token_ids"]
    assert expected[-1]["status"] == 404


_LLM_SCRIPT = """
import json, os, sys
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
model, adapter, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(model=model, load_format="dummy", dtype="float32", max_model_len=256,
          enforce_eager=True, max_num_seqs=8, enable_lora=True, max_lora_rank=8, max_loras=2)
lora = LoRARequest("tiny-lora", 1, adapter)
base = [list(r.outputs[0].token_ids) for r in llm.generate(
    prompts, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)]
out = []
for p, b in zip(prompts, base):
    (r,) = llm.generate([p], SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=2),
                        lora_request=lora, use_tqdm=False)
    out.append({"token_ids": list(r.outputs[0].token_ids), "text": r.outputs[0].text,
                "base_token_ids": b,
                "prompt_logprobs": [None if x is None else
                                    [[t, v.logprob, v.rank, v.decoded_token]
                                     for t, v in x.items()] for x in r.prompt_logprobs]})
sys.stdout.write("@@RESULT@@" + json.dumps(out) + "\\n")
sys.stdout.flush()
llm.llm_engine.engine_core.shutdown()
"""


async def _ours(python: str, adapter: Path) -> list[Any]:
    args = [a for a in ENGINE_ARGS if a != "--skip-tokenizer-init"] + LORA_ARGS
    ours: list[Any] = []
    engines = VllmEngines(str(TINY_MODEL), python=python, extra_args=args, env=ENGINE_ENV)
    async with tv.open_llm(engines, model=TINY_MODEL, ready_timeout=800, shutdown_grace=60) as llm:
        lora = LoRARequest(NAME, 1, str(adapter))
        for prompt in PROMPTS:
            r = await llm.generate_final(
                prompt,
                SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=2),
                lora_request=lora,
            )
            ours.append({"token_ids": list(r.outputs[0].token_ids), "text": r.outputs[0].text,
                         "prompt_logprobs": [None if x is None else
                                             [[t, v.logprob, v.rank, v.decoded_token]
                                              for t, v in x.items()]
                                             for x in r.prompt_logprobs or []]})  # fmt: skip
    return ours


def test_open_llm_lora_matches_llm_generate(tmp_path: Path) -> None:
    python = vllm_python()
    adapter = write_lora_adapter(tmp_path / "adapter", TINY_MODEL)
    with vllm_lock():
        ours = trio.run(_ours, python, adapter)
    argv = [python, "-c", _LLM_SCRIPT, str(TINY_MODEL), str(adapter), json.dumps(PROMPTS)]
    with vllm_lock():  # the script's engine is its child: it ends with the script
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=900,
                              check=False, env={**os.environ, **ENGINE_ENV})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout[proc.stdout.rindex("@@RESULT@@") + len("@@RESULT@@") :])
    for want, have in zip(theirs, ours, strict=True):
        assert have["token_ids"] == want["token_ids"]
        # not vacuous: the adapter changes LLM.generate's greedy tokens
        assert want["token_ids"] != want["base_token_ids"]
        assert have["text"] == want["text"]
        assert len(have["prompt_logprobs"]) == len(want["prompt_logprobs"])
        for a, b in zip(want["prompt_logprobs"], have["prompt_logprobs"], strict=True):
            if a is None:
                assert b is None
                continue
            assert [(t, r, d) for t, _, r, d in a] == [(t, r, d) for t, _, r, d in b]
            assert all(abs(x[1] - y[1]) <= 1e-5 for x, y in zip(a, b, strict=True))
