"""Sampling defaults from ``generation_config.json``: ours equal vLLM's.

Two checks against stock vLLM 0.32.0:

* the rule itself: vLLM's ``ModelConfig.get_diff_sampling_param`` and the serving
  layer's ``override_max_tokens``, computed inside vLLM's python for several generation
  configs, sources and overrides, equal `trio_vllm.text.ModelFiles.sampling_defaults`;
* the effect: a copy of the tiny model whose generation config sets temperature 0, top_k,
  a repetition penalty and ``max_new_tokens``, served by ``vllm serve`` and by
  ``trio-vllm serve --engine vllm``; requests that leave those fields out get the same
  text, usage and finish reasons (and the same status where vLLM refuses one).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from trio_vllm.text import ModelFiles

from ._servers import SERVED, serve_pair
from .conftest import ENGINE_ENV, TINY_MODEL, vllm_python
from .test_serve_parity import _summary

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.timeout(1800)

# (generation_config.json or None for no file, --generation-config, override)
RULE_CASES: list[tuple[dict[str, Any] | None, str, dict[str, Any]]] = [
    ({"temperature": 0, "top_k": 1, "max_new_tokens": 5}, "auto", {}),
    ({"temperature": 1.0, "top_k": 50, "top_p": 1.0, "eos_token_id": [2, 4]}, "auto", {}),
    ({"repetition_penalty": 1.2, "presence_penalty": 0.1, "frequency_penalty": 0.3,
      "min_p": 0.05, "do_sample": True, "top_p": None}, "auto", {}),
    ({"temperature": 0.7}, "vllm", {}),
    ({"temperature": 0.7}, "vllm", {"top_p": 0.5, "max_new_tokens": 9}),
    ({"temperature": 0.7, "max_new_tokens": 20}, "auto", {"top_p": 0.5, "max_new_tokens": 9}),
    ({"temperature": 0.7, "max_new_tokens": 20}, "DIR", {}),
    ({"top_k": 3}, "DIR", {"max_new_tokens": 4}),
    (None, "auto", {}),
    ({"bos_token_id": 1}, "auto", {}),
]  # fmt: skip

_VLLM_RULE = textwrap.dedent(
    """
    import json, sys
    from vllm.config import ModelConfig
    out = []
    for model, source, override in json.loads(sys.argv[1]):
        mc = ModelConfig(model=model, generation_config=source,
                         override_generation_config=override, skip_tokenizer_init=True)
        d = mc.get_diff_sampling_param()
        # the serving layer's override_max_tokens (OpenAIServingChat/Completion)
        cap = (d.get("max_tokens") if mc.generation_config not in ("auto", "vllm")
               else mc.override_generation_config.get("max_new_tokens"))
        out.append({"defaults": d, "cap": cap})
    print("RESULT " + json.dumps(out))
    """
)


def _model_copy(path: Path, generation_config: dict[str, Any] | None) -> Path:
    shutil.copytree(TINY_MODEL, path)
    target = path / "generation_config.json"
    if generation_config is None:
        target.unlink()
    else:
        target.write_text(json.dumps(generation_config))
    return path


def test_sampling_defaults_rule_matches_vllm(tmp_path: Path) -> None:
    python = vllm_python()
    jobs, ours = [], []
    for i, (config, source, override) in enumerate(RULE_CASES):
        model = _model_copy(tmp_path / f"m{i}", config)
        if source == "DIR":
            # the directory's file replaces the model's (which says something else)
            (model / "generation_config.json").write_text('{"temperature": 0.1}')
            folder = tmp_path / f"g{i}"
            folder.mkdir()
            (folder / "generation_config.json").write_text(json.dumps(config))
            source = str(folder)
        jobs.append([str(model), source, override])
        d = ModelFiles(model, generation_config=source,
                       override_generation_config=override).sampling_defaults()  # fmt: skip
        ours.append({"defaults": dict(d), "cap": d.max_tokens_cap})
    done = subprocess.run(
        [python, "-c", _VLLM_RULE, json.dumps(jobs)],
        env={**os.environ, **ENGINE_ENV}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    theirs = json.loads(line.removeprefix("RESULT "))
    for case, want, have in zip(RULE_CASES, theirs, ours, strict=True):
        assert have == want, case
    assert any(t["defaults"] for t in theirs)
    assert any(t["cap"] for t in theirs)


GENERATION_CONFIG = {
    "bos_token_id": 1, "eos_token_id": [2, 4],
    "temperature": 0.0, "top_k": 3, "repetition_penalty": 1.3, "max_new_tokens": 6,
}  # fmt: skip

SERVE_CASES: list[tuple[str, dict[str, Any]]] = [
    # no sampling fields: greedy with the file's repetition penalty, 6 tokens
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi there"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Stream it"}],
                              "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Longer"}],
                              "max_tokens": 12}),
    # completions keep their default of 16, an explicit null too
    ("/v1/completions", {"prompt": "The quick brown fox"}),
    ("/v1/completions", {"prompt": [1, 5, 7, 9], "max_tokens": None}),
    ("/v1/completions", {"prompt": "The quick brown fox", "repetition_penalty": 1.0,
                         "max_tokens": 10}),
    # seeded sampling: the request's temperature, the file's top_k
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 10, "temperature": 0.9, "seed": 42,
                         "n": 2}),
]  # fmt: skip
# n=2 without a temperature is greedy (the file's 0): both refuse it
REFUSED = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2})


def _run(port: int) -> list[Any]:
    results: list[Any] = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
        for path, body in SERVE_CASES:
            results.append(_summary(path, body, http.post(path, json={"model": SERVED, **body})))
        path, body = REFUSED
        results.append(http.post(path, json={"model": SERVED, **body}).status_code)
    return results


def test_serve_applies_generation_config_as_vllm_serve(tmp_path: Path) -> None:
    vllm_python()  # skips without a python with vLLM, before the model is copied
    model = _model_copy(tmp_path / "tiny-gen", GENERATION_CONFIG)
    expected, got = serve_pair(_run, model=model)
    for case, want, have in zip([*SERVE_CASES, REFUSED], expected, got, strict=True):
        assert have == want, case
    # not vacuous: the file's max_new_tokens limited the chat answers, vLLM refused n=2
    assert expected[0]["usage"]["completion_tokens"] == 6
    assert expected[3]["usage"]["completion_tokens"] == 16
    assert expected[4]["usage"]["completion_tokens"] == 16
    assert expected[-1] == 400
    # ... and the file's repetition penalty changed the greedy text
    plain = expected[5]["choices"][0]["text"]
    assert expected[3]["choices"][0]["text"][: len(plain)] != plain
