"""A request's own chat template (``chat_template``, ``chat_template_kwargs.chat_template``)
is refused with vLLM's 400 unless the server runs with ``--trust-request-chat-template``,
on ``/v1/chat/completions`` and ``/tokenize`` (reference engine, byte-level model dir)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx
import pytest

from trio_vllm.cli._main import _build_parser

if TYPE_CHECKING:
    from ._util import Served

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "user", "content": "Hi"}]
TEMPLATE = "[{% for m in messages %}{{ m['content'] }}{% endfor %}]"
UNTRUSTED = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


async def test_request_chat_template_needs_trust(served: Served) -> None:
    bodies = [
        {"chat_template": TEMPLATE},
        {"chat_template_kwargs": {"chat_template": TEMPLATE}},
    ]
    async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as http:
        assert not served.app.trust_request_chat_template  # vllm serve's default
        for path, base in (
            ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}),
            ("/tokenize", {"messages": MESSAGES}),
        ):
            for extra in bodies:
                r = await http.post(path, json={**base, **extra})
                assert r.status_code == 400, (path, extra)
                assert r.json()["error"] == {"message": UNTRUSTED, "type": "BadRequestError",
                                             "param": None, "code": 400}  # fmt: skip
            # other chat_template_kwargs, or a null template, are no template: accepted
            for kwargs in ({"x": 1}, {"chat_template": None}):
                r = await http.post(path, json={**base, "chat_template_kwargs": kwargs})
                assert r.status_code == 200, r.text
        served.app.trust_request_chat_template = True  # as --trust-request-chat-template
        try:
            r = await http.post("/tokenize", json={"messages": MESSAGES, **bodies[0]})
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] == list(b"[Hi]")  # the request's template ran
            # the kwarg is the template when the field is not given (vLLM's merge)
            r = await http.post("/tokenize", json={"messages": MESSAGES, **bodies[1]})
            assert r.json()["tokens"] == list(b"[Hi]")
            r = await http.post(
                "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, **bodies[1]}
            )
            assert r.status_code == 200, r.text
            # the field wins over the kwarg
            r = await http.post("/tokenize", json={
                "messages": MESSAGES, "chat_template": "<{{ messages[0]['content'] }}>",
                "chat_template_kwargs": {"chat_template": TEMPLATE}})  # fmt: skip
            assert r.json()["tokens"] == list(b"<Hi>")
        finally:
            served.app.trust_request_chat_template = False


def test_the_serve_flag() -> None:
    parser = _build_parser()
    assert not parser.parse_args(["serve"]).trust_request_chat_template
    assert parser.parse_args(["serve", "--trust-request-chat-template"]).trust_request_chat_template
