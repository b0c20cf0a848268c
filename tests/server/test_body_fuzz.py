"""Every request body, however broken, is a JSON 4xx in vLLM's error shape (issue 23).

Sans-I/O first: Hypothesis drives the server's one decode path (`decode_request`, and
`decode_embedding_request` for ``/v1/embeddings``) and the planning that follows it
(`plan_completion`/`plan_chat`/`plan_embedding` over a stand-in frontend with the
shipped byte-level tokenizer) with raw bytes, mutated valid bodies and JSON
structures over the request's own field names. The property: the body is accepted, or
refused with `HTTPError` 4xx whose body is ``{"error": {message, type, param, code}}``;
any other exception fails the test. Then a handful of nasty bodies through the real
HTTP server (hypercorn): 4xx JSON answers, and no traceback in the log.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_vllm.reference_engine import MODEL_DIR
from trio_vllm.server._decode import decode_request
from trio_vllm.server._embeddings import (
    EmbeddingRequest,
    decode_embedding_request,
    plan_embedding,
    pooling_params,
)
from trio_vllm.server._http import HTTPError
from trio_vllm.server._openai import plan_chat, plan_completion
from trio_vllm.server._schemas import (
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
)
from trio_vllm.text import InputProcessor, ModelFiles, SamplingDefaults

from ._util import Served, raw_request, serving

if TYPE_CHECKING:
    from collections.abc import Sequence

    from trio_vllm.llm import LLM
    from trio_vllm.text import ChatMessage

_TOKENIZER = ModelFiles(MODEL_DIR).load_tokenizer()
_JSON = b"application/json"


class _Frontend:
    """What plan_completion/plan_chat read of the text frontend."""

    tokenizer = _TOKENIZER
    max_model_len = 64
    sampling_defaults = SamplingDefaults({}, source="none")
    _inputs = InputProcessor(_TOKENIZER, max_model_len=64)

    def render_chat(self, messages: Sequence[ChatMessage], **options: Any) -> tuple[str, list[int]]:
        return self._inputs.render_chat(messages, **options)


_FRONTEND = _Frontend()


def _outcome(kind: str, body: bytes, content_type: bytes | None = _JSON) -> int:
    """200 if the body decodes and plans; else the status of its `HTTPError` (checked)."""
    refusal: HTTPError | None = None
    try:
        if kind == "embedding":
            ereq = decode_embedding_request(content_type, body)
            plan_embedding(ereq, _TOKENIZER)
            pooling_params(ereq)
        else:
            req, extra = decode_request(kind, content_type, body)  # type: ignore[arg-type]
            if isinstance(req, CompletionRequest):
                plan_completion(req, _FRONTEND, model="m", header_request_id=None, extra=extra)  # type: ignore[arg-type]
            else:  # with --trust-request-chat-template: the request's templates run
                plan_chat(req, _FRONTEND, model="m", header_request_id=None, extra=extra,  # type: ignore[arg-type]
                          trust_request_chat_template=True)  # fmt: skip
    except HTTPError as exc:  # anything else fails the test
        refusal = exc
    if refusal is None:
        return 200
    assert 400 <= refusal.status < 500, refusal.message
    error = msgspec.json.decode(refusal.body())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == refusal.status
    assert isinstance(error["message"], str)
    assert error["message"]
    return refusal.status


_SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_KINDS = st.sampled_from(["completion", "chat", "embedding"])
_VALID = {
    "completion": b'{"prompt": "hello", "max_tokens": 3, "temperature": 0.5, "stop": ["x"]}',
    "chat": b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 1}',
    "embedding": b'{"input": ["hello", "x"], "encoding_format": "base64", "model": "m"}',
}
_REQUIRED = {"completion": "prompt", "chat": "messages", "embedding": "input"}


@_SETTINGS
@given(kind=_KINDS, body=st.binary(max_size=300))
def test_raw_bytes(kind: str, body: bytes) -> None:
    _outcome(kind, body)


@_SETTINGS
@given(kind=_KINDS, data=st.data())
def test_mutated_valid_bodies(kind: str, data: st.DataObject) -> None:
    body = bytearray(_VALID[kind])
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(body)))
        op = data.draw(st.sampled_from(["insert", "flip", "cut"]))
        if op == "insert":
            body[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "flip" and at < len(body):
            body[at] = data.draw(st.integers(0, 255))
        else:
            del body[at : at + data.draw(st.integers(1, 8))]
    _outcome(kind, bytes(body))


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(["user", "assistant", "system", "text", "nan", "inf", "1", "-1", "1e400"])
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["role", "content", "type", "text", "1"]) | st.text(max_size=5),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)
_NAMES = {
    "completion": sorted({*CompletionRequest.__struct_fields__, *UNSUPPORTED_FIELDS}),
    "chat": sorted({*ChatCompletionRequest.__struct_fields__, *UNSUPPORTED_FIELDS}),
    "embedding": sorted({*EmbeddingRequest.__struct_fields__, "normalize", "task"}),
}


@_SETTINGS
@given(kind=_KINDS, data=st.data())
def test_json_structures(kind: str, data: st.DataObject) -> None:
    base: dict[str, object] = json.loads(_VALID[kind])
    names = st.sampled_from(_NAMES[kind]) | st.text(max_size=8)
    base.update(data.draw(st.dictionaries(names, _VALUES, max_size=5)))
    if data.draw(st.booleans()):
        del base[_REQUIRED[kind]]
    # json.dumps writes NaN/Infinity for non-finite floats, as a sloppy client does
    _outcome(kind, json.dumps(base).encode())


@_SETTINGS
@given(kind=_KINDS, value=_VALUES)
def test_top_level_values(kind: str, value: object) -> None:
    assert _outcome(kind, json.dumps(value).encode()) in (200, 400)


@pytest.mark.parametrize("depth", [100, 1_000, 10_000, 100_000])
@pytest.mark.parametrize(
    ("kind", "head", "tail"),
    [
        ("completion", b'{"prompt": ', b"}"),
        ("completion", b'{"prompt": "x", "unknown": ', b"}"),
        ("chat", b'{"messages": [{"role": "user", "content": ', b"}]}"),
        (
            "chat",
            b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": ',
            b"}}",
        ),
        ("completion", b"", b""),
        ("embedding", b'{"input": ', b"}"),
        ("embedding", b'{"input": "x", "mm_processor_kwargs": {"a": ', b"}}"),
    ],
)
def test_deep_nesting(kind: str, head: bytes, tail: bytes, depth: int) -> None:
    # a moderate depth may be accepted (vLLM's json.loads takes ~990 levels); past the
    # decoder's recursion limit it is a 400, never a RecursionError
    expected = {400} if depth >= 10_000 else {200, 400}
    assert _outcome(kind, head + b"[" * depth + b"]" * depth + tail) in expected
    assert _outcome(kind, head + b'{"a":' * depth + b"1" + b"}" * depth + tail) in expected


NASTY: list[tuple[str, bytes]] = [
    ("completion", b'{"prompt": "a\xff"}'),  # not UTF-8 inside a string
    ("completion", b'{"prompt": "a", "unknown": "\xc3"}'),  # ... inside an unknown key
    ("completion", b"\xff\xfe{}"),
    ("completion", b'{"prompt": "x", "temperature": NaN}'),
    ("completion", b'{"prompt": "x", "temperature": -Infinity}'),
    ("completion", b'{"prompt": "\\ud800"}'),  # a lone surrogate
    ("completion", b'{"prompt": "x", "max_tokens": 1e400}'),
    ("completion", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"),
    ("completion", b'{"prompt": [' + b"9" * 5000 + b"]}"),
    ("completion", b"null"),
    ("completion", b'{"prompt": "x"} trailing'),
    ("chat", b'{"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1/0 }}"}'),
    ("chat", b'{"messages": [{"role": "user", "content": "x"}], '
             b'"chat_template": "{% for i in range(10**9) %}{% endfor %}"}'),
    ("chat", b'{"messages": [{"role": "user", "content": "x"}], '
             b'"chat_template": "{{ messages[0].content + 1 }}"}'),
    ("chat", b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []}'),
    ("chat", b'{"messages": "hi"}'),
    ("embedding", b'{"input": "a\xff"}'),
    ("embedding", b'{"input": [[1, 2], "a"]}'),
    ("embedding", b'{"input": [1, 2.5]}'),
    ("embedding", b'{"input": [' + b"9" * 5000 + b"]}"),
    ("embedding", b'{"input": {"a": 1}}'),
    ("embedding", b'{"input": "x", "dimensions": 1e400}'),
    ("embedding", b'{"input": "x", "encoding_format": "bytes"}'),
    ("embedding", b'{"input": "x", "truncate_prompt_tokens": NaN}'),
    ("embedding", b'{"input": []}'),
    ("embedding", b"[]"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "body"), NASTY)
def test_nasty_bodies_are_400(kind: str, body: bytes) -> None:
    assert _outcome(kind, body) == 400


@pytest.mark.parametrize("content_type", [None, b"text/plain", b"application/jsonx", b"\xff"])
def test_wrong_content_type(content_type: bytes | None) -> None:
    assert _outcome("completion", _VALID["completion"], content_type) == 400


def test_duplicate_keys_and_a_bom_as_python_json() -> None:
    req, _ = decode_request("completion", _JSON, b'{"prompt": "a", "prompt": "b"}')
    assert isinstance(req, CompletionRequest)
    assert req.prompt == "b"
    req, _ = decode_request("completion", _JSON, b'\xef\xbb\xbf{"prompt": "c"}')
    assert isinstance(req, CompletionRequest)
    assert req.prompt == "c"
    assert _outcome("completion", b"\xef\xbb\xbf\xef\xbb\xbf{}") == 400  # one BOM only


# ----------------------------------------------------------------------- through HTTP


@pytest.mark.anyio
async def test_nasty_bodies_through_the_server(
    frontend: LLM, caplog: pytest.LogCaptureFixture
) -> None:
    paths = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
    deep = b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    # (the embeddings ones go through a pooling server in test_embeddings.py)
    cases = [*((k, b) for k, b in NASTY if k in paths), ("completion", deep)]
    with caplog.at_level(logging.INFO):
        async with serving(
            frontend, max_body_bytes=200_000, trust_request_chat_template=True
        ) as served:
            for kind, body in cases:
                status, _, data = await _post(served, paths[kind], body)
                assert status == 400, (body[:60], data[:200])
                assert set(json.loads(data)["error"]) == {"message", "type", "param", "code"}
            status, _, data = await _post(served, paths["completion"], b"[" * 300_000)
            assert status == 413
            assert json.loads(data)["error"]["code"] == 413
            status, _, data = await _post(
                served, paths["completion"], b'{"prompt": "ok", "max_tokens": 2}'
            )
            assert (status, json.loads(data)["choices"][0]["text"]) == (200, "ok")
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert "Traceback" not in caplog.text


async def _post(served: Served, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    return await raw_request(served.port, "POST", path, body, {"content-type": "application/json"})


# ------------------------------------------------ the other endpoints with a body


def _other_decoders() -> list[Any]:
    from trio_vllm.server._app import _LOAD_LORA, _UNLOAD_LORA
    from trio_vllm.server._decode import decode_struct
    from trio_vllm.server._tokenize import decode_detokenize_request, decode_tokenize_request

    return [
        decode_tokenize_request,
        decode_detokenize_request,
        lambda body: decode_struct(_LOAD_LORA, body),
        lambda body: decode_struct(_UNLOAD_LORA, body),
    ]


_OTHERS = _other_decoders()
_FEWER = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _other_outcome(index: int, body: bytes) -> int:
    refusal: HTTPError | None = None
    try:
        _OTHERS[index](body)
    except HTTPError as exc:  # anything else fails the test
        refusal = exc
    if refusal is None:
        return 200
    assert refusal.status == 400
    assert set(msgspec.json.decode(refusal.body())["error"]) == {"message", "type", "param", "code"}
    return 400


_OTHER_BODIES = [
    b'{"prompt": "a\xff"}',
    b'{"messages": [{"role": "user", "content": "\xc3"}]}',
    b'{"tokens": [' + b"9" * 100 + b"]}",
    b'{"lora_name": "a\xff", "lora_path": "x"}',
    b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"messages": "x", "continue_final_message": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b"\xef\xbb\xbf[]",
]


@pytest.mark.parametrize("index", range(len(_OTHERS)))
@pytest.mark.parametrize("body", _OTHER_BODIES)
def test_other_endpoints_nasty_bodies(index: int, body: bytes) -> None:
    _other_outcome(index, body)


@_FEWER
@given(index=st.integers(0, len(_OTHERS) - 1), body=st.binary(max_size=200))
def test_other_endpoints_raw_bytes(index: int, body: bytes) -> None:
    _other_outcome(index, body)


@_FEWER
@given(index=st.integers(0, len(_OTHERS) - 1), value=_VALUES, name=st.sampled_from(
    ["prompt", "messages", "tokens", "model", "lora_name", "lora_path", "add_special_tokens",
     "continue_final_message", "add_generation_prompt", "chat_template_kwargs"]
))  # fmt: skip
def test_other_endpoints_json_structures(index: int, value: object, name: str) -> None:
    _other_outcome(index, json.dumps({name: value}).encode())
