"""Bad requests get 4xx JSON errors with vLLM's status codes; the server keeps serving."""

from __future__ import annotations

import json

import anyio
import pytest

from ._util import Served, raw_request, serving, wait_until

pytestmark = pytest.mark.anyio

_JSON = {"content-type": "application/json"}


async def _post(served: Served, path: str, body: bytes, headers: dict[str, str] | None = None):
    return await raw_request(served.port, "POST", path, body, {**_JSON, **(headers or {})})


async def _still_serving(served: Served) -> None:
    status, _, data = await _post(
        served, "/v1/completions", json.dumps({"prompt": "ok", "max_tokens": 2}).encode()
    )
    assert status == 200, data
    assert json.loads(data)["choices"][0]["text"] == "ok"
    # the registry entry goes once the handler returns, just after the last byte
    await wait_until(lambda: not served.app.open_requests, timeout=30)  # a hang guard


def _error(data: bytes) -> dict[str, object]:
    body = json.loads(data)
    assert set(body) == {"error"}
    error = body["error"]
    assert isinstance(error, dict)
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b"{not json", None),
        ("/v1/completions", b"[1, 2]", None),
        ("/v1/completions", b'"a string"', None),
        ("/v1/completions", b"", None),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": "many"}', "max_tokens"),
        ("/v1/completions", b'{"prompt": "x", "temperature": [1]}', "temperature"),
        ("/v1/completions", b'{"prompt": {"a": 1}}', "prompt"),
        ("/v1/completions", b'{"prompt": ["a", 1]}', "prompt"),
        ("/v1/completions", b'{"prompt": "x", "stream": "yes please"}', "stream"),
        ("/v1/completions", b'{"prompt": "x", "n": 0}', None),
        ("/v1/completions", b'{"prompt": "x", "temperature": -0.5}', None),
        ("/v1/completions", b'{"prompt": "x", "top_p": 0}', "top_p"),
        ("/v1/completions", b'{"prompt": "x", "top_k": -7}', None),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": -3}', "max_tokens"),
        ("/v1/completions", b'{"prompt": "x", "min_tokens": -1}', None),
        ("/v1/completions", b'{"prompt": "x", "logprobs": -2}', "logprobs"),
        ("/v1/completions", b'{"prompt": "x", "seed": 99999999999999999999}', "seed"),
        ("/v1/completions", b'{"prompt": "x", "stream_options": {"include_usage": true}}',
         "stream_options"),
        ("/v1/completions", b'{"prompt": ""}', "prompt"),
        ("/v1/completions", b'{"prompt": [-1, 5]}', "prompt"),
        ("/v1/completions", b'{"prompt": [99999999]}', None),
        ("/v1/completions", b'{"prompt": "x", "use_beam_search": true}', "use_beam_search"),
        ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
        ("/v1/chat/completions", b'{"max_tokens": 3}', None),
        ("/v1/chat/completions", b'{"messages": [{"content": "no role"}]}', "messages"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
         b'"top_logprobs": 3}', "top_logprobs"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
         b'"tools": []}', "tools"),
    ],
)  # fmt: skip
async def test_bad_requests_get_400(
    served: Served, path: str, body: bytes, param: str | None
) -> None:
    # param None: not checked here (n, top_k and min_tokens get vLLM's param null: its
    # errors for them name no parameter; tests/protocol/test_rules.py checks every
    # rule's param).
    status, headers, data = await _post(served, path, body)
    assert status == 400, data
    assert headers["content-type"] == "application/json"
    error = _error(data)
    assert error["code"] == 400
    if param is not None:
        assert error["param"] == param, error
    await _still_serving(served)


async def test_wrong_content_type(served: Served) -> None:
    status, _, data = await _post(
        served, "/v1/completions", b"prompt=x",
        {"content-type": "application/x-www-form-urlencoded"},
    )  # fmt: skip
    assert status == 400
    assert "application/json" in str(_error(data)["message"])


async def test_prompts_over_the_limit(served: Served) -> None:
    limit = served.app.llm.max_model_len
    for prompt in ("y" * (limit + 1), "y" * (limit * 100), [5] * (limit + 1)):
        status, _, data = await _post(
            served, "/v1/completions", json.dumps({"prompt": prompt}).encode()
        )
        assert status == 400
        assert "maximum context length" in str(_error(data)["message"])
    status, _, data = await _post(
        served, "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "z" * (limit + 5)}]}).encode(),
    )  # fmt: skip
    assert status == 400
    assert "maximum context length" in str(_error(data)["message"])
    await _still_serving(served)


async def test_unknown_model_404_and_routes(served: Served) -> None:
    status, _, data = await _post(
        served, "/v1/completions", json.dumps({"model": "gpt-5", "prompt": "x"}).encode()
    )
    assert status == 404
    error = _error(data)
    assert (error["type"], error["param"]) == ("NotFoundError", "model")
    status, _, data = await raw_request(served.port, "GET", "/v1/nothing-here")
    assert (status, json.loads(data)) == (404, {"detail": "Not Found"})
    status, _, _ = await raw_request(served.port, "GET", "/v1/completions")
    assert status == 405
    await _still_serving(served)


async def test_huge_bodies_get_413(frontend: object) -> None:
    async with serving(frontend, max_body_bytes=10_000) as served:  # type: ignore[arg-type]
        body = json.dumps({"prompt": "x" * 20_000}).encode()
        status, _, data = await _post(served, "/v1/completions", body)
        assert status == 413
        assert _error(data)["code"] == 413
        # without a content-length: chunked upload, refused once it passes the limit
        async with await anyio.connect_tcp("127.0.0.1", served.port) as stream:
            await stream.send(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                b"\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            for _ in range(5):
                await stream.send(b"1000\r\n" + b"x" * 0x1000 + b"\r\n")
            received = b""
            with anyio.fail_after(30):
                while b"\r\n\r\n" not in received:
                    received += await stream.receive()
            assert received.startswith(b"HTTP/1.1 413")
        await _still_serving(served)
