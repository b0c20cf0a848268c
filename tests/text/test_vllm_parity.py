"""Parity with stock vLLM's own frontend code (the ground truth), in vLLM's python.

The same cases (tests/text/_parity.py) go through trio-vllm's text layer here and through
vLLM 0.32.0's ``OutputProcessor``/``ParentRequest``, ``SamplingParams`` and tokenizer in a
subprocess (tests/text/vllm_reference.py); results must be equal field by field. Marked
``vllm``: skipped unless ``TRIO_VLLM_TEST_VLLM_PYTHON`` names a python with vLLM.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from trio_vllm import InvalidRequestError
from trio_vllm.protocol import SamplingParams
from trio_vllm.protocol.rules import CONTEXT_SUFFIX
from trio_vllm.text import InputProcessor, ModelFiles, normalize_messages, render_chat_template

from . import _parity
from ._parity import TINY_LLAMA, tokenizer_for

# One vLLM subprocess runs every case (about 30 s on an idle machine; slower when loaded).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

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
        [_vllm_python(), str(REFERENCE)],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "TOKENIZERS_PARALLELISM": "false"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    marker = proc.stdout.rindex("@@RESULT@@")
    result: list[Any] = json.loads(proc.stdout[marker + len("@@RESULT@@") :])
    return result


@pytest.fixture(scope="module")
def vllm_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case through vLLM in one subprocess (importing vLLM takes seconds)."""
    _vllm_python()
    sp = _parity.build_sentencepiece_model(tmp_path_factory.mktemp("models") / "sp-bpe")
    cases = {
        "outputs": _parity.output_cases()
        + _parity.fuzz_cases()
        + _parity.output_cases(sp)
        + _parity.fuzz_cases(model=sp),
        "tokenizer": [_parity.tokenizer_case(), _parity.tokenizer_case(sp)],
        "params": _parity.params_cases(),
        "inputs": [_parity.inputs_case()],
        "chat_parse": [_parity.chat_parse_case()],
    }
    flat = [c for group in cases.values() for c in group]
    results = iter(_run_vllm(flat))
    return {name: (group, [next(results) for _ in group]) for name, group in cases.items()}


def _ours(case: dict[str, Any]) -> dict[str, Any]:
    # Through JSON, as the reference's results are (tuples/lists, int keys).
    result: dict[str, Any] = json.loads(json.dumps(_parity.run_case_here(case)))
    return result


def test_output_processing_matches_vllm(vllm_results: dict[str, Any]) -> None:
    cases, theirs = vllm_results["outputs"]
    for case, expected in zip(cases, theirs, strict=True):
        assert _ours(case) == expected, case["name"]


@pytest.mark.parametrize("which", [0, 1], ids=["tiny-llama", "sentencepiece-bpe"])
def test_tokenizer_and_chat_template_match_vllm(vllm_results: dict[str, Any], which: int) -> None:
    cases, results = vllm_results["tokenizer"]
    case, expected = cases[which], results[which]
    tok = tokenizer_for(case["model"])
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
        render_chat_template(
            conv, tokenizer=tok, add_generation_prompt=False, continue_final_message=True
        )
        if agp == "continue"
        else render_chat_template(conv, tokenizer=tok, add_generation_prompt=agp)
        for conv, agp in case["chats"]
    ]
    assert rendered == expected["chat"]


def test_generation_config_stop_ids_match_vllm(vllm_results: dict[str, Any]) -> None:
    cases, theirs = vllm_results["params"]
    files = ModelFiles(TINY_LLAMA)
    processor = InputProcessor.from_model_files(files, tokenizer_for(TINY_LLAMA), max_model_len=512)
    for case, expected in zip(cases, theirs, strict=True):
        p = processor.prepare_params(SamplingParams(max_tokens=4, **case["params"]), 3)
        got = {
            "_eos_token_id": p._eos_token_id,
            "stop_token_ids": p.stop_token_ids,
            "_all_stop_token_ids": sorted(p._all_stop_token_ids),
            "_bad_words_token_ids": p._bad_words_token_ids,
        }
        assert got == expected, case["params"]


def test_input_processing_matches_vllm(vllm_results: dict[str, Any]) -> None:
    (case,), (expected,) = vllm_results["inputs"]
    files = ModelFiles(TINY_LLAMA)
    processor = InputProcessor.from_model_files(
        files, tokenizer_for(TINY_LLAMA), max_model_len=case["max_model_len"]
    )
    for item, theirs in zip(case["items"], expected["items"], strict=True):
        error = None
        try:
            processed = processor.process_inputs(
                "ext-id", item["prompt"], SamplingParams(**item["params"])
            )
        except InvalidRequestError as exc:
            error = str(exc)
        if error is not None:
            assert "error" in theirs, (item, error)
            # vLLM appends " (parameter=..., value=...)" to some messages; we append the
            # context length to the one refusal whose text lacks it.
            ours = error.removesuffix(CONTEXT_SUFFIX.format(case["max_model_len"]))
            assert theirs["error"].startswith(ours), (item, error, theirs["error"])
            continue
        assert "error" not in theirs, (item, theirs)
        (request,) = processed.requests
        p = processed.sampling_params
        assert re.fullmatch(r"ext-id-[0-9a-f]{8}", theirs["request_id"])
        assert re.fullmatch(r"ext-id-[0-9a-f]{8}", request.request_id)
        got = {
            "external_req_id": request.external_req_id,
            "prompt_token_ids": request.prompt_token_ids,
            "max_tokens": p.max_tokens,
            "_eos_token_id": p._eos_token_id,
            "stop_token_ids": p.stop_token_ids,
            "_all_stop_token_ids": sorted(p._all_stop_token_ids),
            "output_text_buffer_length": p.output_text_buffer_length,
        }
        assert got == {k: v for k, v in theirs.items() if k != "request_id"}, item


def test_chat_message_parsing_matches_vllm(vllm_results: dict[str, Any]) -> None:
    (case,), (expected,) = vllm_results["chat_parse"]
    assert normalize_messages(case["messages"]) == expected["conversation"]
