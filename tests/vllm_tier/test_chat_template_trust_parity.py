"""A request's own chat template: ``trio-vllm serve`` refuses it as ``vllm serve`` 0.32
does (status, type, message) unless both run with ``--trust-request-chat-template``,
and then renders with it as vLLM does (the same token ids from ``/tokenize``, the same
greedy answer from chat completions)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from ._servers import SERVED, serve_pair
from .test_tokens_parity import _error

pytestmark = pytest.mark.timeout(1500)

MESSAGES = [{"role": "user", "content": "Hi there"}]
TEMPLATE = "[{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}]"
CASES: list[tuple[str, dict[str, Any]]] = [
    ("/tokenize", {"messages": MESSAGES, "chat_template": TEMPLATE}),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": TEMPLATE}}),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": None}}),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "<{{ messages[0]['content'] }}>",
                   "chat_template_kwargs": {"chat_template": TEMPLATE}}),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template": TEMPLATE,
                              "max_tokens": 6, "temperature": 0}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6, "temperature": 0,
                              "chat_template_kwargs": {"chat_template": TEMPLATE}}),
]  # fmt: skip


def _run(port: int) -> list[Any]:
    out: list[Any] = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
        for path, body in CASES:
            r = http.post(path, json={"model": SERVED, **body})
            if r.status_code != 200:
                out.append(_error(r))
            elif path == "/tokenize":
                out.append(r.json()["tokens"])
            else:
                out.append([r.json()["choices"][0]["message"]["content"],
                            r.json()["usage"]["prompt_tokens"]])  # fmt: skip
    return out


def test_untrusted_request_templates_refused_as_vllm_serve() -> None:
    expected, got = serve_pair(_run)
    assert got == expected
    refused = [e for e in expected if isinstance(e, dict)]
    assert len(refused) == 5  # all but the null kwarg
    assert all(e["status"] == 400 and "--trust-request-chat-template" in e["message"]
               for e in refused)  # fmt: skip


def test_trusted_request_templates_render_as_vllm_serve() -> None:
    expected, got = serve_pair(_run, server_args=["--trust-request-chat-template"])
    assert got == expected
    assert not any(isinstance(e, dict) for e in expected)  # all rendered
    assert expected[0] == expected[1] != expected[2]  # the kwarg is the template
    assert expected[3] != expected[0]  # the field wins over the kwarg
