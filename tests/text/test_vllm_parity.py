"""Parity with stock vLLM's own frontend code (the ground truth), in vLLM's python.

The same cases (tests/text/_parity.py) go through trio-vllm's text layer here and through
vLLM 0.32.0's ``OutputProcessor``/``ParentRequest``, ``SamplingParams`` and tokenizer in a
subprocess (tests/text/vllm_reference.py); results must be equal field by field. Marked
``vllm``: skipped unless ``TRIO_VLLM_TEST_VLLM_PYTHON`` names a python with vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from trio_vllm.protocol import SamplingParams
from trio_vllm.text import InputProcessor, ModelFiles, render_chat_template

from . import _parity
from ._parity import TINY_LLAMA, tokenizer_for

pytestmark = pytest.mark.vllm

REFERENCE = Path(__file__).with_name("vllm_reference.py")


def _vllm_python() -> str:
    python = os.environ.get("TRIO_VLLM_TEST_VLLM_PYTHON")
    if not python:
        pytest.skip("TRIO_VLLM_TEST_VLLM_PYTHON is not set (a python with stock vLLM 0.32.0)")
    if not _parity.tiny_llama_available():
        pytest.skip(f"the tiny model is missing: {TINY_LLAMA}")
    return python


def _run_vllm(cases: list[dict[str, Any]]) -> list[Any]:
    proc = subprocess.run(
        [_vllm_python(), str(REFERENCE)], input=json.dumps(cases), capture_output=True,
        text=True, timeout=110, check=False,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "TOKENIZERS_PARALLELISM": "false"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    marker = proc.stdout.rindex("@@RESULT@@")
    result: list[Any] = json.loads(proc.stdout[marker + len("@@RESULT@@") :])
    return result


def _ours(case: dict[str, Any]) -> dict[str, Any]:
    # Through JSON, as the reference's results are (tuples/lists, int keys).
    result: dict[str, Any] = json.loads(json.dumps(_parity.run_case_here(case)))
    return result


def test_output_processing_matches_vllm() -> None:
    cases = _parity.output_cases() + _parity.fuzz_cases()
    theirs = _run_vllm(cases)
    for case, expected in zip(cases, theirs, strict=True):
        assert _ours(case) == expected, case["name"]


def test_tokenizer_and_chat_template_match_vllm() -> None:
    case = _parity.tokenizer_case()
    (expected,) = _run_vllm([case])
    tok = tokenizer_for(TINY_LLAMA)
    assert [tok.encode(t) for t in case["texts"]] == expected["encode"]
    assert [tok.encode(t, add_special_tokens=False) for t in case["texts"]] == (
        expected["encode_plain"]
    )
    assert [tok.decode(ids, skip_special_tokens=False) for ids in case["id_lists"]] == (
        expected["decode"]
    )
    assert [tok.decode(ids) for ids in case["id_lists"]] == expected["decode_skip"]
    assert [tok.decode_tokens_individually(ids) for ids in case["id_lists"]] == expected["single"]
    assert tok.eos_token_id == expected["eos_token_id"]
    assert tok.max_token_id == expected["max_token_id"]
    rendered = [
        render_chat_template(conv, tokenizer=tok, add_generation_prompt=agp)
        for conv, agp in case["chats"]
    ]
    assert rendered == expected["chat"]


def test_generation_config_stop_ids_match_vllm() -> None:
    cases = _parity.params_cases()
    theirs = _run_vllm(cases)
    files = ModelFiles(TINY_LLAMA)
    processor = InputProcessor.from_model_files(files, tokenizer_for(TINY_LLAMA),
                                                max_model_len=512)
    for case, expected in zip(cases, theirs, strict=True):
        p = processor.prepare_params(SamplingParams(max_tokens=4, **case["params"]), 3)
        got = {
            "_eos_token_id": p._eos_token_id,
            "stop_token_ids": p.stop_token_ids,
            "_all_stop_token_ids": sorted(p._all_stop_token_ids),
            "_bad_words_token_ids": p._bad_words_token_ids,
        }
        assert got == expected, case["params"]
