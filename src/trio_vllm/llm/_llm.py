"""The async text frontend: text in, text out, over the engine-core client.

`open_llm` starts (or reaches) engines with `open_client` and
loads a model directory's tokenizer; `LLM` turns prompts into engine requests with
the sans-I/O text layer (`trio_vllm.text`) and engine outputs back into vLLM-shaped
`RequestOutput` s. It owns no sockets and no tasks of its own beyond
the per-request ones a ``generate`` block owns for ``n > 1``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Unpack

import anyio
import msgspec

from .._exceptions import InvalidRequestError
from ..protocol import EngineCoreRequest, RequestOutputKind, SamplingParams
from ..protocol.rules import POOLING_TASKS
from ._stream import RequestOutputStream

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping, Sequence

    from ..client import ClientOptions, EngineCoreClient, EngineSource
    from ..protocol import LoRARequest, PoolingParams
    from ..protocol.rules import Limits
    from ..text import (
        ChatMessage,
        EmbeddingRequestOutput,
        ModelFiles,
        PoolingRequestOutput,
        ProcessedRequest,
        Prompt,
        RequestOutput,
        SamplingDefaults,
        Tokenizer,
    )

__all__ = ["LLM", "final_only", "open_llm"]

logger = logging.getLogger("trio_vllm.llm")


class LLM:
    """Text generation over an engine-core client (vLLM's ``AsyncLLM``, structured).

    Usually obtained from `open_llm`; build one yourself over a client you own as
    ``LLM(client, model=DIR)`` (loads the tokenizer synchronously).

    Attributes:
        tokenizer: the model's tokenizer (``encode``, ``decode``, ``vocab_size``).
        model_name: the served model name (default: the model directory's name).
        max_model_len: the context length the engines reported.
        client: the underlying `EngineCoreClient`.
        sampling_defaults: the model's `SamplingDefaults` (vLLM's
            ``--generation-config``), used when a call gives no params.
    """

    def __init__(
        self,
        client: EngineCoreClient,
        *,
        model: str | os.PathLike[str],
        served_model_name: str | None = None,
        files: ModelFiles | None = None,
        tokenizer: Tokenizer | None = None,
        generation_config: str | os.PathLike[str] = "auto",
        override_generation_config: Mapping[str, object] | None = None,
    ) -> None:
        from ..text import InputProcessor, ModelFiles, OutputProcessor, random_uuid

        if files is None:
            files = ModelFiles(
                model,
                generation_config=generation_config,
                override_generation_config=override_generation_config,
            )
        if tokenizer is None:
            tokenizer = files.load_tokenizer()
        max_model_len = client.max_model_len
        if max_model_len is None:
            max_model_len = files.max_position_embeddings or 0
        self.client = client
        self.files = files
        self.tokenizer = tokenizer
        self.model_name = served_model_name or _default_name(model)
        self.max_model_len: int = max_model_len
        self.sampling_defaults: SamplingDefaults = files.sampling_defaults()
        self._inputs = InputProcessor.from_model_files(
            files, tokenizer, max_model_len=max_model_len
        )
        self._new_id = random_uuid
        self._outputs = OutputProcessor(tokenizer)
        self._streams: dict[str, list[RequestOutputStream]] = {}
        self._supported_tasks: tuple[str, ...] | None = None
        self._pooling_limits: Limits | None = None

    def __repr__(self) -> str:
        return f"<LLM {self.model_name!r} requests={self.num_requests}>"

    @property
    def dead(self) -> bool:
        """The engines died (every call raises `EngineDeadError`)."""
        return self.client.dead

    @property
    def num_requests(self) -> int:
        """Text requests in flight (``generate`` blocks entered and not left)."""
        return sum(len(v) for v in self._streams.values())

    @property
    def live_request_ids(self) -> list[str]:
        """The external ids of the requests in flight."""
        return list(self._streams)

    def get_default_sampling_params(self) -> SamplingParams:
        """The params a call without ``params`` uses (vLLM's method of that name): the
        model's sampling defaults over ``SamplingParams()``; a fresh object each call."""
        return self.sampling_defaults.sampling_params()

    def _stream(self, processed: ProcessedRequest) -> RequestOutputStream:
        # The stream is the block's context manager: entering registers it here (so
        # llm.abort() sees every request that may be on the engine) before the first
        # send, and its close forgets it on every way out, a cancelled send included.
        return RequestOutputStream(
            self.client, self._outputs, processed, self._register, self._unregister
        )

    def _register(self, stream: RequestOutputStream) -> None:
        self._streams.setdefault(stream.request_id, []).append(stream)

    def _unregister(self, stream: RequestOutputStream) -> None:
        streams = self._streams.get(stream.request_id)
        if streams is not None:
            with contextlib.suppress(ValueError):
                streams.remove(stream)
            if not streams:
                del self._streams[stream.request_id]

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> contextlib.AbstractAsyncContextManager[RequestOutputStream]:
        """Generate from ``prompt``: ``async with llm.generate(p, params) as stream``.

        The prompt is text, token ids, or ``{"prompt": ...}`` / ``{"prompt_token_ids":
        ...}``. It is tokenized and checked here, synchronously: a bad request raises
        `InvalidRequestError` before anything is sent. Entering the
        block sends the request (``n`` child requests for ``n > 1``); the stream yields
        `RequestOutput` per ``params.output_kind``.

        Leaving the block before the final output (``break``, an exception, cancellation)
        aborts every unfinished child on the engine. Registering and sending are one step
        under cancellation: a cancelled ``__aenter__`` left nothing in this LLM and no
        request on the engine. Engine death raises `EngineDeadError`.

        ``lora_request`` runs the request with that LoRA adapter (vLLM's
        ``lora_request=``; the engines load it on first use). Engines without LoRA
        support refuse it with `InvalidRequestError` when the block is entered, before
        anything is sent.
        """
        processed = self._inputs.process_inputs(
            self._new_id() if request_id is None else request_id,
            prompt,
            params,
            lora_request=lora_request,
        )
        return self._stream(processed)

    async def generate_final(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutput:
        """Generate and return the final output with all ``n`` completions.

        ``params.output_kind`` is ignored (the request is sent as FINAL_ONLY).
        Cancellation aborts the request on the engine; errors as `generate`.
        """
        params = final_only(self.sampling_defaults, params)
        async with self.generate(
            prompt, params, request_id=request_id, lora_request=lora_request
        ) as stream:
            return await _last_output(stream)

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
    ) -> contextlib.AbstractAsyncContextManager[RequestOutputStream]:
        """Generate a reply to a conversation: `render_chat`, then `generate`.

        ``messages`` are OpenAI-shaped (``{"role": ..., "content": ...}``); ``tools``
        (OpenAI tool definitions) reach the chat template as ``tools``, as vLLM's
        ``LLM.chat(tools=...)``. A bad conversation or template raises
        `InvalidRequestError` here.
        """
        processed = self._inputs.process_chat(
            self._new_id() if request_id is None else request_id,
            messages,
            params,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
            lora_request=lora_request,
        )
        return self._stream(processed)

    async def chat_final(
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
        """`chat`, returning the final output (as `generate_final`)."""
        params = final_only(self.sampling_defaults, params)
        async with self.chat(
            messages,
            params,
            request_id=request_id,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
            lora_request=lora_request,
        ) as stream:
            return await _last_output(stream)

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> tuple[str, list[int]]:
        """The prompt text and token ids of a conversation (the model's chat template,
        or ``chat_template``). Raises `InvalidRequestError`."""
        return self._inputs.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )

    # ------------------------------------------------------------------ pooling

    async def supported_tasks(self) -> tuple[str, ...]:
        """The tasks the engines run (``get_supported_tasks``, asked once): e.g.
        ``("generate",)``, or ``("embed", "token_embed")`` for ``--runner pooling
        --convert embed``. Cancellation: nothing changed; the next call asks again."""
        if self._supported_tasks is None:
            tasks = await self.client.get_supported_tasks()
            self._supported_tasks = tuple(str(t) for t in tasks)
        return self._supported_tasks

    def _pooling_rules(self, tasks: tuple[str, ...]) -> Limits:
        if self._pooling_limits is None:
            from ..text import pooling_model_of

            self._pooling_limits = dataclasses.replace(
                self._inputs.limits,
                supported_tasks=frozenset(tasks),
                pooling_model=pooling_model_of(self.model_name, self.files.text_config),
            )
        return self._pooling_limits

    async def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        *,
        pooling_task: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool ``prompts`` (one, or a list) with the model: vLLM's ``LLM.encode``.

        The engines must be a pooling model (``--runner pooling``: some pooling task
        among their supported tasks), else `InvalidRequestError` with vLLM's message.
        ``pooling_task`` is required (``"embed"``, ``"token_embed"``, ``"classify"``,
        ``"token_classify"``) and must be one the engines run. Every prompt is tokenized
        and checked first (vLLM's messages, `InvalidRequestError`): nothing is sent
        unless all are valid (a pooling prompt may fill the whole context). Then all are
        sent at once and the results come back in prompt order, each the engine's pooled
        tensor (normalised for ``embed`` unless ``use_activation=False``).

        Cancellation (or an error in one request) aborts every request still on the
        engine. Engine death raises `EngineDeadError`; an engine-side abort
        ``RuntimeError``.
        """
        from ..text import internal_request_id, prepare_pooling, to_pooling_output

        tasks = await self.supported_tasks()
        if not POOLING_TASKS.intersection(tasks):
            # vLLM's LLM checks its runner first: a generate model runs no pooling task.
            raise InvalidRequestError(
                "LLM.encode() is only supported for pooling models. Try passing "
                "`--runner pooling` to use the model as a pooling model."
            )
        if pooling_task is None:
            raise InvalidRequestError(
                "pooling_task required for `LLM.encode`. Please use one of the more "
                'specific methods or set the pooling_task: LLM.embed(...) or pooling_task="embed"'
            )
        if pooling_task not in tasks:
            kind = "Embedding" if pooling_task in ("embed", "token_embed") else "Classification"
            convert = "embed" if kind == "Embedding" else "classify"
            raise InvalidRequestError(
                f"{kind} API is not supported by this model. Try converting the model "
                f"using `--convert {convert}`."
            )
        limits = self._pooling_rules(tasks)
        params = prepare_pooling(pooling_params, pooling_task, limits)
        planned = []
        for prompt in _as_prompt_list(prompts):
            text, ids = self._inputs.tokenize_prompt(prompt, generate=False)
            external = self._new_id()
            request = EngineCoreRequest(
                internal_request_id(external),
                prompt_token_ids=ids,
                pooling_params=params,
                lora_request=lora_request,
                external_req_id=external,
            )
            planned.append((external, text, ids, request))
        results: list[PoolingRequestOutput | None] = [None] * len(planned)

        async def run(index: int) -> None:
            external, text, ids, request = planned[index]
            output = await self.client.encode(request)
            results[index] = to_pooling_output(
                output, request_id=external, prompt_token_ids=ids, prompt=text
            )

        if len(planned) == 1:
            await run(0)
        else:
            async with anyio.create_task_group() as tg:
                for index in range(len(planned)):
                    tg.start_soon(run, index)
        return [r for r in results if r is not None]

    async def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt: vLLM's ``LLM.embed`` (`encode` with
        ``pooling_task="embed"``; errors and cancellation as there)."""
        from ..text import EmbeddingRequestOutput

        outputs = await self.encode(
            prompts, pooling_params, pooling_task="embed", lora_request=lora_request
        )
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    async def abort(self, request_id: str) -> None:
        """Abort every request in flight under the external id ``request_id``.

        Their streams deliver a final output with ``finish_reason="abort"`` and stop.
        Unknown ids are ignored. Cancellation: the one checkpoint comes first; a
        cancelled call changed nothing.
        """
        streams = list(self._streams.get(request_id, ()))
        ids = [rid for s in streams for rid in s.engine_request_ids]
        if not ids:
            await anyio.lowlevel.checkpoint()
            return
        await self.client.abort_requests(ids)
        for stream in streams:
            stream.client_aborted(stream.engine_request_ids)


def final_only(defaults: SamplingDefaults, params: SamplingParams | None) -> SamplingParams:
    """``params`` (or the model's defaults) sent as FINAL_ONLY (``generate_final``)."""
    if params is None:
        return defaults.sampling_params(output_kind=RequestOutputKind.FINAL_ONLY)
    return msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


def _as_prompt_list(prompts: object) -> list[Prompt]:
    """vLLM's ``parse_and_batch_prompt``: a string, a dict or a list of ints is one
    prompt; any other list is a batch (``InvalidRequestError`` if empty)."""
    if isinstance(prompts, str | dict) or (
        isinstance(prompts, list | tuple) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]  # type: ignore[list-item]
    if isinstance(prompts, list | tuple):
        if not prompts:
            raise InvalidRequestError("You must pass at least one prompt")
        return list(prompts)
    return [prompts]  # type: ignore[list-item]


def _default_name(model: str | os.PathLike[str]) -> str:
    name = os.fspath(model).rstrip(os.sep)
    return os.path.basename(name) if os.path.isdir(name) else name


async def _last_output(stream: RequestOutputStream) -> RequestOutput:
    last = await stream.collect()
    if last is None:  # pragma: no cover - the text layer always finishes a request
        raise InvalidRequestError(f"request {stream.request_id!r} produced no output")
    return last


@contextlib.asynccontextmanager
async def open_llm(
    engines: EngineSource | Sequence[EngineSource],
    *,
    model: str | os.PathLike[str] | None = None,
    served_model_name: str | None = None,
    generation_config: str | os.PathLike[str] = "auto",
    override_generation_config: Mapping[str, object] | None = None,
    **options: Unpack[ClientOptions],
) -> AsyncIterator[LLM]:
    """Load ``model``'s tokenizer, start the engines, and yield an `LLM`.

    ``model`` is a local model directory (or a hub name already in the local cache);
    ``None`` means the engines' own: `trio_vllm.reference_engine.MODEL_DIR` for
    `ReferenceEngines`, the ``model`` of `VllmEngines`.
    ``generation_config`` and ``override_generation_config`` are vLLM's
    ``--generation-config`` (``"auto"``: the model's ``generation_config.json`` gives the
    sampling defaults; ``"vllm"``: none; or a directory) and
    ``--override-generation-config`` (see `ModelFiles`).
    ``options`` are the `ClientOptions`, as for `open_client`.

    The tokenizer is loaded (in a worker thread) before any engine starts, so a bad
    model directory fails fast (``FileNotFoundError`` / ``ValueError``). On exit the
    client closes as `open_client` documents.
    """
    from ..client import open_client
    from ..text import ModelFiles

    if model is None:
        model = _engines_model(engines)

    def load() -> tuple[ModelFiles, Tokenizer]:
        files = ModelFiles(
            model,
            generation_config=generation_config,
            override_generation_config=override_generation_config,
        )
        return files, files.load_tokenizer()

    files, tokenizer = await anyio.to_thread.run_sync(load)
    defaults = files.sampling_defaults()
    if defaults and defaults.source != "vllm":
        logger.warning(
            "Default sampling parameters are overridden by %s: %s (pass "
            "generation_config='vllm' / --generation-config vllm for vLLM's own)",
            "the model's generation_config.json" if defaults.source == "auto" else defaults.source,
            dict(defaults),
        )
    async with open_client(engines, **options) as client:
        yield LLM(
            client,
            model=model,
            served_model_name=served_model_name,
            files=files,
            tokenizer=tokenizer,
        )


def _engines_model(engines: EngineSource | Sequence[EngineSource]) -> str:
    from ..client import ReferenceEngines, VllmEngines
    from ..reference_engine import MODEL_DIR

    sources = [engines] if not isinstance(engines, list | tuple) else list(engines)
    first = sources[0] if sources else None
    if isinstance(first, VllmEngines):
        return first.model
    if isinstance(first, ReferenceEngines):
        for arg, value in zip(first.extra_args, first.extra_args[1:], strict=False):
            if arg == "--model-dir":
                return value
        return MODEL_DIR
    raise ValueError("open_llm needs model=DIR for these engines")
