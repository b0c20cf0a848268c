"""Per-request output streams, fed by the receive task without ever blocking it.

The receive task hands each :class:`EngineCoreOutput` of a request to its
:class:`RequestStream` with a synchronous call (:meth:`RequestStream._deliver`); the
consumer awaits them with ``async for``. A stream buffers at most ``max_pending``
outputs. When a consumer lags behind by that many engine steps, further outputs are
*coalesced* into the last buffered one instead of queued: token ids are appended,
logprob rows concatenated, events concatenated, NaN counts summed, and every other
field keeps the latest non-nil value (the finish reason always comes from the
newest). So memory per stream is bounded by ``max_pending`` entries plus the
request's own output length, however slow the consumer, and nothing is lost: the
concatenation of the delivered ``new_token_ids`` is always exactly what the engine
produced. A consumer that keeps up sees one output per engine step.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import msgspec

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["RequestStream", "coalesce_outputs"]

# Fields merged specially by coalesce_outputs; all others keep the newest non-nil value
# (except the ones listed in _KEEP_FIRST, which only the first output carries).
_KEEP_FIRST = frozenset(
    {"new_prompt_logprobs_tensors", "prefill_stats", "prompt_token_id_logprobs"}
)


def _concat_logprobs(a: Any, b: Any) -> Any:
    """Row-wise concatenation of two LogprobsLists-like structs (numpy arrays)."""
    import numpy as np

    changes: dict[str, Any] = {}
    for name in a.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if name == "cu_num_generated_tokens":
            changes[name] = None  # per-request slices carry none; offsets no longer hold
        elif x is None or y is None:
            changes[name] = y if x is None else x
        elif isinstance(x, list):
            changes[name] = x + list(y)
        else:
            changes[name] = np.concatenate([np.asarray(x), np.asarray(y)], axis=0)
    return msgspec.structs.replace(a, **changes)


def coalesce_outputs(a: Any, b: Any) -> Any:
    """Merge output ``b`` (newer) of one request into ``a`` (older); return the merge.

    Works on any EngineCoreOutput profile (fields are looked up by name).
    """
    changes: dict[str, Any] = {}
    for name in a.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if name == "request_id":
            continue
        if name == "new_token_ids":
            changes[name] = list(x) + list(y)
        elif name == "new_logprobs":
            if x is not None and y is not None:
                changes[name] = _concat_logprobs(x, y)
            else:
                changes[name] = x if y is None else y
        elif name == "events":
            changes[name] = None if x is None and y is None else [*(x or ()), *(y or ())]
        elif name == "num_nans_in_logits":
            changes[name] = (x or 0) + (y or 0)
        elif name in ("finish_reason", "stop_reason"):
            changes[name] = y
        elif name in _KEEP_FIRST:
            changes[name] = y if x is None else x
        else:
            changes[name] = x if y is None else y
    return msgspec.structs.replace(a, **changes)


class RequestStream:
    """The outputs of one request, in order: ``async for out in stream``.

    Obtained from ``async with client.generate(request) as stream``. Iteration yields
    one EngineCoreOutput per engine step (or a coalesced one, see the module
    documentation) and stops after the output that carries a ``finish_reason``, or
    when the request was aborted through :meth:`~EngineCoreClient.abort_requests`.

    Errors: :class:`~trio_vllm.EngineDeadError` once the engine died and every output
    that arrived before is consumed. Cancellation: a cancelled ``__anext__`` consumed
    nothing; the next call returns the same output.

    Attributes:
        request_id: the id sent to the engine.
        rank: the data-parallel rank serving it.
        finish_reason: the final output's ``finish_reason`` (``None`` while running).
        aborted: the request was aborted by the client (no final output follows).
        coalesced: how many outputs were merged into earlier ones because the consumer
            lagged more than ``max_pending`` steps.
    """

    def __init__(self, request_id: str, rank: int, *, max_pending: int = 64) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        self.request_id = request_id
        self.rank = rank
        self.max_pending = max_pending
        self.finish_reason: int | None = None
        self.aborted = False
        self.coalesced = 0
        self._pending: collections.deque[Any] = collections.deque()
        self._wakeup = anyio.Event()
        self._received_final = False  # the receive task saw the finishing output
        self._done = False  # iteration is over (final output consumed, or aborted)
        self._error: Callable[[], BaseException] | None = None
        self._in_flight = False  # counted in the client's per-rank load (routing)

    def __repr__(self) -> str:
        return (
            f"<RequestStream {self.request_id!r} rank={self.rank} "
            f"pending={len(self._pending)} finished={self.finished}>"
        )

    @property
    def finished(self) -> bool:
        """True once the engine sent the request's final output (or it was aborted)."""
        return self._received_final or self.aborted

    # -- producer side (receive task; synchronous, never blocks) -------------------

    def _deliver(self, output: Any) -> None:
        if self._received_final or self.aborted:
            return  # late output after finish/abort: ignore (PROTOCOL.md §3.4)
        if len(self._pending) >= self.max_pending:
            self._pending[-1] = coalesce_outputs(self._pending[-1], output)
            self.coalesced += 1
        else:
            self._pending.append(output)
        if output.finish_reason is not None:
            self._received_final = True
        self._wakeup.set()

    def _fail(self, error: Callable[[], BaseException]) -> None:
        if self._error is None:
            self._error = error
        self._wakeup.set()

    def _abort_locally(self) -> None:
        self.aborted = True
        self._pending.clear()
        self._wakeup.set()

    # -- consumer side ----------------------------------------------------------------

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Any:
        while True:
            # Checkpoint first, then take: a cancelled call has consumed nothing.
            await anyio.lowlevel.checkpoint()
            if self._pending:
                output = self._pending.popleft()
                if output.finish_reason is not None:
                    self.finish_reason = output.finish_reason
                    self._done = True
                return output
            if self._done or self.aborted:
                raise StopAsyncIteration
            if self._error is not None:
                raise self._error()
            if self._wakeup.is_set():
                self._wakeup = anyio.Event()
            await self._wakeup.wait()

    async def receive(self) -> Any:
        """The next output; ``anyio.EndOfStream`` after the last one."""
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            raise anyio.EndOfStream from None

    async def collect(self) -> list[int]:
        """Consume the rest of the stream and return all new token ids, concatenated."""
        tokens: list[int] = []
        async for output in self:
            tokens.extend(output.new_token_ids)
        return tokens
