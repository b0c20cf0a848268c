"""Malformed request bodies: ``trio-vllm serve`` answers each with the status ``vllm
serve`` gives it, and (where vLLM answers in its error shape) the same error ``type``
(issue 23). Both servers run the tiny model in turn (``serve_both``).

``vllm serve`` parses with Python's ``json``, so a few answers differ in kind, though
never in status: those cases are in `STATUS_ONLY`, with why. trio-vllm's answer is
always vLLM's error shape, ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from ._servers import SERVED, serve_pair

pytestmark = pytest.mark.timeout(1800)

_P = "/v1/completions"
_C = "/v1/chat/completions"
_J = "application/json"
_N = b"9" * 40
_M = b'"model": "' + SERVED.encode() + b'", '
_MSG = b'"messages": [{"role": "user", "content": "hi"}]'
_DEEP = b"[" * 5000 + b"]" * 5000

# (path, content type, body): status and error type must match vLLM's.
SAME: list[tuple[str, str | None, bytes]] = [
    (_P, _J, b"\xff\xfe{}"),
    (_P, _J, b"null"),
    (_P, _J, b"[]"),
    (_P, _J, b'"x"'),
    (_P, _J, b""),
    (_P, _J, b"{" + _M + b'"prompt": "x"} trailing'),
    (_P, _J, b"\xef\xbb\xbf{" + _M + b'"prompt": "x", "max_tokens": 2}'),  # a BOM: 200
    (_P, _J, b"{" + _M + b'"prompt": "x", "prompt": "y", "max_tokens": 2}'),  # 200
    (_P, _J, b"{" + _M + b'"prompt": "x", "max_tokens": ' + _N + b"}"),
    (_P, _J, b"{" + _M + b'"prompt": "x", "max_tokens": 1e400}'),
    (_P, _J, b"{" + _M + b'"prompt": "x", "max_tokens": 2.5}'),
    (_P, _J, b"{" + _M + b'"prompt": "x", "max_tokens": "2"}'),  # lax: 200
    (_P, _J, b"{" + _M + b'"prompt": {"a": 1}}'),
    (_P, _J, b"{" + _M + b'"prompt": "x", "stop": [1]}'),
    (_P, _J, b"{" + _M + b'"prompt": "x", "temperature": "nan", "max_tokens": 2}'),
    (_P, "text/plain", b"{" + _M + b'"prompt": "x", "max_tokens": 2}'),
    (_P, None, b"{" + _M + b'"prompt": "x", "max_tokens": 2}'),
    (_C, _J, b"{" + _M + b'"messages": "hi"}'),
    (_C, _J, b"{" + _M + b'"messages": [1]}'),
    (_C, _J, b"{" + _M + _MSG + b', "max_tokens": 2, "chat_template": "{{ 1/0 }}"}'),
]  # fmt: skip

# Same status, another kind of answer from vLLM.
STATUS_ONLY: list[tuple[str, str | None, bytes]] = [
    # vLLM: {"detail": "There was an error parsing the body"} (FastAPI's, not its error
    # shape): bytes that are not UTF-8, nesting past json's recursion limit.
    (_P, _J, b"{" + _M + b'"prompt": "a\xff"}'),
    (_P, _J, b"{" + _M + b'"prompt": ' + _DEEP + b"}"),
    (_P, _J, b"{" + _M + b'"prompt": "x", "unknown": ' + _DEEP + b"}"),
    (_C, _J, b"{" + _M + b'"messages": [{"role": "user", "content": "a\xc3"}]}'),
    (_C, _J, b"{" + _M + b'"messages": [{"role": "user", "content": ' + _DEEP + b"}]}"),
    # vLLM parses NaN/Infinity (json.loads does), then its sampling rule refuses them
    # (BadRequestError); trio-vllm's decoder refuses them as invalid JSON (Bad Request).
    (_P, _J, b"{" + _M + b'"prompt": "x", "max_tokens": 2, "temperature": NaN}'),
    (_P, _J, b"{" + _M + b'"prompt": "x", "max_tokens": 2, "temperature": Infinity}'),
    (_P, _J, b"{" + _M + b'"prompt": "x", "max_tokens": 2, "top_p": NaN}'),
    # A lone surrogate: vLLM's tokenizer refuses it (BadRequestError), trio-vllm's
    # decoder (Bad Request).
    (_P, _J, b"{" + _M + b'"prompt": "\\ud800", "max_tokens": 2}'),
]  # fmt: skip


def _answer(response: httpx.Response) -> list[Any]:
    try:
        body = response.json()
    except ValueError:
        return [response.status_code, "not JSON", response.text[:200]]
    if response.status_code == 200:
        return [200, None]
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return [response.status_code, "not the error shape", body]
    return [response.status_code, error.get("type"), sorted(error)]


def run_bodies(port: int) -> list[Any]:
    results: list[Any] = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
        for path, content_type, body in [*SAME, *STATUS_ONLY]:
            headers = {} if content_type is None else {"content-type": content_type}
            results.append(_answer(http.post(path, content=body, headers=headers)))
        # still serving after all of them
        ok = http.post(_P, json={"model": SERVED, "prompt": "x", "max_tokens": 2})
        results.append(ok.status_code)
    return results


def test_malformed_bodies_as_vllm_serve() -> None:
    expected, got = serve_pair(run_bodies)
    assert expected[-1] == got[-1] == 200
    n = len(SAME)
    mismatches = [
        (path, body[:80], want, have)
        for (path, _, body), want, have in zip(SAME, expected[:n], got[:n], strict=True)
        if want[:2] != have[:2]
    ]
    assert mismatches == [], "\n".join(map(repr, mismatches))
    shape = ["code", "message", "param", "type"]
    for (path, _, body), want, have in zip(STATUS_ONLY, expected[n:-1], got[n:-1], strict=True):
        assert want[0] == have[0] == 400, (path, body[:80], want, have)
        assert have[2] == shape, (path, body[:80], have)
    # ours is always the error shape, and the cases are not vacuous
    assert all(have[2] == shape for have in got[:-1] if have[0] != 200)
    assert [want[0] for want in expected[:n]].count(200) == 3
