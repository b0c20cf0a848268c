"""The ASGI application: routing, auth, body limits, request lifetimes, health, metrics.

One `OpenAIServer` serves one text frontend. Every generation request runs in a
cancel scope that a disconnect cancels: the HTTP server's own callback where it offers
one (`WATCH_DISCONNECT`: our h11 server), else a watcher task beside the request's,
waiting for the client's ``http.disconnect``; a disconnect cancels the scope, and leaving the
frontend's ``generate`` block aborts the request on the engine at once. Nothing here
starts a task that outlives the request that started it.

A streamed response's token events are written from the client's receive task where
the HTTP server can write without waiting (`SEND_NOWAIT`: our h11 server) and the
frontend's stream can hand its outputs over (`_Direct`): the request's task then wakes
for its first output, its last, and a client that stopped reading, not once per token.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
import time
from contextlib import AsyncExitStack
from functools import partial
from typing import TYPE_CHECKING, Final, Protocol

import anyio
import msgspec
import sniffio

from .._exceptions import EngineDeadError, InvalidRequestError
from .._version import __version__
from . import _embeddings
from ._decode import RequestKind, check_json, decode_request, decode_struct
from ._http import (
    SEND_NOWAIT,
    WATCH_DISCONNECT,
    ASGIReceive,
    ASGISend,
    ClientDisconnected,
    HTTPError,
    Scope,
    encode,
    header,
    read_body,
    send_bytes,
    send_error,
)
from ._lora import (
    LoadLoRAAdapterRequest,
    LoRAAdapters,
    UnloadLoRAAdapterRequest,
    runtime_lora_updating_allowed,
)
from ._metrics import ServerMetrics
from ._openai import (
    DONE,
    ChatResponder,
    CompletionResponder,
    GenerationError,
    GenerationPlan,
    plan_chat,
    plan_completion,
)
from ._schemas import (
    CompletionRequest,
    ModelCard,
    ModelList,
    ModelPermission,
)
from ._tokenize import (
    decode_detokenize_request,
    decode_tokenize_request,
    detokenize_response,
    tokenize_response,
)
from ._tools import ToolOptions

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Collection, Sequence

    _Endpoint = Callable[[Scope, ASGIReceive, ASGISend], Awaitable[int]]

    from contextlib import AbstractAsyncContextManager

    from ..protocol import SamplingParams
    from ..text import RequestOutput, TokensPrompt
    from ._frontend import OutputStreamLike, TextFrontend
    from ._lora import LoRAModulePath

__all__ = ["DEFAULT_MAX_BODY_BYTES", "OpenAIServer"]

logger = logging.getLogger("trio_vllm.server")

DEFAULT_MAX_BODY_BYTES: Final = 32 * 1024 * 1024
_GUARDED_PREFIX = ("/v1",)  # as vLLM: /health, /metrics, /version need no key
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
_SSE_START = {"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS}
_FLUSH = {"type": "http.response.body", "body": b"", "more_body": True}
_NOT_FOUND = b'{"detail":"Not Found"}'
_NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'
_UNAUTHORIZED = b'{"error":"Unauthorized"}'
_LOAD_LORA = msgspec.json.Decoder(LoadLoRAAdapterRequest, strict=False)
_UNLOAD_LORA = msgspec.json.Decoder(UnloadLoRAAdapterRequest, strict=False)


class _Open:
    """One generation request in flight (the server's registry entry); ``grace`` is the
    scope its generation runs in, whose deadline `OpenAIServer.begin_shutdown` sets."""

    __slots__ = ("endpoint", "grace", "request_id", "started")

    def __init__(self, endpoint: str, request_id: str, started: float) -> None:
        self.endpoint = endpoint
        self.request_id = request_id
        self.started = started
        self.grace: anyio.CancelScope | None = None


class OpenAIServer:
    """An ASGI app with vLLM's OpenAI-compatible API over a text frontend.

    Args:
        llm: the text frontend (``trio_vllm.llm.LLM`` or anything shaped like it).
        served_model_names: names clients may send as ``model`` (the first is the one
            responses carry); default: ``llm.model_name``.
        api_keys: if any, ``/v1/*`` needs ``Authorization: Bearer <one of them>``.
        max_body_bytes: larger request bodies get HTTP 413.
        model_root: the ``root`` of the ``/v1/models`` card (vLLM: the model path).
        system_fingerprint: stamped on responses where vLLM stamps its own.
        merge_outputs: a streaming request's outputs that piled up while its
            connection was busy go out as one SSE event, as vLLM's API server sends
            them, instead of one event per engine output (the default). Fewer, larger
            events: less CPU per request under load, coarser timing for the client. A
            completions request with a list of prompts is merged per prompt either way.
        supported_tasks: the engines' tasks (``llm.supported_tasks()``): the routes
            follow them as ``vllm serve``'s do (completions and chat with
            ``generate``, ``/v1/embeddings`` with ``embed``; the others answer 404).
        tool_options: ``--enable-auto-tool-choice``, ``--tool-call-parser`` and
            ``--reasoning-parser`` as `ToolOptions` (default: none of them, as vllm serve).
            Raises `ValueError` with vLLM's startup message when a parser cannot work
            with the model's tokenizer (`ToolOptions.check_tokenizer`).
        trust_request_chat_template: ``--trust-request-chat-template``: accept a
            request's own ``chat_template`` (or ``chat_template_kwargs["chat_template"]``)
            on ``/v1/chat/completions`` and ``/tokenize``; without it such a request
            gets vLLM's 400 (a template is code the server runs).

    The app is safe to call concurrently from any number of connections; on trio and
    on asyncio. `mark_dead` (the runner calls it when the engines die) turns
    ``/health`` to 503 and every new generation request into a 503 error.
    """

    def __init__(
        self,
        llm: TextFrontend,
        *,
        served_model_names: Sequence[str] | None = None,
        api_keys: Sequence[str] = (),
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        model_root: str | None = None,
        system_fingerprint: str | None = f"trio-vllm-{__version__}",
        merge_outputs: bool = False,
        supported_tasks: Collection[str] = ("generate",),
        tool_options: ToolOptions | None = None,
        lora_modules: Sequence[LoRAModulePath] = (),
        allow_runtime_lora_updating: bool | None = None,
        trust_request_chat_template: bool = False,
    ) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, got {max_body_bytes}")
        self.llm = llm
        names = list(served_model_names or [llm.model_name])
        if not names:
            raise ValueError("served_model_names must not be empty")
        self.model_names = names
        self._name_set = frozenset(names)
        self._key_hashes = [hashlib.sha256(k.encode()).digest() for k in api_keys]
        self.max_body_bytes = max_body_bytes
        self.model_root = model_root
        self.fingerprint = system_fingerprint
        self.merge_outputs = merge_outputs
        self.tool_options = tool_options if tool_options is not None else ToolOptions()
        self.trust_request_chat_template = trust_request_chat_template
        # vLLM builds the parsers at startup and refuses to start if the tokenizer
        # lacks what they need.
        self.tool_options.check_tokenizer(llm.tokenizer, llm.model_name)
        self.metrics = ServerMetrics(names[0])
        self.port: int | None = None  # set by the runner once the socket listens
        self._dead = False
        self._shutdown_deadline = math.inf  # begin_shutdown's: when requests are ended
        self._shutdown_grace = 0.0
        self._open: dict[int, _Open] = {}
        self._next = 0
        self._created = int(time.time())
        self.supported_tasks = tuple(supported_tasks)
        self.loras = LoRAAdapters(names)
        self._static_loras = list(lora_modules)
        self._lora_lock = anyio.Lock()
        self._routes: dict[str, tuple[str, _Endpoint]] = {
            "/v1/models": ("GET", self._models),
            "/tokenize": ("POST", self._tokenize),
            "/detokenize": ("POST", self._detokenize),
            "/health": ("GET", self._health),
            "/ping": ("GET", self._health),
            "/version": ("GET", self._version),
            "/metrics": ("GET", self._metrics),
        }
        if "generate" in self.supported_tasks:
            # partial, not a method per route: one coroutine frame fewer that every
            # streamed token's wake-up passes through
            self._routes["/v1/completions"] = ("POST", partial(self._generation, "completion"))
            self._routes["/v1/chat/completions"] = ("POST", partial(self._generation, "chat"))
        if "embed" in self.supported_tasks:
            self._routes["/v1/embeddings"] = ("POST", self._embeddings)
        if allow_runtime_lora_updating is None:
            allow_runtime_lora_updating = runtime_lora_updating_allowed()
        if allow_runtime_lora_updating:
            logger.warning(
                "LoRA dynamic loading & unloading is enabled in the API server. "
                "This should ONLY be used for local development!"
            )
            self._routes["/v1/load_lora_adapter"] = ("POST", self._load_lora)
            self._routes["/v1/unload_lora_adapter"] = ("POST", self._unload_lora)

    # ------------------------------------------------------------------ state

    @property
    def dead(self) -> bool:
        """The engines died (or the frontend says so): ``/health`` answers 503."""
        return self._dead or self.llm.dead

    def mark_dead(self) -> None:
        self._dead = True

    def begin_shutdown(self, grace: float) -> None:
        """Give the generation requests in flight, and any that still arrive, ``grace``
        more seconds (the runner calls it on SIGTERM, with the HTTP server's drain).

        A request still generating then is cancelled (its engine requests aborted) and
        answered: a stream ends with an error event (503 ``ServiceUnavailableError``)
        and ``data: [DONE]``, a non-streaming request gets that 503; each is logged at
        WARNING. Calling it again only ever brings the deadline closer. Call it from the
        app's event loop.
        """
        deadline = min(self._shutdown_deadline, anyio.current_time() + grace)
        self._shutdown_deadline = deadline
        self._shutdown_grace = grace
        for entry in self._open.values():
            if entry.grace is not None:
                entry.grace.deadline = deadline

    @property
    def open_requests(self) -> list[str]:
        """Request ids of the generation requests in flight (the server's registry)."""
        return [o.request_id for o in self._open.values()]

    async def load_static_loras(self) -> None:
        """Load the ``lora_modules`` on the engines, in order (vLLM's
        ``init_static_loras``). Raises ``ValueError`` with the first failure's message.
        Cancellation: the adapters loaded so far stay served."""
        for module in self._static_loras:
            request = LoadLoRAAdapterRequest(
                lora_name=module.name,
                lora_path=module.path,
                is_3d_lora_weight=module.is_3d_lora_weight,
            )
            async with self._lora_lock:
                try:
                    await self.loras.load(self.llm.client, request, module.base_model_name)
                except HTTPError as exc:
                    raise ValueError(exc.message) from None

    # ------------------------------------------------------------------ ASGI

    async def __call__(self, scope: Scope, receive: ASGIReceive, send: ASGISend) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        # websocket and anything else: not served (the connection is closed)

    async def _lifespan(self, receive: ASGIReceive, send: ASGISend) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: ASGIReceive, send: ASGISend) -> None:
        path: str = scope["path"]
        route = self._routes.get(path)
        # vLLM's authentication middleware runs before routing: with a key, any /v1 path
        # (one it does not serve included) answers 401 to a request without the key;
        # OPTIONS passes, as there.
        if (
            self._key_hashes
            and path.startswith(_GUARDED_PREFIX)
            and scope["method"] != "OPTIONS"
            and not self._authorized(scope)
        ):
            await send_bytes(send, 401, _UNAUTHORIZED)
            self.metrics.http_response(path if route is not None else "other", 401)
            return
        if route is None:
            # What `vllm serve` answers for an endpoint of its API the model lacks
            # (embeddings, pooling, score, ... on a generative model): FastAPI's 404.
            await send_bytes(send, 404, _NOT_FOUND)
            self.metrics.http_response("other", 404)
            return
        method, handler = route
        if scope["method"] != method:
            await send_bytes(send, 405, _NOT_ALLOWED)
            self.metrics.http_response(path, 405)
            return
        status = await handler(scope, receive, send)
        if status:
            self.metrics.http_response(path, status)

    def _authorized(self, scope: Scope) -> bool:
        value = header(scope, b"authorization")
        if value is None:
            return False
        scheme, _, token = value.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        ok = False
        for key in self._key_hashes:  # no early exit: constant time over the keys
            ok |= secrets.compare_digest(digest, key)
        return ok

    # ------------------------------------------------------------------ small endpoints

    async def _health(self, scope: Scope, receive: ASGIReceive, send: ASGISend) -> int:
        status = 503 if self.dead else 200
        await send_bytes(send, status, b"", [])
        return status

    async def _version(self, scope: Scope, receive: ASGIReceive, send: ASGISend) -> int:
        await send_bytes(send, 200, encode({"version": __version__}))
        return 200

    async def _models(self, scope: Scope, receive: ASGIReceive, send: ASGISend) -> int:
        base = self.model_root or self.model_names[0]
        cards = [
            _model_card(name, self._created, base, None, self.llm.max_model_len)
            for name in self.model_names
        ]
        cards.extend(
            _model_card(
                lora.lora_name,
                self._created,
                lora.lora_path,
                lora.base_model_name or self.model_names[0],
                None,
            )
            for lora in self.loras.requests.values()
        )
        await send_bytes(send, 200, encode(ModelList("list", cards)))
        return 200

    async def _metrics(self, scope: Scope, receive: ASGIReceive, send: ASGISend) -> int:
        body, content_type = self.metrics.render()
        await send_bytes(send, 200, body, [(b"content-type", content_type.encode())])
        return 200

    # ------------------------------------------------------------------ LoRA

    async def _load_lora(self, scope: Scope, receive: ASGIReceive, send: ASGISend) -> int:
        return await self._lora_call(scope, receive, send, load=True)

    async def _unload_lora(self, scope: Scope, receive: ASGIReceive, send: ASGISend) -> int:
        return await self._lora_call(scope, receive, send, load=False)

    async def _lora_call(
        self, scope: Scope, receive: ASGIReceive, send: ASGISend, *, load: bool
    ) -> int:
        """``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``: vLLM's plain-text
        success answer, its JSON errors. One load or unload at a time (vLLM locks per
        name; one lock is simpler and these are rare)."""
        try:
            body = await read_body(scope, receive, self.max_body_bytes)
        except ClientDisconnected:
            return 0
        try:
            check_json(header(scope, b"content-type"))
            req: LoadLoRAAdapterRequest | UnloadLoRAAdapterRequest = (
                decode_struct(_LOAD_LORA, body) if load else decode_struct(_UNLOAD_LORA, body)
            )
            async with self._lora_lock:
                if isinstance(req, LoadLoRAAdapterRequest):
                    text = await self.loras.load(self.llm.client, req)
                else:
                    text = self.loras.unload(req)
        except HTTPError as exc:
            await send_error(send, exc)
            return exc.status
        await send_bytes(send, 200, text.encode(), [])
        return 200

    # ------------------------------------------------------------------ tokenizer

    async def _tokenize(self, scope: Scope, receive: ASGIReceive, send: ASGISend) -> int:
        return await self._tokenizer_call(scope, receive, send, detokenize=False)

    async def _detokenize(self, scope: Scope, receive: ASGIReceive, send: ASGISend) -> int:
        return await self._tokenizer_call(scope, receive, send, detokenize=True)

    async def _tokenizer_call(
        self, scope: Scope, receive: ASGIReceive, send: ASGISend, *, detokenize: bool
    ) -> int:
        """``/tokenize`` or ``/detokenize``: the text layer's answer, no engine call."""
        try:
            body = await read_body(scope, receive, self.max_body_bytes)
        except ClientDisconnected:
            return 0
        try:
            check_json(header(scope, b"content-type"))
            answer: object
            if detokenize:
                dreq = decode_detokenize_request(body)
                self._check_model(dreq.model)
                answer = detokenize_response(self.llm, dreq)
            else:
                treq = decode_tokenize_request(body)
                self._check_model(treq.model)
                answer = tokenize_response(
                    self.llm, treq, trust_request_chat_template=self.trust_request_chat_template
                )
        except HTTPError as exc:
            await send_error(send, exc)
            return exc.status
        await send_bytes(send, 200, encode(answer))
        return 200

    # ------------------------------------------------------------------ generation

    async def _generation(
        self, kind: RequestKind, scope: Scope, receive: ASGIReceive, send: ASGISend
    ) -> int:
        received = time.perf_counter()
        try:
            body = await read_body(scope, receive, self.max_body_bytes)
        except ClientDisconnected:
            return 0
        except HTTPError as exc:
            await send_error(send, exc)
            return exc.status
        try:
            req, extra = decode_request(kind, header(scope, b"content-type"), body)
            model = self._check_model(req.model)
            if self.dead:
                raise _dead_error()
            header_id = header(scope, b"x-request-id")
            rid = header_id.decode("latin-1") if header_id is not None else None
            plan = (
                plan_completion(req, self.llm, model=model, header_request_id=rid, extra=extra)
                if isinstance(req, CompletionRequest)
                else plan_chat(
                    req,
                    self.llm,
                    model=model,
                    header_request_id=rid,
                    extra=extra,
                    tool_options=self.tool_options,
                    trust_request_chat_template=self.trust_request_chat_template,
                )
            )
        except HTTPError as exc:
            await send_error(send, exc)
            return exc.status
        extensions = scope.get("extensions")
        nowait = extensions.get(SEND_NOWAIT) if extensions and plan.stream else None
        key = self._next
        self._next += 1
        entry = self._open[key] = _Open(kind, plan.request_id, received)
        self.metrics.request_started()
        outcome = _Outcome()
        try:
            await _until_disconnect(
                scope,
                receive,
                outcome,
                lambda: self._run_in_grace(entry, kind, plan, send, received, outcome, nowait),
            )
            return outcome.status  # 0 after a disconnect: nobody to answer
        finally:
            del self._open[key]
            self.metrics.request_ended()

    async def _embeddings(self, scope: Scope, receive: ASGIReceive, send: ASGISend) -> int:
        """``/v1/embeddings``: the body through the one decode path, every prompt checked
        before any is sent; a disconnect aborts the requests (nothing answered)."""
        try:
            body = await read_body(scope, receive, self.max_body_bytes)
        except ClientDisconnected:
            return 0
        except HTTPError as exc:
            await send_error(send, exc)
            return exc.status
        outcome = _Outcome()
        try:
            req = _embeddings.decode_embedding_request(header(scope, b"content-type"), body)
            lora = self.loras.get(req.model)
            if req.model and req.model not in self._name_set and lora is None:
                raise HTTPError(
                    f"The model `{req.model}` does not exist.", 404, err_type="NotFoundError"
                )
            if self.dead:
                raise _dead_error()
            prompts = _embeddings.plan_embedding(req, self.llm.tokenizer)
            frontend: _embeddings.EmbeddingFrontend = self.llm  # type: ignore[assignment]
            outputs = None
            async with anyio.create_task_group() as tg:
                tg.start_soon(_watch_disconnect, receive, tg.cancel_scope, outcome)
                try:
                    outputs = await frontend.embed(
                        prompts,
                        pooling_params=_embeddings.pooling_params(req),
                        lora_request=lora,
                    )
                finally:
                    tg.cancel_scope.cancel()
            if outputs is None:
                return 0  # the client went away: its requests were aborted
            header_id = header(scope, b"x-request-id")
            payload = _embeddings.embedding_response(
                req,
                outputs,
                self.model_names[0] if lora is None else lora.lora_name,
                header_request_id=None if header_id is None else header_id.decode("latin-1"),
            )
        except BaseExceptionGroup as group:
            error = _as_http_error(_first_error(group))
            await send_error(send, error)
            return error.status
        except (HTTPError, InvalidRequestError, EngineDeadError) as exc:
            error = _as_http_error(exc)
            if isinstance(exc, EngineDeadError):
                self.mark_dead()
            await send_error(send, error)
            return error.status
        outcome.done(200)
        await send_bytes(send, 200, payload)
        return 200

    def _check_model(self, model: str | None) -> str:
        """The name responses carry: the first served name, or a LoRA adapter's."""
        if not model or model in self._name_set:
            return self.model_names[0]
        if model in self.loras.requests:
            return model
        raise HTTPError(
            f"The model `{model}` does not exist. Valid aliases: {', '.join(self.model_names)}.",
            404,
            err_type="NotFoundError",
            param="model",
        )

    async def _run_in_grace(
        self,
        entry: _Open,
        kind: str,
        plan: GenerationPlan,
        send: ASGISend,
        received: float,
        outcome: _Outcome,
        nowait: Callable[[bytes], bool] | None,
    ) -> None:
        """`_run` within the shutdown grace: past `begin_shutdown`'s deadline the
        generation is cancelled (its requests aborted) and the client told so, instead
        of the connection being cut when the HTTP server's own drain ends."""
        with anyio.CancelScope(deadline=self._shutdown_deadline) as grace:
            entry.grace = grace
            await self._run(kind, plan, send, received, outcome, nowait)
        if grace.cancelled_caught and not outcome.complete:
            logger.warning(
                "%s request %s outlived the shutdown grace period (%g s): ended with %s",
                kind,
                plan.request_id,
                self._shutdown_grace,
                "an error event and [DONE]" if outcome.started else "HTTP 503",
            )
            await _send_failure(send, _shutdown_error(self._shutdown_grace), outcome)

    async def _run(
        self,
        kind: str,
        plan: GenerationPlan,
        send: ASGISend,
        received: float,
        outcome: _Outcome,
        nowait: Callable[[bytes], bool] | None = None,
    ) -> None:
        """Generate and answer; ``outcome`` is marked complete before the last send.
        With ``nowait`` (streaming on the h11 server) the token events go out from the
        receive task once the first is out (`_Direct`)."""
        tokenizer = self.llm.tokenizer
        responder: CompletionResponder | ChatResponder = (
            CompletionResponder(plan, tokenizer, self.fingerprint)
            if kind == "completion"
            else ChatResponder(plan, tokenizer, self.fingerprint)
        )
        timing = _Timing(received, self.metrics)
        last = b""  # the final output's events: they go out with the tail, one send fewer
        try:
            if len(plan.prompts) == 1:  # the common case, without the stack and the pumps
                async with self._generate(
                    plan.prompts[0], plan.params[0], plan.engine_ids[0], plan.model
                ) as stream:
                    if plan.stream:
                        await send(_SSE_START)
                        outcome.started = True
                    # Everything the stream has ready goes out in one ASGI send (one
                    # pass through hypercorn's send path and the socket), one SSE event
                    # per output as the engine made them.
                    merge = self.merge_outputs
                    direct = None if nowait is None else _Direct(stream, nowait, timing, responder)
                    while True:
                        if direct is None or not direct.armed:
                            outs = await stream.next_batch(merge=merge)
                        else:
                            got = await direct.next_batch(merge)
                            if got is None:  # the socket took only part of an event
                                await send(_FLUSH)
                                continue
                            outs = got
                        if not outs:
                            break
                        timing.outputs(outs)
                        events = responder.on_outputs(0, outs)
                        if outs[-1].finished:
                            last = events
                            break
                        if events:
                            await send(
                                {"type": "http.response.body", "body": events, "more_body": True}
                            )
                            if direct is not None and not direct.armed:
                                direct.arm()  # the head is out: the rest can go directly
            else:
                await self._run_batch(plan, responder, timing, send, outcome)
        except (HTTPError, InvalidRequestError, EngineDeadError, GenerationError) as exc:
            error = _as_http_error(exc)
            if isinstance(exc, EngineDeadError):
                self.mark_dead()
            await _send_failure(send, error, outcome)
            return
        except Exception:
            logger.exception("error in %s request %s", kind, plan.request_id)
            error = HTTPError("Internal server error", 500, err_type="InternalServerError")
            await _send_failure(send, error, outcome)
            return
        timing.finished(responder)
        tail = responder.finish()
        outcome.done(200)
        if outcome.started:
            await send({"type": "http.response.body", "body": last + tail})
        else:
            await send_bytes(send, 200, tail)

    def _generate(
        self, prompt: TokensPrompt, params: SamplingParams, engine_id: str, model: str
    ) -> AbstractAsyncContextManager[OutputStreamLike]:
        """The frontend's ``generate``, with the adapter ``model`` names (if any)."""
        lora = self.loras.get(model)
        if lora is None:  # keyword left off: frontends without LoRA need not take it
            return self.llm.generate(prompt, params, request_id=engine_id)
        return self.llm.generate(prompt, params, request_id=engine_id, lora_request=lora)

    async def _run_batch(
        self,
        plan: GenerationPlan,
        responder: CompletionResponder | ChatResponder,
        timing: _Timing,
        send: ASGISend,
        outcome: _Outcome,
    ) -> None:
        """Several prompts (completions only): all submitted (or none), outputs merged
        as they come."""
        async with AsyncExitStack() as stack:
            streams = [
                await stack.enter_async_context(
                    self._generate(prompt, params, engine_id, plan.model)
                )
                for prompt, params, engine_id in zip(
                    plan.prompts, plan.params, plan.engine_ids, strict=True
                )
            ]
            if plan.stream:
                await send(_SSE_START)
                outcome.started = True
            lock = anyio.Lock()

            async def pump(prompt_idx: int) -> None:
                async for out in streams[prompt_idx]:
                    async with lock:
                        timing.output(out)
                        events = responder.on_output(prompt_idx, out)
                        if events:
                            await send(
                                {"type": "http.response.body", "body": events, "more_body": True}
                            )

            try:
                async with anyio.create_task_group() as pumps:
                    for idx in range(len(streams)):
                        pumps.start_soon(pump, idx)
            except BaseExceptionGroup as group:
                raise _first_error(group) from None


class _Direct:
    """A streamed response's token events written from the client's receive task.

    Once armed (after the response head went out with the first events), the stream
    hands each engine step's outputs to `__call__`, which times them, makes their
    events and writes them with the h11 server's ``send_nowait``, while the request's
    task stays parked in `next_batch`. That task still takes the final output (and
    what a stop string ended, and errors) as without this. Where the socket did not
    take an event whole, `__call__` cancels that wait (which consumes nothing), and
    the task writes the rest with a waiting send before it waits again."""

    __slots__ = ("armed", "nowait", "responder", "scope", "stream", "timing")

    def __init__(
        self,
        stream: OutputStreamLike,
        nowait: Callable[[bytes], bool],
        timing: _Timing,
        responder: CompletionResponder | ChatResponder,
    ) -> None:
        self.stream = stream
        self.nowait = nowait
        self.timing = timing
        self.responder = responder
        self.scope: anyio.CancelScope | None = None
        self.armed = False

    def arm(self) -> None:
        set_direct: Callable[[Callable[[list[RequestOutput]], None]], bool] | None = getattr(
            self.stream, "set_direct", None
        )
        self.armed = set_direct is not None and set_direct(self)

    def __call__(self, outs: list[RequestOutput]) -> None:
        self.timing.outputs(outs)
        events = self.responder.on_outputs(0, outs)
        if events and not self.nowait(events):
            scope = self.scope
            if scope is not None:
                scope.cancel()

    async def next_batch(self, merge: bool) -> list[RequestOutput] | None:
        """The stream's `next_batch`; ``None`` if `__call__` needs a waiting send."""
        with anyio.CancelScope() as scope:
            self.scope = scope
            try:
                return await self.stream.next_batch(merge=merge)
            finally:
                self.scope = None
        return None


class _Outcome:
    """How a generation request ended: once ``complete`` the response is (being) sent
    in full, and an ``http.disconnect`` (which ASGI servers also send after a complete
    response) no longer cancels anything."""

    __slots__ = ("complete", "started", "status")

    def __init__(self) -> None:
        self.started = False  # the response head is sent (streaming)
        self.complete = False
        self.status = 0

    def done(self, status: int) -> None:
        self.complete = True
        self.status = status


async def _send_failure(send: ASGISend, error: HTTPError, outcome: _Outcome) -> None:
    """An error response, or, once streaming, an error event and ``[DONE]``."""
    if not outcome.started:
        outcome.done(error.status)
        await send_error(send, error)
        return
    outcome.done(200)
    body = b"data: " + error.body() + b"\n\n" + DONE
    await send({"type": "http.response.body", "body": body})


class _Timing:
    """TTFT, ITL and end-to-end latency of one request, into the app's metrics."""

    __slots__ = ("first", "last", "metrics", "reason", "received")

    def __init__(self, received: float, metrics: ServerMetrics) -> None:
        self.received = received
        self.metrics = metrics
        self.first = True
        self.last = received
        self.reason = "abort"

    def output(self, out: RequestOutput) -> None:
        self.outputs((out,))

    def outputs(self, outs: Sequence[RequestOutput]) -> None:
        """Outputs taken together: the first with tokens is timed, the others of the
        batch came with it (inter-token latency 0 here)."""
        if len(outs) == 1 and len(outs[0].outputs) == 1:  # the common case, one pass
            o = outs[0].outputs[0]
            if o.finish_reason is not None:
                self.reason = o.finish_reason
            with_tokens = 1 if o.token_ids else 0
        else:
            with_tokens = 0
            for out in outs:
                for o in out.outputs:
                    if o.token_ids:
                        with_tokens += 1
                        break
                for o in out.outputs:
                    if o.finish_reason is not None:
                        self.reason = o.finish_reason
        if not with_tokens:
            return
        now = time.perf_counter()
        if self.first:
            self.first = False
            self.metrics.first_token(now - self.received)
        else:
            self.metrics.inter_token(now - self.last)
        if with_tokens > 1:
            self.metrics.inter_token(0.0, with_tokens - 1)
        self.last = now

    def finished(self, responder: CompletionResponder | ChatResponder) -> None:
        self.metrics.finished(
            self.reason,
            sum(responder.prompt_tokens),
            responder.completion_tokens,
            time.perf_counter() - self.received,
        )


class _Cancellable(Protocol):
    def cancel(self) -> None: ...


async def _until_disconnect(
    scope: Scope, receive: ASGIReceive, outcome: _Outcome, run: Callable[[], Awaitable[None]]
) -> None:
    """``run()``, cancelled if the client goes away before the response is complete
    (``outcome``). With the HTTP server's ``WATCH_DISCONNECT`` extension (our h11
    server) the server calls back and no task is started; otherwise a watcher task in a
    task group waits in ``receive()`` for ``http.disconnect``."""
    extensions = scope.get("extensions")
    watch = extensions.get(WATCH_DISCONNECT) if extensions else None
    if watch is not None:  # only serve_h11 offers it: trio
        import trio

        with trio.CancelScope() as cancel_scope:

            def gone() -> None:
                if not outcome.complete:
                    cancel_scope.cancel()

            stop = watch(gone)
            try:
                await run()
            finally:
                stop()
    elif sniffio.current_async_library() == "trio":
        # trio's own nursery: anyio's task group costs more per request
        # (docs/performance.md, figures from source comments).
        import trio

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope, outcome)
            try:
                await run()
            finally:
                nursery.cancel_scope.cancel()
    else:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_disconnect, receive, tg.cancel_scope, outcome)
            try:
                await run()
            finally:
                tg.cancel_scope.cancel()


async def _watch_disconnect(receive: ASGIReceive, scope: _Cancellable, outcome: _Outcome) -> None:
    """Cancel the request's task group as soon as the client disconnects."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not outcome.complete:
                scope.cancel()
            return


def _first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error a pump task raised (the others were cancelled because of it)."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        else:
            leaves.append(exc)
    for exc in leaves:
        if isinstance(exc, Exception):
            return exc
    return group


def _dead_error() -> HTTPError:
    return HTTPError(
        "The engine is dead; this server no longer serves requests.",
        503,
        err_type="ServiceUnavailableError",
    )


def _shutdown_error(grace: float) -> HTTPError:
    return HTTPError(
        f"The server is shutting down: the request outlived the shutdown grace period "
        f"({grace:g} s).",
        503,
        err_type="ServiceUnavailableError",
    )


def _as_http_error(exc: BaseException) -> HTTPError:
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, EngineDeadError):
        return _dead_error()
    if isinstance(exc, GenerationError):
        return HTTPError(str(exc), 500, err_type="InternalServerError")
    if isinstance(exc, InvalidRequestError):
        # A request rule's verdict. vLLM's create_error_response strips every message
        # (sanitize_message): llguidance's grammar errors end with a newline.
        return HTTPError(str(exc).strip(), param=exc.param)
    return HTTPError(str(exc))


def _model_card(
    name: str, created: int, root: str, parent: str | None, max_model_len: int | None
) -> ModelCard:
    """One ``/v1/models`` entry as vLLM's (a fresh permission id per listing)."""
    permission = ModelPermission(f"modelperm-{secrets.token_hex(16)}", "model_permission", created)
    return ModelCard(
        id=name,
        object="model",
        created=created,
        owned_by="vllm",
        root=root,
        parent=parent,
        max_model_len=max_model_len,
        permission=[permission],
    )
