"""A small stand-in for ``trio_vllm.llm.LLM`` (TEXT_API.md's protocol) over a real client.

Byte-level tokenizer (ids 0-255 are UTF-8 bytes), n = 1 only, no stop strings or
logprobs: enough to drive the server's lifetimes against a real reference engine
without the text frontend. The server tests proper run on the real frontend.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio_vllm as tv
from trio_vllm.text import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping, Sequence

    from trio_vllm.text import ChatMessage, Prompt

_FINISH = {0: "stop", 1: "length", 2: "abort", 3: "error"}


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")


class FakeLLM:
    def __init__(self, client: tv.EngineCoreClient, max_model_len: int = 2048) -> None:
        self.client = client
        self.tokenizer = ByteTokenizer()
        self.model_name = "fake"
        self.max_model_len = max_model_len

    @property
    def dead(self) -> bool:
        return self.client.dead

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> tuple[str, list[int]]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text, self.tokenizer.encode(text)

    @asynccontextmanager
    async def generate(
        self,
        prompt: Prompt,
        params: tv.SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> AsyncIterator[AsyncIterator[RequestOutput]]:
        assert isinstance(prompt, dict)
        assert "prompt_token_ids" in prompt
        assert params is not None
        assert params.n == 1
        ids = list(prompt["prompt_token_ids"])
        request = tv.make_request(
            ids,
            sampling_params=params,
            request_id=request_id,
            eos_token_id=None if params.ignore_eos else 0,
        )
        async with self.client.generate(request) as stream:
            yield _Outputs(stream, ids, request_id or "", self.tokenizer)


class _Outputs:
    def __init__(
        self, stream: tv.RequestStream, ids: list[int], rid: str, tok: ByteTokenizer
    ) -> None:
        self._stream = stream
        self._ids = ids
        self._rid = rid
        self._tok = tok

    def __aiter__(self) -> _Outputs:
        return self

    async def __anext__(self) -> RequestOutput:
        out = await self._stream.__anext__()
        reason = None if out.finish_reason is None else _FINISH[int(out.finish_reason)]
        completion = CompletionOutput(
            0,
            self._tok.decode(out.new_token_ids),
            list(out.new_token_ids),
            None,
            None,
            reason,
            out.stop_reason,
        )
        return RequestOutput(self._rid, None, self._ids, None, [completion], reason is not None)
