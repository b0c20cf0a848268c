"""``POST /v1/embeddings`` (issue 22) through the official ``openai`` client and raw
HTTP, on a reference engine in pooling mode (echo model: an embedding is the one-hot
state of the prompt's last token, so every expected vector follows from the prompt)."""

from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest

import trio_vllm as tv
from trio_vllm.llm import open_llm

from ._util import raw_request, serving
from .test_body_fuzz import NASTY

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

HIDDEN = 64
JSON = {"content-type": "application/json"}


def one_hot(token: int) -> list[float]:
    vec = [0.0] * HIDDEN
    vec[token % HIDDEN] = 1.0
    return vec


async def post(port: int, body: object, path: str = "/v1/embeddings") -> tuple[int, dict]:
    status, _, data = await raw_request(port, "POST", path, json.dumps(body).encode(), JSON)
    return status, json.loads(data)


async def test_embeddings_endpoint() -> None:
    engines = tv.ReferenceEngines(1, model="echo", extra_args=["--supported-tasks", "embed"])
    async with open_llm(engines) as llm:
        tasks = await llm.supported_tasks()
        async with serving(llm, supported_tasks=tasks) as served:
            async with openai.AsyncOpenAI(
                base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0
            ) as client:
                one = await client.embeddings.create(model=llm.model_name, input="hello")
                assert one.model == llm.model_name
                assert one.data[0].embedding == one_hot(ord("o"))
                assert (one.usage.prompt_tokens, one.usage.total_tokens) == (5, 5)
                batch = await client.embeddings.create(model=llm.model_name, input=["ab", "xyz"])
                assert [d.index for d in batch.data] == [0, 1]
                assert [d.embedding for d in batch.data] == [one_hot(ord("b")), one_hot(ord("z"))]
                assert batch.usage.prompt_tokens == 5
                ids = await client.embeddings.create(model=llm.model_name, input=[1, 2, 70])
                assert ids.data[0].embedding == one_hot(70)
                lists = await client.embeddings.create(
                    model=llm.model_name, input=[[1, 2, 70], [3]]
                )
                assert [d.embedding for d in lists.data] == [one_hot(70), one_hot(3)]
                assert lists.usage.prompt_tokens == 4
                # Asked for explicitly, base64 comes back as the string (by default the
                # client asks for base64 itself and decodes it: the calls above).
                b64 = await client.embeddings.create(
                    model=llm.model_name, input="hello", encoding_format="base64"
                )
                decoded = np.frombuffer(base64.b64decode(str(b64.data[0].embedding)), "<f4")
                assert decoded.tolist() == one.data[0].embedding
                floats = await client.embeddings.create(
                    model=llm.model_name, input="hello", encoding_format="float"
                )
                assert floats.data[0].embedding == one.data[0].embedding
                with pytest.raises(openai.BadRequestError) as info:
                    await client.embeddings.create(model=llm.model_name, input="hi", dimensions=8)
                assert info.value.body["message"] == (  # type: ignore[index]
                    "Model 'trio-vllm-reference' does not support Matryoshka embeddings; "
                    "dimensions must be unset (received dimensions=8)."
                )
            port = served.port
            status, body = await post(port, {"input": "hello", "encoding_format": "base64"})
            assert status == 200
            raw = base64.b64decode(body["data"][0]["embedding"])
            assert np.frombuffer(raw, dtype="<f4").tolist() == one_hot(ord("o"))
            assert body["object"] == "list"
            assert body["id"].startswith("embd-")
            assert body["usage"] == {
                "prompt_tokens": 5,
                "total_tokens": 5,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            }
            status, body = await post(port, {"input": ["a", [1, 2]]})  # a mixed batch
            error = body["error"]
            assert (status, error["type"], error["param"]) == (400, "Bad Request", "body.input.0")
            status, body = await post(port, {"input": [1, 2, "a"]})
            assert (status, body["error"]["param"]) == (400, "body.input.2")
            status, body = await post(port, {"input": []})
            assert (status, body["error"]["message"]) == (400, "You must pass at least one prompt")
            status, body = await post(port, {"input": [5] * 3000})
            assert status == 400
            assert body["error"]["param"] == "input_tokens"
            assert "maximum context length is 2048 tokens" in body["error"]["message"]
            status, body = await post(port, {"input": "x", "model": "nope"})
            assert (status, body["error"]["message"]) == (404, "The model `nope` does not exist.")
            # Malformed bodies: the one decode path's 400s, in vLLM's error shape.
            for kind, nasty in NASTY:
                if kind == "embedding":
                    status, _, data = await raw_request(port, "POST", "/v1/embeddings", nasty, JSON)
                    assert status == 400, (nasty[:60], data[:200])
                    assert set(json.loads(data)["error"]) == {"message", "type", "param", "code"}
            status, _, data = await raw_request(
                port, "POST", "/v1/embeddings", b'{"input": "x"}', {**JSON, "x-request-id": "h1"}
            )
            assert (status, json.loads(data)["id"]) == (200, "embd-h1")
            status, body = await post(port, {"input": "x", "request_id": "b2"})
            assert (status, body["id"]) == (200, "embd-b2")
            status, body = await post(port, {"input": "x", "priority": 3})
            assert (status, body["error"]["param"]) == (400, "priority")
            # vLLM's removed parameters, refused before any field is read
            status, body = await post(port, {"input": 5, "normalize": True})
            assert (status, body["error"]["param"]) == (400, "normalize")
            assert body["error"]["message"] == (
                "Parameter `normalize` was removed; use `use_activation` instead. "
                "(parameter=normalize)"
            )
            status, body = await post(port, {"input": "x", "task": "encode"})
            assert (status, body["error"]["param"]) == (400, "task")
            status, body = await post(port, {"input": "x", "task": "embed"})  # ignored
            assert status == 200
            # A pooling engine offers no generation routes (vllm serve's choice).
            status, body = await post(port, {"prompt": "x"}, "/v1/completions")
            assert (status, body) == (404, {"detail": "Not Found"})
            assert llm.client.live_requests == []


async def test_no_embeddings_on_a_generate_only_server() -> None:
    engines = tv.ReferenceEngines(1, model="echo", extra_args=["--supported-tasks", "generate"])
    async with open_llm(engines) as llm:
        tasks = await llm.supported_tasks()
        async with serving(llm, supported_tasks=tasks) as served:
            status, body = await post(served.port, {"input": "hello"})
            assert (status, body) == (404, {"detail": "Not Found"})
            status, _ = await post(served.port, {"prompt": "x", "max_tokens": 1}, "/v1/completions")
            assert status == 200
