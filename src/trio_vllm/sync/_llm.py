"""The blocking twin of `LLM`: text generation without an event loop.

`SyncLLM` runs the engine-core client and the async frontend in one background
thread (a `LoopThread`, as `SyncClient` does) and exposes blocking calls::

    with trio_vllm.SyncLLM(trio_vllm.ReferenceEngines()) as llm:
        print(llm.generate_final("hello", trio_vllm.SamplingParams(max_tokens=8)))
        for out in llm.generate("hello", params):    # a blocking iterator
            print(out.outputs[0].text)

Requests are checked in the calling thread (``InvalidRequestError`` before anything is
sent); everything that touches the frontend's state runs in the loop thread. Closing a
stream early (``close()``, leaving ``with stream:``, ``break`` in a ``for`` loop over a
stream that is then dropped) or closing the ``SyncLLM`` aborts its requests. An
exception in the calling thread while it waits (``KeyboardInterrupt``) cancels that call
in the loop, so it leaves nothing behind.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Unpack, final

from ..llm._llm import LLM, _engines_model, final_only
from ._loop import BlockingStream, LoopThread

if TYPE_CHECKING:
    import os
    from collections.abc import AsyncIterator, Mapping, Sequence
    from types import TracebackType

    import anyio.from_thread

    from ..client import ClientOptions, EngineCoreClient, EngineSource
    from ..llm._stream import RequestOutputStream
    from ..protocol import LoRARequest, PoolingParams, SamplingParams
    from ..text import (
        ChatMessage,
        EmbeddingRequestOutput,
        ModelFiles,
        PoolingRequestOutput,
        Prompt,
        RequestOutput,
        Tokenizer,
    )

__all__ = ["SyncLLM", "SyncRequestOutputStream"]


async def _next(stream: RequestOutputStream) -> RequestOutput | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


@final
class SyncRequestOutputStream(BlockingStream):
    """A text request's outputs as a blocking iterator; from `SyncLLM.generate`.

    The request is sent when `SyncLLM.generate` returns; ``next()`` blocks until
    the next `RequestOutput` and stops after the final one. Closing it
    before (``close()``, ``with``, dropping it) aborts every unfinished child request.
    """

    def __init__(
        self,
        loop: LoopThread[LLM],
        context: contextlib.AbstractContextManager[RequestOutputStream],
        stream: RequestOutputStream,
    ) -> None:
        super().__init__(loop, context)
        self._calls = loop
        self._stream = stream

    def __repr__(self) -> str:
        return f"<SyncRequestOutputStream {self.request_id!r} closed={self._closed}>"

    @property
    def request_id(self) -> str:
        """The caller's (external) request id."""
        return self._stream.request_id

    @property
    def closed(self) -> bool:
        return self._closed

    def __iter__(self) -> SyncRequestOutputStream:
        return self

    def __next__(self) -> RequestOutput:
        if self._closed:
            raise StopIteration
        try:
            output = self._calls.call(_next, self._stream)
        except BaseException:
            self.close()
            raise
        if output is None:
            self.close()
            raise StopIteration
        return output

    def close(self) -> None:
        """Stop the stream; aborts what has not finished. Idempotent."""
        if not self._close_once():
            return  # closed already, or with the SyncLLM: open_client cleaned up
        # An error here means the client closed meanwhile: nothing is left to abort.
        with contextlib.suppress(Exception):
            self._context.__exit__(None, None, None)


@final
class SyncLLM:
    """A blocking `LLM`: the client and frontend in a background thread.

    Args:
        engines: an engine source, as for `open_llm`.
        model: the model directory (default: the engines' own, as ``open_llm``).
        served_model_name: the name reported as `model_name`.
        generation_config: where the sampling defaults come from, as for `open_llm`.
        override_generation_config: overrides of those defaults, as for `open_llm`.
        backend: the event loop of the thread, ``"trio"`` (default) or ``"asyncio"``.
        **options: the `ClientOptions`, as for `open_client`.

    ``__enter__`` loads the tokenizer, starts the engines and waits until they are ready
    (raising as ``open_llm`` does); ``__exit__`` (or `close`) closes open streams,
    stops the engines and joins the thread. Calls raise
    `EngineDeadError` once an engine died or the ``SyncLLM`` closed.
    """

    def __init__(
        self,
        engines: EngineSource,
        *,
        model: str | os.PathLike[str] | None = None,
        served_model_name: str | None = None,
        generation_config: str | os.PathLike[str] = "auto",
        override_generation_config: Mapping[str, object] | None = None,
        backend: str = "trio",
        **options: Unpack[ClientOptions],
    ) -> None:
        self._engines = engines
        self._generation_config = generation_config
        self._override_generation_config = override_generation_config
        self._model = model if model is not None else _engines_model(engines)
        self._served_model_name = served_model_name
        self._options = options
        self._loop: LoopThread[LLM] = LoopThread("SyncLLM", backend, _client_of)

    def __enter__(self) -> SyncLLM:
        self._loop.enter(self._open_llm)
        return self

    def _open_llm(self) -> contextlib.AbstractAsyncContextManager[LLM]:
        from ..text import ModelFiles

        files = ModelFiles(  # before any engine starts: a bad dir fails fast
            self._model,
            generation_config=self._generation_config,
            override_generation_config=self._override_generation_config,
        )
        tokenizer = files.load_tokenizer()
        return _llm_over_client(
            self._engines, self._options, self._model, self._served_model_name, files, tokenizer
        )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close open streams (aborting their requests), stop the engines, join the
        thread. Idempotent."""
        self._loop.close()

    @property
    def llm(self) -> LLM:
        """The async `LLM`; use it only in the loop thread (`portal`). ``RuntimeError``
        while the ``SyncLLM`` is not open."""
        if not self._loop.is_open:
            raise RuntimeError("the SyncLLM is not open (use it as a context manager)")
        return self._loop.value

    @property
    def portal(self) -> anyio.from_thread.BlockingPortal:
        """The portal into the background event loop."""
        return self._loop.portal

    @property
    def tokenizer(self) -> Tokenizer:
        return self.llm.tokenizer

    @property
    def model_name(self) -> str:
        return self.llm.model_name

    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    @property
    def dead(self) -> bool:
        return self.llm.dead

    def _open(
        self, context: contextlib.AbstractAsyncContextManager[RequestOutputStream]
    ) -> SyncRequestOutputStream:
        wrapped, stream = self._loop.open_stream(context)
        return SyncRequestOutputStream(self._loop, wrapped, stream)

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> SyncRequestOutputStream:
        """Send a request and return a blocking iterator of its outputs (see
        `LLM.generate`)."""
        return self._open(
            self.llm.generate(prompt, params, request_id=request_id, lora_request=lora_request)
        )

    def generate_final(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutput:
        """Generate to the end; the final output with all ``n`` completions."""
        context = self.llm.generate(
            prompt,
            final_only(self.llm.sampling_defaults, params),
            request_id=request_id,
            lora_request=lora_request,
        )
        return self._loop.call(_run_final, context)

    def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        *,
        pooling_task: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[PoolingRequestOutput]:
        """`LLM.encode`, blocking; Ctrl-C aborts every request still on the engine."""
        llm = self.llm

        async def run() -> list[PoolingRequestOutput]:
            return await llm.encode(
                prompts, pooling_params, pooling_task=pooling_task, lora_request=lora_request
            )

        return self._loop.call(run)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """`LLM.embed`, blocking: one embedding per prompt, in order."""
        llm = self.llm

        async def run() -> list[EmbeddingRequestOutput]:
            return await llm.embed(
                prompts, pooling_params=pooling_params, lora_request=lora_request
            )

        return self._loop.call(run)

    def chat(
        self,
        messages: Sequence[ChatMessage],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
        tools: Sequence[Mapping[str, object]] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> SyncRequestOutputStream:
        """`LLM.chat` as a blocking iterator."""
        return self._open(
            self.llm.chat(
                messages,
                params,
                request_id=request_id,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
                lora_request=lora_request,
            )
        )

    def chat_final(
        self,
        messages: Sequence[ChatMessage],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
        tools: Sequence[Mapping[str, object]] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutput:
        """A reply to a conversation, final (as `generate_final`)."""
        context = self.llm.chat(
            messages,
            final_only(self.llm.sampling_defaults, params),
            request_id=request_id,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
            lora_request=lora_request,
        )
        return self._loop.call(_run_final, context)

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> tuple[str, list[int]]:
        """The prompt text and token ids of a conversation (no engine involved)."""
        return self.llm.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )

    def abort(self, request_id: str) -> None:
        """Abort every request in flight under ``request_id`` (see ``LLM.abort``)."""
        self._loop.call(self.llm.abort, request_id)


async def _run_final(
    context: contextlib.AbstractAsyncContextManager[RequestOutputStream],
) -> RequestOutput:
    async with context as stream:
        last = await stream.collect()
    if last is None:  # pragma: no cover - the text layer always finishes a request
        raise RuntimeError(f"request {stream.request_id!r} produced no output")
    return last


def _client_of(llm: LLM) -> EngineCoreClient:
    return llm.client


@contextlib.asynccontextmanager
async def _llm_over_client(
    engines: EngineSource,
    options: ClientOptions,
    model: str | os.PathLike[str],
    served_model_name: str | None,
    files: ModelFiles,
    tokenizer: Tokenizer,
) -> AsyncIterator[LLM]:
    """`open_client`, and the `LLM` over it built in the loop thread (which owns the
    client it reads), with the tokenizer the calling thread loaded."""
    from ..client import open_client

    async with open_client(engines, **options) as client:
        yield LLM(
            client,
            model=model,
            served_model_name=served_model_name,
            files=files,
            tokenizer=tokenizer,
        )
