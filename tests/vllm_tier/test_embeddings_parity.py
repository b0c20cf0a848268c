"""``trio-vllm serve`` answers ``/v1/embeddings`` as ``vllm serve`` does (issue 22).

Both run the tiny model as a pooling model (``--runner pooling --convert embed``, dummy
weights: seeded, so both engines hold the same weights): the stock server with ``vllm
serve``, ours over a stock headless engine core. One input, a batch, token ids, lists
of token ids and base64 must give the same vectors to 1e-5 and the same usage; the
refusals (a mixed batch, ``dimensions``, a too-long input, an id outside the
vocabulary, no input) the same status and type, and the same message where vLLM's is
not a dump of pydantic's union errors. A generate-only server has no
``/v1/embeddings`` on either side, and ``llm.embed`` on a generate model is refused
with the message of vLLM's ``LLM.embed``.
"""

from __future__ import annotations

import base64
import os
import subprocess
from typing import Any

import httpx
import numpy as np
import pytest

from ._servers import SERVED, serve_pair, vllm_lock
from .conftest import ENGINE_ENV, TINY_MODEL, vllm_python

pytestmark = pytest.mark.timeout(1800)

POOLING_ARGS = ["--runner", "pooling", "--convert", "embed"]
GOOD: list[dict[str, Any]] = [
    {"input": "The quick brown fox"},
    {"input": ["a b c", "日本語 🎉", "hello"]},
    {"input": [1, 5, 7, 9]},
    {"input": [[1, 5, 7, 9], [3, 4]]},
    {"input": "The quick brown fox", "encoding_format": "base64"},
    {"input": ""},
]
BAD: list[tuple[dict[str, Any], bool]] = [  # (body, whether the message must match too)
    ({"input": ["a", [1, 2]]}, False),  # vLLM: pydantic's dump of every union member
    ({"input": "hi", "dimensions": 8}, True),
    ({"input": [5] * 300}, True),
    ({"input": "x " * 300}, True),
    ({"input": [1, 600]}, True),
    ({"input": []}, True),
    ({"input": "hi", "model": "nope"}, True),
    ({"input": 5, "normalize": True}, True),  # removed: refused before any field
    ({"input": "hi", "task": "score"}, True),
]


def _vectors(body: dict[str, Any], data: dict[str, Any]) -> list[np.ndarray]:
    out = []
    for item in data["data"]:
        if body.get("encoding_format") == "base64":
            out.append(np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4"))
        else:
            out.append(np.asarray(item["embedding"], dtype=np.float64))
    return out


def _run(port: int) -> dict[str, Any]:
    results: dict[str, Any] = {"good": [], "bad": []}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
        for body in GOOD:
            r = http.post("/v1/embeddings", json={"model": SERVED, **body})
            assert r.status_code == 200, r.text
            data = r.json()
            results["good"].append((_vectors(body, data), data["usage"], data["model"]))
        for body, _ in BAD:
            r = http.post("/v1/embeddings", json={"model": SERVED, **body})
            error = r.json().get("error", {})
            results["bad"].append((r.status_code, error.get("type"), error.get("param"),
                                   error.get("message")))  # fmt: skip
        r = http.post("/v1/completions", json={"model": SERVED, "prompt": "x", "max_tokens": 1})
        results["completions"] = (r.status_code, r.json())
    return results


def test_embeddings_match_vllm_serve() -> None:
    want, got = serve_pair(_run, engine_args=POOLING_ARGS)
    for body, (w_vecs, w_usage, w_model), (g_vecs, g_usage, g_model) in zip(
        GOOD, want["good"], got["good"], strict=True
    ):
        assert (g_usage, g_model) == (w_usage, w_model), body
        assert len(g_vecs) == len(w_vecs), body
        for g, w in zip(g_vecs, w_vecs, strict=True):
            assert g.shape == w.shape == (128,), body
            assert np.max(np.abs(g - w)) <= 1e-5, body
            assert abs(float(np.linalg.norm(w)) - 1.0) < 1e-4  # vLLM normalises
    for (body, same_text), w, g in zip(BAD, want["bad"], got["bad"], strict=True):
        assert w[0] >= 400, (body, w)
        if same_text:
            assert g == w, body
        else:
            assert g[:3] == w[:3], (body, g, w)
    assert got["completions"] == want["completions"] == (404, {"detail": "Not Found"})


def test_no_embeddings_route_on_a_generate_model() -> None:
    def run(port: int) -> tuple[int, Any]:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"input": "hi"}, timeout=60)
        return r.status_code, r.json()

    want, got = serve_pair(run)
    assert got == want == (404, {"detail": "Not Found"})


def test_llm_embed_matches_vllm_llm_embed(tmp_path: Any) -> None:
    """``open_llm(...).embed`` over a stock engine equals vLLM's ``LLM.embed`` in vLLM's
    python (tests/vllm_tier/embed_reference.py), prompt for prompt, to 1e-5; and the
    pooling frames vLLM's own frontend sent and received pass the wire check."""
    import json

    import anyio

    from trio_vllm import VllmEngines
    from trio_vllm._wirecheck import check_vector
    from trio_vllm.llm import open_llm

    from .conftest import ENGINE_ARGS
    from .embed_reference import PROMPTS

    python = vllm_python()
    out = tmp_path / "reference.json"
    script = os.path.join(os.path.dirname(__file__), "embed_reference.py")
    with vllm_lock():  # the script's engine is its child: it ends with the script
        subprocess.run(
            [python, script, str(TINY_MODEL), str(out)],
            env={**os.environ, **ENGINE_ENV},
            check=True,
            timeout=900,
            stdout=subprocess.DEVNULL,
        )
    reference = json.loads(out.read_text())
    assert len(reference["vectors"]) == 2
    for vector in reference["vectors"]:
        check_vector(vector)  # decodes to the spelled value / encodes to vLLM's bytes

    async def ours() -> list[Any]:
        engines = VllmEngines(
            str(TINY_MODEL), python=python, extra_args=[*ENGINE_ARGS, *POOLING_ARGS],
            env=ENGINE_ENV,
        )  # fmt: skip
        async with open_llm(engines, model=TINY_MODEL, ready_timeout=800) as llm:
            return await llm.embed(PROMPTS)

    with vllm_lock():
        got = anyio.run(ours)
    assert len(got) == len(reference["embeddings"]) == len(PROMPTS)
    for g, w in zip(got, reference["embeddings"], strict=True):
        assert g.prompt_token_ids == w["prompt_token_ids"]
        assert np.max(np.abs(np.asarray(g.outputs.embedding) - w["embedding"])) <= 1e-5


_EMBED_ON_GENERATE = """
import os, sys
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
from vllm import LLM
llm = LLM(model=sys.argv[1], load_format="dummy", dtype="float32", max_model_len=256,
          enforce_eager=True, max_num_seqs=8)
try:
    llm.embed(["hi"], use_tqdm=False)
    message = "no refusal"
except ValueError as exc:
    message = str(exc)
sys.stdout.write("@@RESULT@@" + message + "\\n")
sys.stdout.flush()
llm.llm_engine.engine_core.shutdown()
"""


def test_llm_embed_on_a_generate_model_is_refused_as_vllm() -> None:
    """``llm.embed`` over a generate-only stock engine is refused with the message vLLM's
    ``LLM.embed`` raises on a generate model, and nothing reaches the engine."""
    import anyio

    from trio_vllm import InvalidRequestError, VllmEngines
    from trio_vllm.llm import open_llm

    from .conftest import ENGINE_ARGS

    python = vllm_python()
    with vllm_lock():  # the script's engine is its child: it ends with the script
        proc = subprocess.run(
            [python, "-c", _EMBED_ON_GENERATE, str(TINY_MODEL)],
            env={**os.environ, **ENGINE_ENV},
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = proc.stdout[proc.stdout.rindex("@@RESULT@@") + len("@@RESULT@@") :].strip()

    async def ours() -> str:
        engines = VllmEngines(str(TINY_MODEL), python=python, extra_args=ENGINE_ARGS,
                              env=ENGINE_ENV)  # fmt: skip
        async with open_llm(engines, model=TINY_MODEL, ready_timeout=800) as llm:
            try:
                await llm.embed(["hi"])
            except InvalidRequestError as exc:
                assert llm.client.live_requests == []
                return str(exc)
            return "no refusal"

    with vllm_lock():
        got = anyio.run(ours)
    assert got == want
    assert want.startswith("LLM.encode() is only supported for pooling models")
