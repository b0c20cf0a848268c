"""The API through the official ``openai`` clients (async and sync) and curl.

The reference engine's echo model repeats the prompt (next token = s[len(s) mod
len(prompt)]) and the shipped model directory is byte-level, so every expected text
below follows from the prompt.
"""

from __future__ import annotations

import json
import logging
import shutil
from typing import TYPE_CHECKING

import anyio
import httpx
import openai
import pytest

from ._util import Served, serving, sse_events

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from trio_vllm.llm import LLM

pytestmark = [
    pytest.mark.anyio,
    # openai's AsyncStream breaks out of its SSE generators at [DONE] without closing
    # them (openai/_streaming.py); trio reports each when it is collected. A client
    # library quirk, not the server's: asyncio and the sync client do not show it.
    pytest.mark.filterwarnings(
        r"ignore:Exception ignored in. <async_generator object "
        r"(AsyncStream\._iter_events|PoolByteStream\.__aiter__|Response\.aiter_bytes|"
        r"SSEDecoder\.aiter_bytes|SSEDecoder\._aiter_chunks|Response\.aiter_raw)"
        r":pytest.PytestUnraisableExceptionWarning"
    ),
]


@pytest.fixture
async def client(served: Served) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0
    ) as c:
        yield c


async def test_completion(client: openai.AsyncOpenAI, served: Served) -> None:
    r = await client.completions.create(
        model=served.app.model_names[0], prompt="hello world", max_tokens=5, temperature=0
    )
    assert r.id.startswith("cmpl-")
    assert r.object == "text_completion"
    assert r.model == served.app.model_names[0]
    (choice,) = r.choices
    assert (choice.index, choice.text, choice.finish_reason) == (0, "hello", "length")
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (11, 5, 16)


async def test_completion_stream_with_usage(client: openai.AsyncOpenAI) -> None:
    stream = await client.completions.create(
        model="", prompt="hello world", max_tokens=8, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts, reasons, usage = [], [], None
    async for chunk in stream:
        if chunk.choices:
            texts.append(chunk.choices[0].text)
            reasons.append(chunk.choices[0].finish_reason)
            assert chunk.usage is None
        else:
            usage = chunk.usage
    assert "".join(texts) == "hello wo"
    assert reasons[-1] == "length"
    assert set(reasons[:-1]) <= {None}
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (11, 8)


async def test_stream_ends_with_done_and_continuous_usage(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        r = await http.post(
            "/v1/completions",
            json={"prompt": "abcd", "max_tokens": 4, "stream": True,
                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        )  # fmt: skip
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.content)
    assert events[-1] == "[DONE]"
    final = events[-2]
    assert final["choices"] == []
    assert final["usage"] == {"prompt_tokens": 4, "total_tokens": 8, "completion_tokens": 4}
    counted = [e["usage"]["completion_tokens"] for e in events[:-2]]
    assert counted == sorted(counted)
    assert counted[-1] == 4


async def test_chat(client: openai.AsyncOpenAI, frontend: LLM) -> None:
    messages = [{"role": "user", "content": "hi"}]
    prompt_text, prompt_ids = frontend.render_chat(messages)
    r = await client.chat.completions.create(
        model="",
        messages=messages,
        max_tokens=4,
        temperature=0,  # type: ignore[arg-type]
    )
    assert r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == prompt_text[:4]
    assert choice.finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), 4)


async def test_chat_stream(client: openai.AsyncOpenAI, frontend: LLM) -> None:
    messages = [{"role": "user", "content": "hi"}]
    prompt_text, _ = frontend.render_chat(messages)
    stream = await client.chat.completions.create(
        model="", messages=messages, max_completion_tokens=6, stream=True,  # type: ignore[arg-type]
    )  # fmt: skip
    chunks = [c async for c in stream]
    first = chunks[0].choices[0]
    assert (first.delta.role, first.delta.content, first.finish_reason) == ("assistant", "", None)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == prompt_text[:6]
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_n_2(client: openai.AsyncOpenAI) -> None:
    r = await client.completions.create(
        model="", prompt="hello world", max_tokens=3, n=2, temperature=0.8, seed=7
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == ["hel", "hel"]
    assert r.usage is not None
    assert r.usage.completion_tokens == 6
    chunks = [
        c
        async for c in await client.chat.completions.create(
            model="", messages=[{"role": "user", "content": "x"}], max_tokens=2, n=2,
            temperature=0.8, stream=True,
        )
    ]  # fmt: skip
    role_chunks = [c for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(c.choices[0].index for c in role_chunks) == [0, 1]
    finished = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]


async def test_stop_strings_and_token_ids(client: openai.AsyncOpenAI) -> None:
    r = await client.completions.create(model="", prompt="hello world", max_tokens=12, stop=["wor"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("hello ", "stop")
    assert r.choices[0].stop_reason == "wor"  # type: ignore[attr-defined]
    r = await client.completions.create(
        model="", prompt="hello world", max_tokens=12, stop="wor",
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    assert r.choices[0].text == "hello wor"
    r = await client.completions.create(
        model="", prompt="hello world", max_tokens=12,
        extra_body={"stop_token_ids": [ord("w")]},
    )  # fmt: skip
    # vLLM leaves the stop token's text out (unless include_stop_str_in_output) but
    # counts the token
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("hello ", "stop")
    assert r.choices[0].stop_reason == ord("w")  # type: ignore[attr-defined]
    assert r.usage is not None
    assert r.usage.completion_tokens == 7
    stream = await client.completions.create(
        model="", prompt="hello world", max_tokens=12, stop=["wor"], stream=True
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == "hello "
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_min_tokens_ignore_eos_and_sampling_fields(client: openai.AsyncOpenAI) -> None:
    r = await client.completions.create(
        model="", prompt="ab", max_tokens=5, temperature=0.7, top_p=0.9, seed=3,
        extra_body={"top_k": 5, "min_tokens": 2, "ignore_eos": True, "min_p": 0.0,
                    "repetition_penalty": 1.0},
    )  # fmt: skip
    assert r.choices[0].text == "ababa"


async def test_logprobs(client: openai.AsyncOpenAI) -> None:
    r = await client.completions.create(model="", prompt="hey", max_tokens=3, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp is not None
    assert lp.tokens == ["h", "e", "y"]
    assert lp.text_offset == [0, 1, 2]
    assert lp.token_logprobs is not None
    assert len(lp.token_logprobs) == 3
    assert all(x is not None and x <= 0 for x in lp.token_logprobs)
    assert lp.top_logprobs is not None
    assert all("hey"[i] in top for i, top in enumerate(lp.top_logprobs))
    chat = await client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "x"}], max_tokens=2, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs
    assert content is not None
    assert content.content is not None
    assert len(content.content) == 2
    for entry in content.content:
        assert entry.bytes == list(entry.token.encode())
        assert 1 <= len(entry.top_logprobs) <= 2
    stream = await client.completions.create(
        model="", prompt="hey", max_tokens=3, logprobs=0, stream=True
    )
    tokens, offsets = [], []
    async for chunk in stream:
        assert chunk.choices[0].logprobs is not None
        tokens += chunk.choices[0].logprobs.tokens or []
        offsets += chunk.choices[0].logprobs.text_offset or []
    assert (tokens, offsets) == (["h", "e", "y"], [0, 1, 2])


async def test_errors(client: openai.AsyncOpenAI, frontend: LLM) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        await client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert "does not exist" in str(nf.value)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model="", prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError) as long_prompt:
        await client.completions.create(model="", prompt="x" * (frontend.max_model_len + 1))
    assert "maximum context length" in str(long_prompt.value)
    with pytest.raises(openai.BadRequestError) as too_many:
        await client.completions.create(model="", prompt="x", max_tokens=frontend.max_model_len + 1)
    assert "max_tokens" in str(too_many.value)
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="", messages=[], max_tokens=1)
    r = await client.completions.create(model="", prompt="still", max_tokens=5)
    assert r.choices[0].text == "still"


async def test_api_key(frontend: LLM, anyio_backend: str) -> None:
    async with serving(frontend, api_keys=["s3cret"]) as served:
        async with openai.AsyncOpenAI(
            base_url=f"{served.base_url}/v1", api_key="wrong", max_retries=0
        ) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.completions.create(model="", prompt="x", max_tokens=1)
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
        async with openai.AsyncOpenAI(
            base_url=f"{served.base_url}/v1", api_key="s3cret", max_retries=0
        ) as good:
            r = await good.completions.create(model="", prompt="ok", max_tokens=2)
            assert r.choices[0].text == "ok"
        async with httpx.AsyncClient(base_url=served.base_url) as http:
            assert (await http.get("/health")).status_code == 200  # not guarded, as vLLM
            no_key = await http.get("/v1/models")
            assert (no_key.status_code, no_key.json()) == (401, {"error": "Unauthorized"})


async def test_sync_client(served: Served) -> None:
    def run() -> tuple[str, str]:
        with openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="x", max_retries=0) as c:
            r = c.completions.create(model="", prompt="sync me", max_tokens=4)
            streamed = "".join(
                chunk.choices[0].delta.content or ""
                for chunk in c.chat.completions.create(
                    model="", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                    stream=True,
                )
            )  # fmt: skip
            return r.choices[0].text, streamed

    text, streamed = await anyio.to_thread.run_sync(run)
    assert text == "sync"
    assert len(streamed) == 3


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl(served: Served) -> None:
    url = f"{served.base_url}/v1/completions"
    body = json.dumps({"prompt": "curl!", "max_tokens": 5})
    done = await anyio.run_process(
        ["curl", "-sS", url, "-H", "Content-Type: application/json", "-d", body]
    )
    assert json.loads(done.stdout)["choices"][0]["text"] == "curl!"
    body = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                       "stream": True})  # fmt: skip
    done = await anyio.run_process(
        ["curl", "-sSN", f"{served.base_url}/v1/chat/completions",
         "-H", "Content-Type: application/json", "-d", body]
    )  # fmt: skip
    events = sse_events(done.stdout)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    done = await anyio.run_process(
        ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", f"{served.base_url}/health"]
    )
    assert done.stdout == b"200"


async def test_models_version_metrics(served: Served, client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == served.app.model_names
    assert models.data[0].max_model_len == served.app.llm.max_model_len  # type: ignore[attr-defined]
    await client.completions.create(model="", prompt="metrics", max_tokens=3)
    async for _ in await client.completions.create(
        model="", prompt="metrics", max_tokens=3, stream=True
    ):
        pass
    async with httpx.AsyncClient(base_url=served.base_url) as http:
        version = (await http.get("/version")).json()
        text = (await http.get("/metrics")).text
    assert version == {"version": __import__("trio_vllm").__version__}
    lines = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    name = served.app.model_names[0]
    success = f'vllm:request_success_total{{finished_reason="length",model_name="{name}"}}'
    assert float(lines[success]) == 2
    assert float(lines[f'vllm:generation_tokens_total{{model_name="{name}"}}']) == 6
    assert float(lines[f'vllm:prompt_tokens_total{{model_name="{name}"}}']) == 14
    assert float(lines[f'vllm:time_to_first_token_seconds_count{{model_name="{name}"}}']) == 2
    assert float(lines[f'vllm:num_requests_running{{model_name="{name}"}}']) == 0
    ok = 'trio_vllm:http_requests_total{endpoint="/v1/completions",status="200"}'
    assert float(lines[ok]) == 2


async def test_unknown_fields_are_ignored_with_a_warning(
    client: openai.AsyncOpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="trio_vllm.server"):
        r = await client.completions.create(
            model="", prompt="extra", max_tokens=5, extra_body={"frobnicate": 3}
        )
    assert r.choices[0].text == "extra"
    assert any("frobnicate" in rec.getMessage() for rec in caplog.records)


async def test_several_prompts(client: openai.AsyncOpenAI) -> None:
    r = await client.completions.create(
        model="", prompt=["abc", "xyz"], max_tokens=3, n=2, temperature=0.5, seed=1
    )
    assert [(c.index, c.text) for c in r.choices] == [
        (0, "abc"), (1, "abc"), (2, "xyz"), (3, "xyz"),
    ]  # fmt: skip
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (6, 12)
    texts: dict[int, str] = {}
    async for chunk in await client.completions.create(
        model="", prompt=[[104, 105], [111, 107]], max_tokens=4, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: "hihi", 1: "okok"}
