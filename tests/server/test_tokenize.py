"""``/tokenize`` and ``/detokenize`` over HTTP (reference engine, byte-level model dir:
a text's ids are its UTF-8 bytes, no BOS)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from ._util import Served

pytestmark = pytest.mark.anyio


async def test_tokenize_and_detokenize(served: Served) -> None:
    name = served.app.model_names[0]
    max_len = served.app.llm.max_model_len
    async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as http:
        r = await http.post("/tokenize", json={"prompt": "hé!", "model": name})
        assert r.status_code == 200, r.text
        ids = list("hé!".encode())
        assert r.json() == {"count": len(ids), "max_model_len": max_len, "tokens": ids,
                            "token_strs": None}  # fmt: skip
        r = await http.post("/tokenize", json={"prompt": "ab", "return_token_strs": True})
        assert r.json()["token_strs"] == ["a", "b"]

        messages = [{"role": "user", "content": "Hi"}]
        text, chat_ids = served.app.llm.render_chat(messages)
        r = await http.post("/tokenize", json={"messages": messages})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == chat_ids == list(text.encode())
        assert r.json()["count"] == len(chat_ids)
        r = await http.post(
            "/tokenize", json={"messages": messages, "add_generation_prompt": False}
        )
        bare = r.json()["tokens"]
        assert bare == chat_ids[: len(bare)]
        assert len(bare) < len(chat_ids)
        r = await http.post(
            "/tokenize",
            json={"messages": messages, "add_generation_prompt": True,
                  "continue_final_message": True},
        )  # fmt: skip
        assert r.status_code == 400
        assert "Cannot set both" in r.json()["error"]["message"]  # vLLM's validator
        r = await http.post(
            "/tokenize", json={"messages": messages, "continue_final_message": True}
        )
        assert r.status_code == 400  # the default add_generation_prompt: transformers' text
        assert "are not compatible" in r.json()["error"]["message"]

        # no length check, as vLLM: a prompt longer than the context is counted
        r = await http.post("/tokenize", json={"prompt": "x" * (max_len + 10)})
        assert r.json()["count"] == max_len + 10

        r = await http.post("/detokenize", json={"tokens": list("héllo".encode())})
        assert r.status_code == 200, r.text
        assert r.json() == {"prompt": "héllo"}
        r = await http.post("/detokenize", json={"tokens": [-1]})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "tokens"

        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [97]})):
            r = await http.post(path, json={**body, "model": "nope"})
            assert r.status_code == 404
            assert r.json()["error"]["type"] == "NotFoundError"
        r = await http.post("/tokenize", json={})
        assert r.status_code == 400
        r = await http.post("/tokenize", content=b"{}", headers={"content-type": "text/plain"})
        assert r.status_code == 400
        r = await http.get("/tokenize")
        assert r.status_code == 405
