"""``prompt_logprobs`` on ``/v1/completions`` and ``/v1/chat/completions`` (openai client,
reference engine): the text layer's prompt logprobs in vLLM's response shape."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

from trio_vllm.protocol import SamplingParams

if TYPE_CHECKING:
    from ._util import Served

pytestmark = pytest.mark.anyio


def _as_json(positions: Any) -> list[Any]:
    return [
        None
        if pos is None
        else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in pos.items()
        }
        for pos in positions
    ]


async def test_prompt_logprobs(served: Served) -> None:
    llm = served.app.llm
    name = served.app.model_names[0]
    prompt = "héllo wörld"
    ids = list(prompt.encode())
    want = await llm.generate_final(  # type: ignore[attr-defined]
        prompt, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2)
    )
    expected = _as_json(want.prompt_logprobs)
    assert expected[0] is None
    assert len(expected) == len(ids)
    for tid, pos in zip(ids[1:], expected[1:], strict=True):
        assert str(tid) in pos  # the prompt's own token, plus the top 2
        assert 2 <= len(pos) <= 3
    async with openai.AsyncOpenAI(
        base_url=f"{served.base_url}/v1", api_key="x", max_retries=0
    ) as client:
        r = await client.completions.create(
            model=name, prompt=prompt, max_tokens=3, temperature=0.5, seed=1, n=2,
            extra_body={"prompt_logprobs": 2},
        )  # fmt: skip
        for choice in r.choices:
            assert choice.model_extra is not None
            assert choice.model_extra["prompt_logprobs"] == expected
        r = await client.completions.create(
            model=name, prompt=[prompt, "ab"], max_tokens=2, temperature=0,
            extra_body={"prompt_logprobs": 0},
        )  # fmt: skip
        first, second = (c.model_extra["prompt_logprobs"] for c in r.choices)  # type: ignore[index]
        assert [None if p is None else list(p) for p in first] == [
            None,
            *([str(t)] for t in ids[1:]),
        ]
        assert [None if p is None else list(p) for p in second] == [None, [str(ord("b"))]]

        messages = [{"role": "user", "content": "Hi"}]
        _, chat_ids = llm.render_chat(messages)
        chat = await client.chat.completions.create(
            model=name, messages=messages, max_tokens=2, temperature=0,  # type: ignore[arg-type]
            extra_body={"prompt_logprobs": 1},
        )  # fmt: skip
        assert chat.model_extra is not None
        plp = chat.model_extra["prompt_logprobs"]
        assert len(plp) == len(chat_ids)
        assert plp[0] is None
        assert all(str(t) in p for t, p in zip(chat_ids[1:], plp[1:], strict=True))

        # without the field the responses carry null, as vLLM's
        plain = await client.completions.create(model=name, prompt="ab", max_tokens=1)
        assert plain.choices[0].model_extra["prompt_logprobs"] is None  # type: ignore[index]

    async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as http:
        for body, message in (
            ({"prompt_logprobs": 1, "stream": True}, "not available when `stream=True`"),
            ({"prompt_logprobs": -2}, "must be a positive value or -1"),
            ({"prompt_logprobs": 25}, "Requested prompt logprobs of 25"),
        ):
            r = await http.post("/v1/completions", json={"prompt": "ab", **body})
            assert r.status_code == 400, body
            assert message in r.json()["error"]["message"]
            assert r.json()["error"]["param"] == "prompt_logprobs"
