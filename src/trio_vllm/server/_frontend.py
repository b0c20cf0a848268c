"""What the server needs from the text frontend: the part of ``trio_vllm.llm.LLM`` it uses.

A structural protocol, so the server type-checks against the real ``LLM`` and tests can
hand it a small stand-in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
    from contextlib import AbstractAsyncContextManager

    from .._exceptions import EngineDeadError
    from ..protocol import LoRARequest, SamplingParams
    from ..text import ChatMessage, Prompt, RequestOutput, SamplingDefaults

__all__ = ["EngineClientLike", "OutputStreamLike", "TextFrontend", "TokenizerLike"]


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...


class EngineClientLike(Protocol):
    @property
    def live_requests(self) -> list[str]: ...

    async def wait_dead(self) -> EngineDeadError: ...

    def add_lora(self, lora_request: LoRARequest) -> Awaitable[bool]: ...


class OutputStreamLike(Protocol):
    """A request's outputs: ``async for`` yields them (merged when the caller lagged);
    ``next_batch`` gives every output ready now, unmerged unless ``merge`` (``[]`` at
    the end)."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def next_batch(self, *, merge: bool = False) -> list[RequestOutput]: ...


class TextFrontend(Protocol):
    """The frontend: ``generate`` yields DELTA `RequestOutput` objects; leaving
    its block aborts the request; engine death raises `EngineDeadError`."""

    @property
    def tokenizer(self) -> TokenizerLike: ...

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def client(self) -> EngineClientLike: ...

    @property
    def sampling_defaults(self) -> SamplingDefaults: ...

    @property
    def dead(self) -> bool: ...

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AbstractAsyncContextManager[OutputStreamLike]: ...

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> tuple[str, list[int]]: ...
