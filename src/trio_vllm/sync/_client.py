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
from typing import TYPE_CHECKING, Any, Final, TypeVar, Unpack, final

import anyio
import anyio.from_thread

from .._exceptions import EngineDeadError
from ..client import open_client
from ..client._utilities import NamedUtilities
from ._loop import BlockingStream, LoopThread

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
    from types import TracebackType

    from ..client import ClientOptions, EngineCoreClient, EngineEvent, EngineSource, RequestStream
    from ..client._utilities import NamedUtility
    from ..protocol import (
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
    (a round trip costs two orders of magnitude more CPU than an output taken here).

    Cancelled while waiting: nothing consumed. An end or an ``EngineDeadError`` behind
    buffered outputs is left for the next call (the stream raises it again then).
    """
    try:
        batch = [await stream.__anext__()]
    except StopAsyncIteration:
        return []
    # The loop never awaits, so it holds the event loop: bounded by the stream's buffer
    # and by _MAX_BATCH, sized to stay in line with the streams' yield interval.
    with contextlib.suppress(anyio.WouldBlock, anyio.EndOfStream, EngineDeadError):
        while len(batch) < _MAX_BATCH:
            batch.append(stream.receive_nowait())
    return batch


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
        loop: LoopThread[EngineCoreClient],
        context: contextlib.AbstractContextManager[RequestStream],
        stream: RequestStream,
    ) -> None:
        super().__init__(loop, context)
        self._calls = loop
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
                self._batch.extend(self._calls.call(_next_batch, self._stream))
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

    def __init__(self, loop: LoopThread[EngineCoreClient]) -> None:
        self._loop = loop

    def receive(self, timeout: float | None = None) -> EngineEvent:
        """Block until the next event; ``TimeoutError`` after ``timeout`` seconds
        (nothing consumed), ``anyio.EndOfStream`` once closed and empty."""
        events = self._loop.value.engine_events

        async def receive() -> EngineEvent:
            with anyio.fail_after(timeout):
                return await events.receive()

        return self._loop.call(receive)

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
        **options: the `ClientOptions`, as for `open_client` (``on_progress`` is
            called in the background thread).

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
        **options: Unpack[ClientOptions],
    ) -> None:
        self._open = functools.partial(open_client, engines, **options)
        self._loop: LoopThread[EngineCoreClient] = LoopThread("SyncClient", backend, _itself)
        self._events = SyncEngineEvents(self._loop)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> SyncClient:
        self._loop.enter(self._open)
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
        self._loop.close()

    @property
    def portal(self) -> anyio.from_thread.BlockingPortal:
        """The portal into the client's event loop (for running your own async code)."""
        return self._loop.portal

    @property
    def async_client(self) -> EngineCoreClient:
        """The `EngineCoreClient`; use it only through `portal`."""
        return self._loop.value

    def _call(self, func: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Run ``func(*args)`` in the loop thread and wait; cancel it if we are interrupted."""
        if kwargs:
            func = functools.partial(func, **kwargs)
        return self._loop.call(func, *args)

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
        return self._loop.dead

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
        context, stream = self._loop.open_stream(
            client.generate(request, rank=rank, max_pending=max_pending)
        )
        return SyncRequestStream(self._loop, context, stream)

    def encode(self, request: EngineCoreRequest, *, rank: int | None = None) -> EngineCoreOutput:
        """Send a pooling request and block until its final output (see
        `EngineCoreClient.encode`); ``ValueError`` before sending if invalid. Ctrl-C
        while waiting aborts the request on the engine."""
        return self._call(self.async_client.encode, request, rank=rank)

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

    def run_named_utility(self, spec: NamedUtility[..., T], args: list[object]) -> T:
        """The blocking `EngineCoreClient.run_named_utility`: what every named utility
        method (``sleep``, ``profile``, ...) calls."""
        client = self.async_client

        async def run() -> T:
            return await client.run_named_utility(spec, args)

        return self._call(run)

    # ------------------------------------------------------------------ scaling

    def retire_rank(self, rank: int, *, drain: bool = True) -> None:
        """Scale down (see `EngineCoreClient.retire_rank`)."""
        self._call(self.async_client.retire_rank, rank, drain=drain)

    def add_engines(self, source: EngineSource, *, ready_timeout: float | None = None) -> list[int]:
        """Scale up (see `EngineCoreClient.add_engines`); returns the added ranks."""
        return self._call(self.async_client.add_engines, source, ready_timeout=ready_timeout)


def _itself(client: EngineCoreClient) -> EngineCoreClient:
    return client
