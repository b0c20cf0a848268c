"""SyncLLM: the blocking text frontend (client and LLM in a background event loop)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import trio_vllm as tv
from trio_vllm.reference_engine import MODEL_DIR

pytestmark = pytest.mark.timeout(60)

ENGINE_ARGS = ["--max-model-len", "1000000"]


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_generate_chat_and_close(backend: str) -> None:
    engines = tv.ReferenceEngines(model="echo", extra_args=ENGINE_ARGS)
    with tv.SyncLLM(engines, backend=backend) as llm:
        assert llm.model_name == "trio-vllm-reference"
        out = llm.generate_final("abc", tv.SamplingParams(max_tokens=7, temperature=0))
        assert out.outputs[0].text == "abcabca"
        params = tv.SamplingParams(
            max_tokens=6, temperature=0, output_kind=tv.RequestOutputKind.DELTA
        )
        pieces = [o.outputs[0].text for o in llm.generate("日本", params)]
        assert "".join(pieces) == "日本"
        text, ids = llm.render_chat([{"role": "user", "content": "hi"}])
        assert ids == list(text.encode())
        reply = llm.chat_final([{"role": "user", "content": "hi"}], tv.SamplingParams(max_tokens=5))
        assert reply.outputs[0].text == text[:5]
        with pytest.raises(tv.InvalidRequestError):
            llm.generate([1, 300])
        assert llm.llm.num_requests == 0
        assert any(t.name == "trio-vllm-sync" for t in threading.enumerate())
    # The loop thread is joined (trio may keep an idle worker of its thread cache).
    assert not any(t.name == "trio-vllm-sync" for t in threading.enumerate())


def test_early_close_and_abort_reach_the_engine() -> None:
    engines = tv.ReferenceEngines(model="echo", extra_args=ENGINE_ARGS)
    with tv.SyncLLM(engines) as llm:
        client = llm.llm.client
        stream = llm.generate("ab", tv.SamplingParams(max_tokens=900_000, temperature=0))
        first = next(stream)
        assert first.outputs[0].finish_reason is None
        assert llm.llm.num_requests == 1
        stream.close()
        assert llm.llm.num_requests == 0
        assert llm.portal.call(lambda: _live(client)) == []
        # abort(request_id) from another thread ends a stream with an abort output.
        stream = llm.generate("ab", tv.SamplingParams(max_tokens=900_000), request_id="x")
        next(stream)
        llm.abort("x")
        last = list(stream)[-1]
        assert last.outputs[0].finish_reason == "abort"
        assert stream.closed
        # A stream left open is closed (aborted) with the SyncLLM.
        left = llm.generate("cd", tv.SamplingParams(max_tokens=900_000))
        next(left)
    assert left.closed
    assert client.dead
    with pytest.raises(RuntimeError, match="not open"):
        llm.generate_final("x")


def _live(client: Any) -> list[str]:
    return list(client.live_requests)


def test_bad_model_dir_fails_before_any_engine_starts(tmp_path: Any) -> None:
    engines = tv.ReferenceEngines(model="echo")
    with (
        pytest.raises((FileNotFoundError, ValueError)),
        tv.SyncLLM(engines, model=tmp_path / "missing"),
    ):
        pass  # pragma: no cover
    assert MODEL_DIR  # the default needs no model argument


def test_importing_the_frontend_loads_no_tokenizer_library() -> None:
    import subprocess
    import sys

    code = (
        "import sys, trio_vllm, trio_vllm.llm\n"
        "trio_vllm.open_llm, trio_vllm.SyncLLM\n"
        "print(','.join(m for m in ('tokenizers', 'jinja2', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == ""
