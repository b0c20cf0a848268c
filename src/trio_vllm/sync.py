"""A blocking facade over the async client, with vLLM's ``SyncMPClient`` shape.

`SyncClient` runs `open_client` on trio (or asyncio) in
one background thread, reached through an anyio blocking portal, and exposes the raw
API (`add_request`, a blocking `get_output`,
`abort_requests`, utilities) plus a `generate`
iterator::

    with trio_vllm.SyncClient(trio_vllm.ReferenceEngines()) as client:
        for output in client.generate(make_request([104, 105], max_tokens=8)):
            print(output.new_token_ids)

The thread exists only between ``__enter__`` and ``__exit__``: leaving the ``with``
block closes every open stream (aborting its request), exits ``open_client`` (engines
stopped, sockets closed) and joins the thread, whatever the exit path. Engine death
raises `EngineDeadError` in the calling thread.

A ``KeyboardInterrupt`` (or any exception) raised in the calling thread while it
waits on a call cancels that call in the event loop, so it leaves nothing behind.
Methods may be called from several threads at once; one stream should be consumed by
one thread at a time.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import weakref
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar, final

import anyio
import anyio.from_thread

from ._exceptions import EngineDeadError
from ._portal import BlockingStream, call_in_loop, close_streams
from ._public import publish
from .client import open_client
from .client._startup import DEFAULT_SHUTDOWN_GRACE
from .client._utilities import NamedUtilities

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
    from types import TracebackType

    from .client import EngineCoreClient, EngineEvent, EngineSource, RequestStream, StartupProgress
    from .client._utilities import NamedUtility
    from .protocol import (
        EngineCoreOutput,
        EngineCoreOutputs,
        EngineCoreRequest,
        FinishReason,
        ProtocolProfile,
    )

__all__ = ["SyncClient", "SyncEngineEvents", "SyncRequestStream"]

T = TypeVar("T")

# Outputs one portal round trip fetches at most (see _next_batch).
_MAX_BATCH: Final = 1024


async def _next_batch(stream: RequestStream) -> list[EngineCoreOutput]:
    """The next output (waiting for it) and every output already buffered after it, in
    order; ``[]`` after the last one. One portal round trip then serves a whole batch
    (a round trip costs ~200 us of CPU; an output taken here ~1 us).

    Cancelled while waiting: nothing consumed. An end or an ``EngineDeadError`` behind
    buffered outputs is left for the next call (the stream raises it again then).
    """
    try:
        batch = [await stream.__anext__()]
    except StopAsyncIteration:
        return []
    # The loop never awaits, so it holds the event loop: bounded by the stream's buffer
    # and by _MAX_BATCH (~0.3 ms), in line with the streams' yield interval.
    with contextlib.suppress(anyio.WouldBlock, anyio.EndOfStream, EngineDeadError):
        while len(batch) < _MAX_BATCH:
            batch.append(stream.receive_nowait())
    return batch


def _stop_portal(portal: anyio.from_thread.BlockingPortal) -> None:
    with contextlib.suppress(RuntimeError):  # already stopped
        portal.call(portal.stop, True)


@final
class SyncRequestStream(BlockingStream):
    """The outputs of one request, as a blocking iterator; from `SyncClient.generate`.

    The request is sent when `SyncClient.generate` returns. ``next()`` blocks
    until the next output (one per engine step, or coalesced; see
    `RequestStream`) and stops after the final one. Closing the stream
    before that, by `close`, leaving ``with stream:``, breaking out of a ``for``
    loop over ``client.generate(...)`` (CPython finalizes the dropped stream at once) or
    closing the client, aborts the request on the engine.

    Raises `EngineDeadError` from ``next()`` once the engine died and
    the outputs received before are consumed.
    """

    def __init__(
        self,
        owner: SyncClient,
        context: contextlib.AbstractContextManager[RequestStream],
        stream: RequestStream,
    ) -> None:
        super().__init__(owner, context)
        self._owner: SyncClient = owner
        self._stream = stream
        # Outputs fetched in one portal round trip and not handed out yet; only the
        # iterating thread touches it.
        self._batch: collections.deque[EngineCoreOutput] = collections.deque()
        self._finish_reason: FinishReason | None = None

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<SyncRequestStream {self.request_id!r} {state}>"

    @property
    def request_id(self) -> str:
        """The id sent to the engine."""
        return self._stream.request_id

    @property
    def rank(self) -> int:
        """The data-parallel rank serving the request."""
        return self._stream.rank

    @property
    def finish_reason(self) -> FinishReason | None:
        """The final output's ``finish_reason`` once consumed (``None`` before)."""
        return self._finish_reason

    @property
    def aborted(self) -> bool:
        """True once the request was aborted by this client."""
        return self._stream.aborted

    @property
    def closed(self) -> bool:
        """True once the stream was closed (exhausted, closed or aborted)."""
        return self._closed

    def __iter__(self) -> SyncRequestStream:
        return self

    def __next__(self) -> EngineCoreOutput:
        if self._closed:
            raise StopIteration
        if not self._batch:
            try:
                self._batch.extend(self._owner._call(_next_batch, self._stream))
            except BaseException as exc:
                self._finish(exc)
                raise
            if not self._batch:
                self._finish(None)
                raise StopIteration
        elif self._stream.aborted:
            # abort_requests() ended the request after this batch was fetched: stop here,
            # as the async stream does (it drops its buffer on abort).
            self._batch.clear()
            self._finish(None)
            raise StopIteration
        output = self._batch.popleft()
        if output.finish_reason is not None:
            self._finish_reason = output.finish_reason
        return output

    def collect(self) -> list[int]:
        """Consume the rest of the stream; return all new token ids, concatenated."""
        tokens: list[int] = []
        for output in self:
            tokens.extend(output.new_token_ids)
        return tokens

    def close(self) -> None:
        """Stop the stream; aborts the request if it has not finished. Idempotent."""
        self._finish(None)

    def _finish(self, exc: BaseException | None) -> None:
        # The batch is left alone: the iterating thread may be between its emptiness
        # check and its popleft (close() may come from any thread); once closed,
        # __next__ hands nothing more out anyway.
        if not self._close_once():
            return
        if exc is None:
            self._context.__exit__(None, None, None)
        else:
            # Exceptions the async side raised itself are not passed back into it.
            with contextlib.suppress(BaseException):
                self._context.__exit__(None, None, None)


class SyncEngineEvents:
    """`SyncClient.engine_events`: the client's `EngineEvent`
    channel, blocking. Iteration ends once the client is closed or dead and nothing is
    queued."""

    def __init__(self, owner: SyncClient) -> None:
        self._owner = owner

    def receive(self, timeout: float | None = None) -> EngineEvent:
        """Block until the next event; ``TimeoutError`` after ``timeout`` seconds
        (nothing consumed), ``anyio.EndOfStream`` once closed and empty."""
        events = self._owner.async_client.engine_events

        async def receive() -> EngineEvent:
            with anyio.fail_after(timeout):
                return await events.receive()

        return self._owner._call(receive)

    def __iter__(self) -> Iterator[EngineEvent]:
        while True:
            try:
                yield self.receive()
            except anyio.EndOfStream:
                return


@final
class SyncClient(NamedUtilities):
    """A blocking client: `open_client` in a background thread.

    Args:
        engines: an engine source (``ReferenceEngines``, ``VllmEngines``,
            ``ExternalEngines``) or a list of them.
        backend: the event loop the thread runs, ``"trio"`` (default) or ``"asyncio"``.
        ready_timeout: as for `open_client`, like the
            following keywords.
        profile: the protocol profile, pinned.
        allow_insecure_serialization: accept pickle payloads from engines.
        shutdown_grace: seconds between SIGTERM and SIGKILL for spawned engines.
        stream_buffer: default per-stream buffer before coalescing.
        on_progress: called on every startup step, in the background thread.
        on_engine_death: ``"fail"`` or ``"continue"``.
        waves: play the DP coordinator's wave role.
        vocab_size: the model's vocabulary size: requests holding an id at or above
            it are refused before they are sent.

    Use it as a context manager; ``__enter__`` starts the thread and waits until the
    engines are ready (raising `EngineStartupError` like
    ``open_client``, with the thread already joined), ``__exit__`` (or `close`)
    shuts everything down and joins the thread. Every method raises
    `EngineDeadError` once an engine died or the client closed. The
    named utilities (``sleep``, ``wake_up``, ``profile``, ...) are those of
    `EngineCoreClient`, blocking.
    """

    def __init__(
        self,
        engines: EngineSource | Sequence[EngineSource],
        *,
        backend: str = "trio",
        ready_timeout: float | None = None,
        profile: ProtocolProfile | str | None = None,
        allow_insecure_serialization: bool = False,
        shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE,
        stream_buffer: int = 64,
        on_progress: Callable[[StartupProgress], None] | None = None,
        on_engine_death: Literal["fail", "continue"] = "fail",
        waves: bool = False,
        vocab_size: int | None = None,
    ) -> None:
        self._open = functools.partial(
            open_client,
            engines,
            ready_timeout=ready_timeout,
            profile=profile,
            allow_insecure_serialization=allow_insecure_serialization,
            shutdown_grace=shutdown_grace,
            stream_buffer=stream_buffer,
            on_progress=on_progress,
            on_engine_death=on_engine_death,
            waves=waves,
            vocab_size=vocab_size,
        )
        self._backend = backend
        self._exit_stack: contextlib.ExitStack | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._client: EngineCoreClient | None = None
        self._loop_thread_id: int | None = None
        self._streams: weakref.WeakSet[BlockingStream] = weakref.WeakSet()
        self._close_lock = threading.Lock()
        self._used = False
        self._events = SyncEngineEvents(self)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> SyncClient:
        if self._used:
            raise RuntimeError("a SyncClient can be entered only once")
        self._used = True
        stack = contextlib.ExitStack()
        try:
            portal = stack.enter_context(
                anyio.from_thread.start_blocking_portal(self._backend, name="trio-vllm-sync")
            )
            self._loop_thread_id = portal.call(threading.get_ident)
            # Runs after open_client exited (or failed to start), before the portal's own
            # exit: cancels whatever portal task is left, e.g. a startup or a generate()
            # whose caller was interrupted, so that joining the thread cannot hang.
            stack.callback(_stop_portal, portal)
            client = stack.enter_context(portal.wrap_async_context_manager(self._open()))
        except BaseException:
            stack.close()
            raise
        self._exit_stack = stack
        self._portal = portal
        self._client = client
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close open streams (aborting their requests), exit ``open_client`` (engines
        stopped), and join the background thread. Idempotent; blocks until done."""
        if threading.get_ident() == self._loop_thread_id:
            raise RuntimeError("a SyncClient cannot be closed from its own event loop")
        with self._close_lock:
            stack, self._exit_stack = self._exit_stack, None
            if stack is None:
                return
            try:
                close_streams(self._streams)
            finally:
                self._portal = None
                stack.close()

    @property
    def portal(self) -> anyio.from_thread.BlockingPortal:
        """The portal into the client's event loop (for running your own async code)."""
        if self._portal is None:
            raise RuntimeError("the SyncClient is not open")
        return self._portal

    @property
    def async_client(self) -> EngineCoreClient:
        """The `EngineCoreClient`; use it only through `portal`."""
        if self._client is None:
            raise RuntimeError("the SyncClient is not open")
        return self._client

    def _call(self, func: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Run ``func(*args)`` in the loop thread and wait; cancel it if we are interrupted."""
        portal = self._portal
        if portal is None:
            raise self._closed_error()
        if kwargs:
            func = functools.partial(func, **kwargs)
        return call_in_loop(
            portal,
            func,
            args,
            loop_thread_id=self._loop_thread_id,
            owner="SyncClient",
            closed_error=self._closed_error,
            dead_error=self._dead_error,
        )

    def _dead_error(self) -> Exception | None:
        if self._client is not None and self._client.dead:
            return self._closed_error()
        return None

    def _streams_need_closing(self) -> bool:
        return self._portal is not None

    def _closed_error(self) -> Exception:
        dead = None if self._client is None else self._client.dead_error()
        if dead is not None:
            return dead  # closed after it was open: what every call raises from then on
        return RuntimeError("the SyncClient is not open (use it as a context manager)")

    def _get(self, read: Callable[[EngineCoreClient], T]) -> T:
        client = self.async_client

        async def get() -> T:
            return read(client)

        return self._call(get)

    # ------------------------------------------------------------------ properties

    @property
    def ranks(self) -> list[int]:
        """Data-parallel ranks of the engines."""
        return self._get(lambda c: c.ranks)

    @property
    def live_ranks(self) -> list[int]:
        """Ranks new requests can go to (not lost, not retired)."""
        return self._get(lambda c: c.live_ranks)

    @property
    def lost_ranks(self) -> dict[int, str]:
        """Rank -> why it is gone (``on_engine_death="continue"``)."""
        return self._get(lambda c: c.lost_ranks)

    @property
    def in_flight(self) -> dict[int, int]:
        """Rank -> requests of this client in flight there."""
        return self._get(lambda c: c.in_flight)

    @property
    def ready_responses(self) -> dict[int, dict[str, object]]:
        """Each engine's ready response (a plain map)."""
        return self._get(lambda c: c.ready_responses)

    @property
    def vllm_version(self) -> str | None:
        """The ``vllm_version`` the engines reported."""
        return self._get(lambda c: c.vllm_version)

    @property
    def protocol_profile(self) -> ProtocolProfile:
        """The protocol profile in use."""
        return self._get(lambda c: c.protocol_profile)

    @property
    def max_model_len(self) -> int | None:
        """The smallest ``max_model_len`` the engines reported."""
        return self._get(lambda c: c.max_model_len)

    @property
    def engine_pids(self) -> dict[int, int]:
        """Rank -> pid of each spawned engine process."""
        return self._get(lambda c: c.engine_pids)

    @property
    def addresses(self) -> dict[str, str]:
        """The endpoints the client bound."""
        return self._get(lambda c: c.addresses)

    @property
    def pending_utility_calls(self) -> int:
        """Utility calls awaiting a reply."""
        return self._get(lambda c: c.pending_utility_calls)

    @property
    def engine_events(self) -> SyncEngineEvents:
        """Unsolicited engine notices and rank losses (see
        `EngineCoreClient.engine_events`), blocking."""
        return self._events

    @property
    def dead(self) -> bool:
        """True once an engine died or the client closed (no portal call needed)."""
        return self._client is None or self._portal is None or self._client.dead

    @property
    def live_requests(self) -> list[str]:
        """Request ids the client considers running."""
        return self._get(lambda c: c.live_requests)

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest, *, rank: int | None = None) -> None:
        """Send a request; its outputs come from `get_output` (``ValueError`` if
        invalid or its id is live)."""
        self._call(self.async_client.add_request, request, rank=rank)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """Block until the next EngineCoreOutputs batch of raw requests.

        Raises ``TimeoutError`` after ``timeout`` seconds (nothing consumed) and
        `EngineDeadError` once dead and nothing is queued.
        """
        client = self.async_client

        async def get() -> EngineCoreOutputs:
            with anyio.fail_after(timeout):
                return await client.get_output()

        return self._call(get)

    def abort_requests(self, request_ids: Iterable[str], *, rank: int | None = None) -> None:
        """Abort requests by id (see `EngineCoreClient.abort_requests`)."""
        self._call(self.async_client.abort_requests, list(request_ids), rank=rank)

    def generate(
        self, request: EngineCoreRequest, *, rank: int | None = None, max_pending: int | None = None
    ) -> SyncRequestStream:
        """Send ``request`` and return a blocking iterator over its outputs.

        Raises ``ValueError`` before sending for an invalid request or a live id.
        Closing the returned stream early aborts the request.
        """
        client = self.async_client
        context = self.portal.wrap_async_context_manager(
            client.generate(request, rank=rank, max_pending=max_pending)
        )
        return SyncRequestStream(self, context, context.__enter__())

    # ------------------------------------------------------------------ utilities

    def call_utility(self, method: str, *args: object, rank: int | None = None) -> object:
        """Call ``method(*args)`` on one engine (``UtilityCallError`` if it failed there)."""
        client = self.async_client

        async def call() -> object:
            return await client.call_utility(method, *args, rank=rank)

        return self._call(call)

    def call_utility_all(
        self, method: str, *args: object, return_exceptions: bool = False
    ) -> list[object]:
        """Call ``method(*args)`` on every live engine; results in rank order (see
        `EngineCoreClient.call_utility_all` for ``return_exceptions``)."""
        return self._call(
            self.async_client.call_utility_all,
            method,
            *args,
            return_exceptions=return_exceptions,
        )

    def _named_utility(self, spec: NamedUtility[..., T], args: list[object]) -> T:
        client = self.async_client

        async def run() -> T:
            return await client._named_utility(spec, args)

        return self._call(run)

    # ------------------------------------------------------------------ scaling

    def retire_rank(self, rank: int, *, drain: bool = True) -> None:
        """Scale down (see `EngineCoreClient.retire_rank`)."""
        self._call(self.async_client.retire_rank, rank, drain=drain)

    def add_engines(self, source: EngineSource, *, ready_timeout: float | None = None) -> list[int]:
        """Scale up (see `EngineCoreClient.add_engines`); returns the added ranks."""
        return self._call(self.async_client.add_engines, source, ready_timeout=ready_timeout)


publish("trio_vllm", globals(), __all__)
