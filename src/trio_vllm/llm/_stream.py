"""One text request in flight: its engine requests, their client streams, its outputs.

A `RequestOutputStream` is what ``async with llm.generate(...) as stream`` gives.
It owns the client streams of its engine requests (one, or ``n`` children for parallel
sampling) and feeds every engine output to the LLM's shared sans-I/O
``OutputProcessor``, which decides what the caller sees and which children the engine
must stop (stop strings). This module decides nothing about text; it wires rules to the
client.

With one engine request (``n == 1``) the stream reads the client stream directly, in the
caller's task. With ``n > 1`` it runs one small task per child in a task group the
``async with`` block owns, each moving its child's outputs into an unbuffered memory
stream, so no child waits behind another and a lagging caller still makes the client
coalesce per child (bounded memory).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc
import anyio.lowlevel

from .._exceptions import TrioVllmError
from ..protocol import RequestOutputKind

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from contextlib import AbstractAsyncContextManager
    from types import TracebackType

    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

    from ..client import EngineCoreClient, RequestStream
    from ..protocol import EngineCoreOutput, EngineCoreRequest
    from ..text import OutputProcessor, OutputProcessorOutput, ProcessedRequest, RequestOutput

__all__ = ["RequestOutputStream"]

# Outputs of one request taken from its client stream in one go, when the caller lagged.
_MAX_DRAIN: Final = 64

_END: Final = "end"
_OUTPUT: Final = "output"
_ERROR: Final = "error"


class _Child:
    """One engine request: its client stream's context manager and stream."""

    __slots__ = ("cm", "exited", "request", "request_id", "stream")

    def __init__(self, request: EngineCoreRequest) -> None:
        self.request = request
        self.request_id: str = request.request_id
        self.cm: AbstractAsyncContextManager[RequestStream] | None = None
        self.stream: RequestStream | None = None
        self.exited = False

    async def exit(self) -> None:
        """Leave the client stream: ABORT for an unfinished request, sent without a
        checkpoint (the client's generate does it in its cleanup)."""
        if self.cm is not None and not self.exited:
            self.exited = True
            await self.cm.__aexit__(None, None, None)


class RequestOutputStream:
    """The outputs of one text request: ``async for out in stream`` yields RequestOutput.

    Obtained from ``async with llm.generate(...) as stream`` (or ``llm.chat``). Outputs
    follow the request's ``output_kind``: CUMULATIVE (default) and DELTA after every
    engine step that changed something, FINAL_ONLY once at the end with all ``n``
    completions. Iteration stops after the output with ``finished`` true. Outputs that
    piled up while the caller was busy come from ``__anext__`` as one, merged as vLLM's
    ``RequestOutputCollector`` merges them; `next_batch` takes them unmerged.

    Errors: `EngineDeadError` once the engine died (outputs that
    arrived before are delivered first). Cancellation: a cancelled ``__anext__``
    consumed nothing; the next call returns the same output.

    Attributes:
        request_id: the caller's (external) request id.
        prompt: the prompt's text, if it had one.
        prompt_token_ids: the prompt's token ids as sent to the engine.
        finished: the final output was produced (it may not be consumed yet).
    """

    def __init__(
        self,
        client: EngineCoreClient,
        processor: OutputProcessor,
        processed: ProcessedRequest,
        on_open: Callable[[RequestOutputStream], None],
        on_close: Callable[[RequestOutputStream], None],
    ) -> None:
        self.request_id = processed.external_req_id
        self.prompt = processed.prompt
        self.prompt_token_ids = processed.prompt_token_ids
        self.finished = False
        self._client = client
        self._processor = processor
        self._processed = processed
        self._delta = processed.sampling_params.output_kind == RequestOutputKind.DELTA
        self._children = [_Child(req) for req in processed.requests]
        self._by_id = {c.request_id: c for c in self._children}
        self._pending: collections.deque[RequestOutput] = collections.deque()
        self._on_open = on_open
        self._on_close = on_close
        self._entered = False
        self._closed = False
        self._task_group: anyio.abc.TaskGroup | None = None
        self._send: MemoryObjectSendStream[tuple[str, Any]] | None = None
        self._receive: MemoryObjectReceiveStream[tuple[str, Any]] | None = None
        self._live = len(self._children)  # children whose outputs may still come
        self._handler: Callable[[list[RequestOutput]], None] | None = None
        # The output the direct path took from the client stream but handed back to
        # the consumer (it finished the request, or processing or the handler raised):
        # (output, its processing's result, the exception), for _fill to finish.
        self._early: tuple[EngineCoreOutput, OutputProcessorOutput | None, Exception | None] | None
        self._early = None

    def __repr__(self) -> str:
        return (
            f"<RequestOutputStream {self.request_id!r} n={len(self._children)} "
            f"finished={self.finished}>"
        )

    @property
    def engine_request_ids(self) -> list[str]:
        """The internal ids sent to the engine (one per child)."""
        return [c.request_id for c in self._children]

    # -- lifetime: the stream is the context manager ``llm.generate`` returns ----------
    # (a class, not an asynccontextmanager: no generator frames per request)

    async def __aenter__(self) -> RequestOutputStream:
        if self._entered:
            # Before registering: a refused second entry must leave nothing in the LLM.
            raise RuntimeError("a generate() context manager can be entered only once")
        error = self._client.dead_error()
        if error is not None:
            raise error
        # Registered before the first send and forgotten by _close on every way out
        # (including a cancelled send).
        self._on_open(self)
        await self._open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close()

    async def _open(self) -> None:
        """Register with the processor and send every engine request, atomically.

        Cancelled or failed anywhere, everything registered so far is forgotten and every
        request sent so far is aborted before the exception propagates.
        """
        self._entered = True
        try:
            self._processed.register(self._processor)
            for child in self._children:
                cm = self._client.generate(child.request)
                child.stream = await cm.__aenter__()
                child.cm = cm  # only once sent: exit() must not run a half-entered one
            if len(self._children) > 1:
                await self._start_pumps()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._close()
            raise

    async def _start_pumps(self) -> None:
        send, receive = anyio.create_memory_object_stream[tuple[str, Any]](0)
        self._send, self._receive = send, receive
        group = anyio.create_task_group()
        await group.__aenter__()
        self._task_group = group
        for child in self._children:
            group.start_soon(self._pump, child, send.clone())

    @staticmethod
    async def _pump(child: _Child, send: MemoryObjectSendStream[tuple[str, Any]]) -> None:
        # Exceptions travel as items, so the task group never raises an exception group
        # out of the caller's block; only cancellation ends a pump otherwise, silently.
        assert child.stream is not None
        async with send:
            try:
                async for output in child.stream:
                    await send.send((_OUTPUT, output))
            except TrioVllmError as exc:
                await send.send((_ERROR, exc))
            else:
                await send.send((_END, [child.request_id]))

    async def _close(self) -> None:
        """Stop the pumps, abort unfinished children, forget all state. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._set_listener(None)
        try:
            group = self._task_group
            if group is not None:
                self._task_group = None
                group.cancel_scope.cancel()
                await group.__aexit__(None, None, None)
        finally:
            try:
                for child in self._children:
                    await child.exit()
            finally:
                if self._send is not None:
                    self._send.close()
                if self._receive is not None:
                    self._receive.close()
                self._forget()
                self._on_close(self)

    def _forget(self) -> None:
        ids = [rid for rid in self._by_id if self._processor.has_request(rid)]
        if ids:
            self._processor.abort_requests(ids, internal=True)

    def client_aborted(self, request_ids: list[str]) -> None:
        """`LLM.abort` aborted these children on the engine: the stream delivers their
        final ``abort`` outputs and stops (called by the LLM, not by applications)."""
        ids = [rid for rid in request_ids if self._processor.has_request(rid)]
        if ids:
            result = self._processor.abort_requests(ids, internal=True)
            self._pending.extend(result.request_outputs)
        self._check_finished()

    def _check_finished(self) -> None:
        if not self.finished and not any(self._processor.has_request(rid) for rid in self._by_id):
            self.finished = True

    # -- consumer side -----------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._pending:
            await anyio.lowlevel.checkpoint_if_cancelled()
        elif not await self._fill():
            raise StopAsyncIteration
        return self._take()

    async def next_batch(self, *, merge: bool = False) -> list[RequestOutput]:
        """Every output ready now, in order and not merged; ``[]`` once the stream is over.

        Waits for the first output as ``__anext__`` does, then takes what the engine
        already sent without waiting again, so a caller that sends per wakeup (an HTTP
        server) can write all of them at once while each stays its own output. With one
        engine request (``n == 1``) that is what its client stream has buffered, up to
        64 engine outputs a call; with ``n > 1`` a call takes one child's engine output
        (the children's pumps hand them over one at a time). Outputs the client stream
        coalesced because the caller lagged behind by ``max_pending`` engine steps come
        as one, as they do from ``__anext__``. With ``merge``, what is ready comes merged
        into one output (a one-element list), as ``__anext__`` gives it.

        Errors as ``__anext__``: `EngineDeadError` once the engine died and the outputs
        that arrived before were taken. Cancellation: a cancelled call consumed nothing;
        the next call returns the same outputs.
        """
        if self._pending:
            await anyio.lowlevel.checkpoint_if_cancelled()
        elif not await self._fill():
            return []
        if merge:
            return [self._take()]
        batch = list(self._pending)
        self._pending.clear()
        return batch

    async def _fill(self) -> bool:
        """Wait until outputs are pending (``True``) or the stream is over (``False``)."""
        while True:
            if self.finished or self._closed:
                return False
            receive = self._receive
            if receive is None:
                # One engine request: read its client stream here (the hot path).
                stream = self._children[0].stream
                if stream is None:  # never entered: nothing was sent
                    raise RuntimeError(
                        "enter the stream first: async with llm.generate(...) as stream"
                    )
                try:
                    output = await stream.__anext__()
                except StopAsyncIteration:
                    # Ended without a final output: aborted through the client
                    # (llm.abort, client.abort_requests).
                    self.client_aborted([self._children[0].request_id])
                else:
                    early = self._early
                    if early is not None and early[0] is output:
                        self._early = None  # processed by _direct already
                        if early[2] is not None:
                            raise early[2]
                        assert early[1] is not None
                        await self._apply_result(early[1], [output])
                    else:
                        batch = [output]
                        if output.finish_reason is None:
                            _drain(stream, batch)
                        await self._process(batch)
            else:
                # Never EndOfStream: this stream keeps its own sender open until closed.
                # A pump ends by itself only after sending an _END or _ERROR item; one
                # ended by a cancellation sends nothing (it reaches this task too).
                kind, value = await receive.receive()
                if kind == _OUTPUT:
                    await self._process([value])
                elif kind == _END:
                    self.client_aborted(value)
                else:
                    raise value
            if self._pending:
                return True

    def _take(self) -> RequestOutput:
        # Outputs that piled up while the caller was busy go out as one, merged as
        # vLLM's RequestOutputCollector merges them (DELTA: concatenated; otherwise the
        # newest wins).
        pending = self._pending
        out = pending.popleft()
        while pending:
            out.add(pending.popleft(), aggregate=self._delta)
        return out

    async def _process(self, outputs: list[EngineCoreOutput]) -> None:
        await self._apply_result(self._processor.process_outputs(outputs), outputs)

    async def _apply_result(
        self, result: OutputProcessorOutput, outputs: list[EngineCoreOutput]
    ) -> None:
        if result.request_outputs:
            self._pending.extend(result.request_outputs)
        to_abort = result.reqs_to_abort
        if to_abort or any(o.finish_reason is not None for o in outputs):
            # A child finished (by the engine or by a stop string): only then can the
            # whole request have.
            self._check_finished()
        for request_id in to_abort:
            # A stop string finished it: the engine would keep generating. Leaving the
            # client stream sends ABORT without a checkpoint (so this cannot be
            # cancelled half-way; the output above is already queued).
            child = self._by_id.get(request_id)
            if child is not None:
                await child.exit()

    # -- the direct path: outputs handled in the receive task (servers) ----------------

    def set_direct(self, handler: Callable[[list[RequestOutput]], None] | None) -> bool:
        """Hand the stream's outputs to ``handler`` from the client's receive task, while
        the caller waits in `next_batch` (or ``__anext__``) with nothing pending;
        ``None`` stops it. Returns whether the stream can (one engine request, entered
        and not closed; on trio: elsewhere every output still goes to the caller).

        For a server that writes each engine step's outputs to its client without
        waking its request's task (``trio-vllm serve`` on its h11 server): the
        handler gets what `next_batch` would have returned, synchronously, in the
        order the engine made it, and must not block. Never the output that finishes
        the request (a final one from the engine, or one a stop string ended): that,
        and everything after a handler's exception, reaches the caller's wait as
        usual, the exception raised from it (the outputs the handler was given are
        then lost). Cancelling the caller's wait (from the handler too, to get the
        caller's attention) consumes nothing, as any cancelled wait.
        """
        if self._receive is not None or self._closed or self._children[0].stream is None:
            return False
        self._handler = handler
        self._set_listener(None if handler is None else self._direct)
        return True

    def _set_listener(self, listener: Callable[[EngineCoreOutput], bool] | None) -> None:
        if len(self._children) == 1:
            stream = self._children[0].stream
            if stream is not None:
                stream.set_listener(listener)

    def _direct(self, output: EngineCoreOutput) -> bool:
        """The client stream's listener (in the receive task; the caller is parked in
        `_fill` with nothing pending): process ``output`` and hand the result to the
        handler; ``False`` hands ``output`` to the caller, processed (`_early`)."""
        handler = self._handler
        if handler is None or self._pending or self.finished:
            return False
        try:
            result = self._processor.process_outputs((output,))
        except Exception as exc:
            self._early = (output, None, exc)
            return False
        outs = result.request_outputs
        if result.reqs_to_abort or (outs and outs[-1].finished):
            self._early = (output, result, None)  # the caller aborts and finishes
            return False
        if outs:
            try:
                handler(outs)
            except Exception as exc:
                self._early = (output, None, exc)
                return False
        return True

    async def collect(self) -> RequestOutput | None:
        """Consume the rest of the stream; the last output (``None`` if there was none)."""
        last: RequestOutput | None = None
        async for output in self:
            last = output
        return last


def _drain(stream: RequestStream, batch: list[EngineCoreOutput]) -> None:
    """Append the outputs already buffered on ``stream`` (no checkpoint, at most
    ``_MAX_DRAIN``); whatever ends the draining (nothing buffered, the end, an error) was
    not consumed, so the next receive sees it again."""
    try:
        while len(batch) < _MAX_DRAIN:
            output = stream.receive_nowait()
            batch.append(output)
            if output.finish_reason is not None:
                return
    except (anyio.WouldBlock, anyio.EndOfStream, TrioVllmError):
        return
