"""``prompt_logprobs`` on ``/v1/completions`` and ``/v1/chat/completions`` (openai client,
reference engine): the text layer's prompt logprobs in vLLM's response shape."""

from __future__ import annotations

import json
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


def _stream_logprobs(events: list[Any]) -> dict[str, list[Any]]:
    """The completion logprobs of a stream's chunks, concatenated."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}  # fmt: skip
    for event in events:
        for choice in event["choices"]:
            for key in out:
                out[key].extend(choice["logprobs"][key])
    return out


async def test_echo_with_logprobs(served: Served) -> None:
    """vLLM's echo with ``logprobs``: the prompt logprobs the echo asks for (``logprobs``
    of them) lead the echoed logprobs (``null`` for the first prompt token), the
    generated tokens' follow; the choice carries them as ``prompt_logprobs`` too; a
    stream's chunks concatenate to the same; ``max_tokens=0`` echoes the prompt's alone."""
    llm = served.app.llm
    prompt = "héllo"
    ids = list(prompt.encode())
    want = await llm.generate_final(  # type: ignore[attr-defined]
        prompt, SamplingParams(max_tokens=3, temperature=0, logprobs=1, prompt_logprobs=1)
    )
    plp = _as_json(want.prompt_logprobs)
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 1, "echo": True}
    async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as http:
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["prompt_logprobs"] == plp
        lps = choice["logprobs"]
        assert choice["text"].startswith(prompt)
        assert len(lps["tokens"]) == len(ids) + 3
        assert lps["token_logprobs"][0] is None
        assert lps["top_logprobs"][0] is None
        for k, tid in enumerate(ids[1:], start=1):
            assert lps["token_logprobs"][k] == plp[k][str(tid)]["logprob"]
        generated = want.outputs[0]
        steps = generated.logprobs or []
        for k, (tid, step) in enumerate(zip(generated.token_ids, steps, strict=True)):
            assert lps["token_logprobs"][len(ids) + k] == step[tid].logprob
        assert "".join(lps["tokens"]) == choice["text"]
        assert lps["text_offset"][0] == 0

        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200
            events = [json.loads(line[6:]) async for line in s.aiter_lines()
                      if line.startswith("data: {")]  # fmt: skip
        assert _stream_logprobs(events) == lps
        # vLLM's echo chunk carries the prompt's ids, return_token_ids or not
        assert events[0]["choices"][0]["prompt_token_ids"] == ids
        assert all(e["choices"][0]["prompt_token_ids"] is None for e in events[1:])

        r = await http.post("/v1/completions", json={**body, "max_tokens": 0})
        assert r.status_code == 200, r.text
        only = r.json()["choices"][0]
        assert only["text"] == prompt
        assert only["logprobs"]["tokens"] == lps["tokens"][: len(ids)]
        assert only["logprobs"]["token_logprobs"] == lps["token_logprobs"][: len(ids)]
        # with return_token_ids the echo is the ids: the text is the generated text alone
        r = await http.post("/v1/completions", json={**body, "return_token_ids": True})
        with_ids = r.json()["choices"][0]
        assert with_ids["text"] == choice["text"][len(prompt) :]
        assert with_ids["prompt_token_ids"] == ids
        assert with_ids["logprobs"]["tokens"] == lps["tokens"]
        # an explicit prompt_logprobs wins over the echo's
        r = await http.post("/v1/completions", json={**body, "prompt_logprobs": 0})
        assert [None if p is None else len(p) for p in r.json()["choices"][0]["prompt_logprobs"]]\
            == [None, *([1] * (len(ids) - 1))]  # fmt: skip
