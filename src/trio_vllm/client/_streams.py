"""Per-request output streams, fed by the receive task without ever blocking it.

The receive task hands each `EngineCoreOutput` of a request to its
`RequestStream` with a synchronous call (`RequestStream.deliver`); the
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

import operator
import time
from typing import TYPE_CHECKING, Any, Final

import msgspec

from ..protocol.structs import EngineCoreOutput, FinishReason
from ._cancel import checkpoint_if_cancelled
from ._mailbox import YIELD_INTERVAL, Mailbox

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["LISTEN_INTERVAL", "YIELD_INTERVAL", "ListenBudget", "RequestStream", "coalesce_outputs"]

_monotonic: Final = time.monotonic  # bound once: read on every buffered output

# How long the receive task may run listeners (`RequestStream.set_listener`) after it
# last yielded; later outputs are queued and their consumers woken, so a receive batch
# that piled up behind a busy frontend does not hold every other task (new requests'
# handling) for the whole batch's work.
LISTEN_INTERVAL: Final = 0.001


class ListenBudget:
    """Until when (``time.monotonic``) the receive task may run listeners: set by the
    receive loop each time it comes back from waiting, read by every stream's
    `RequestStream.deliver`."""

    __slots__ = ("until",)

    def __init__(self, until: float = 0.0) -> None:
        self.until = until


_UNBOUNDED: Final = ListenBudget(float("inf"))  # a stream made without a receive loop

# Fields merged specially; all others keep the newest non-nil value, except the ones in
# _KEEP_FIRST, which only a request's first output carries.
_SPECIAL = frozenset(
    {"request_id", "new_token_ids", "new_logprobs", "events", "num_nans_in_logits",
     "finish_reason", "stop_reason"}
)  # fmt: skip
_KEEP_FIRST = frozenset(
    {"new_prompt_logprobs_tensors", "prefill_stats", "prompt_token_id_logprobs"}
)
_other_fields_cache: dict[
    type, tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]], tuple[None, ...]]
] = {}


def _other_fields(
    cls: type,
) -> tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]], tuple[None, ...]]:
    """The fields merged by "newest non-nil wins", a getter of their values as a tuple
    (one C call: most outputs carry none of them, and a getattr per field was the
    largest part of a merge), and that many Nones (to test all of them in one C
    comparison)."""
    cached = _other_fields_cache.get(cls)
    if cached is None:
        names: tuple[str, ...] = getattr(cls, "__struct_fields__", ())
        fields = tuple(n for n in names if n not in _SPECIAL)
        if len(fields) >= 2:
            getter: Callable[[Any], tuple[Any, ...]] = operator.attrgetter(*fields)
        else:  # attrgetter of one name returns the value, not a tuple

            def getter(obj: Any, fields: tuple[str, ...] = fields) -> tuple[Any, ...]:
                return tuple(getattr(obj, n) for n in fields)

        cached = _other_fields_cache[cls] = (fields, getter, (None,) * len(fields))
    return cached


def _concat_logprobs(parts: list[Any]) -> Any:
    """Row-wise concatenation of LogprobsLists-like structs (numpy arrays), once."""
    import numpy as np

    first = parts[0]
    if len(parts) == 1:
        return first
    changes: dict[str, Any] = {}
    for name in first.__struct_fields__:
        values = [getattr(p, name) for p in parts]
        if name == "cu_num_generated_tokens" or any(v is None for v in values):
            changes[name] = None  # offsets of the parts no longer hold for the merge
        elif isinstance(values[0], list):
            changes[name] = [x for v in values for x in v]
        else:
            changes[name] = np.concatenate([np.asarray(v) for v in values], axis=0)
    return msgspec.structs.replace(first, **changes)


def _merge_into(a: Any, b: Any, lp_parts: list[Any] | None) -> list[Any] | None:
    """Merge output ``b`` into ``a`` in place (``a`` must be owned by the caller).

    Costs O(size of ``b``): token ids and events are extended in place, and logprob
    rows are collected in ``lp_parts`` (returned) to be concatenated once, by
    `_finish_merge`, when ``a`` is handed out.
    """
    a.new_token_ids.extend(b.new_token_ids)
    a.finish_reason = b.finish_reason
    a.stop_reason = b.stop_reason
    logprobs = b.new_logprobs
    if logprobs is not None:
        if lp_parts is None:
            lp_parts = [] if a.new_logprobs is None else [a.new_logprobs]
        lp_parts.append(logprobs)
    events = b.events
    if events:
        if a.events is None:
            a.events = list(events)
        else:
            a.events.extend(events)
    nans = b.num_nans_in_logits
    if nans:
        a.num_nans_in_logits = (a.num_nans_in_logits or 0) + nans
    cached = _other_fields_cache.get(type(b))
    fields, getter, nones = _other_fields(type(b)) if cached is None else cached
    values = getter(b)
    # All nil, the common case, in one C comparison: a tuple compares its items by
    # identity first, so only a non-nil value is compared with ``==`` (False, or an
    # ndarray's elementwise answer, which may have no truth value: then the loop below
    # decides, by identity).
    try:
        if values == nones:
            return lp_parts
    except Exception:  # the loop below answers
        pass
    for name, value in zip(fields, values, strict=True):
        if value is not None and not (name in _KEEP_FIRST and getattr(a, name) is not None):
            setattr(a, name, value)
    return lp_parts


def _finish_merge(a: Any, lp_parts: list[Any] | None) -> None:
    if lp_parts:
        a.new_logprobs = _concat_logprobs(lp_parts)


def coalesce_outputs(a: Any, b: Any) -> Any:
    """Return the merge of output ``b`` (newer) into ``a`` (older) of one request.

    ``a`` and ``b`` are left unchanged. Works on any EngineCoreOutput profile (fields
    are looked up by name). See the module documentation for the rules.
    """
    merged = msgspec.structs.replace(
        a,
        new_token_ids=list(a.new_token_ids),
        events=None if a.events is None else list(a.events),
    )
    _finish_merge(merged, _merge_into(merged, b, None))
    return merged


class RequestStream(Mailbox[EngineCoreOutput]):
    """The outputs of one request, in order: ``async for out in stream``.

    Obtained from ``async with client.generate(request) as stream``. Iteration yields
    one `EngineCoreOutput` per engine step (or a coalesced one, see
    the module documentation) and stops after the output that carries a
    ``finish_reason``, or when the request was aborted through
    `abort_requests`.

    ``await stream.receive_batch()`` returns every buffered output at once (in order,
    at least one; ``anyio.EndOfStream`` after the final one): a consumer that lags
    behind the engine then pays one call and one wake-up per batch instead of one per
    output. ``receive`` and ``receive_nowait`` take one output, as ``__anext__`` does.

    Errors: `EngineDeadError` once the engine died and every output
    that arrived before is consumed. Cancellation: a cancelled ``__anext__``,
    ``receive`` or ``receive_batch`` consumed nothing; the next call returns the same
    outputs.

    Attributes:
        request_id: the id sent to the engine.
        rank: the data-parallel rank serving it.
        finish_reason: the final output's ``finish_reason`` (``None`` while running).
        aborted: the request was aborted by the client (no final output follows).
        coalesced: how many outputs were merged into earlier ones because the consumer
            lagged more than ``max_pending`` steps.
    """

    def __init__(
        self,
        request_id: str,
        rank: int,
        *,
        max_pending: int = 64,
        budget: ListenBudget = _UNBOUNDED,
    ) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        super().__init__()
        self.request_id = request_id
        self.rank = rank
        self.max_pending = max_pending
        self.finish_reason: FinishReason | None = None
        self.aborted = False
        self.coalesced = 0
        self._received_final = False  # the receive task saw the finishing output
        self._done = False  # iteration is over (final output consumed, or aborted)
        self._lp_parts: list[Any] | None = None  # logprob rows merged into _pending[-1]
        self._listener: Callable[[EngineCoreOutput], bool] | None = None
        self._budget = budget

    def __repr__(self) -> str:
        return (
            f"<RequestStream {self.request_id!r} rank={self.rank} "
            f"pending={len(self._pending)} finished={self.finished}>"
        )

    @property
    def finished(self) -> bool:
        """True once the engine sent the request's final output (or it was aborted)."""
        return self._received_final or self.aborted

    # -- producer side (the client's receive task; synchronous, never blocks) ------
    # Called by the client only, never by application code.

    def set_listener(self, listener: Callable[[EngineCoreOutput], bool] | None) -> None:
        """Offer outputs to ``listener`` before queueing them (``None``: stop).

        For frontends that handle an engine step's output without waking their task
        (``trio-vllm serve``'s streamed responses): while the consumer is parked in
        a receive with nothing buffered, and the output is not the final one, the
        receive task calls ``listener(output)`` synchronously (for at most
        `LISTEN_INTERVAL` of each run of the receive task). ``True``: the listener
        took it; nothing is queued and the consumer stays parked. ``False``: it is
        queued and the consumer woken, as without a listener. On trio only (elsewhere a
        cancelled consumer cannot be told from a parked one, so every output is
        queued). The listener runs inside the client's receive task: it must not
        block, and must not raise (that would end the receive task).
        """
        self._listener = listener

    def deliver(self, output: EngineCoreOutput) -> None:
        """Queue (or coalesce) one output of this request; late ones are dropped."""
        if self._received_final or self.aborted:
            return  # late output after finish/abort: ignore (docs/protocol.md §3.4)
        pending = self._pending
        if not pending:
            listener = self._listener
            if (
                listener is not None
                and output.finish_reason is None
                and self._wakeup.parked()
                and _monotonic() < self._budget.until
                and listener(output)
            ):
                return
            pending.append(output)
            if output.finish_reason is not None:
                self._received_final = True
            # A parked consumer implies an empty queue (it looks right before it
            # parks, and every put into an empty queue wakes it), so only this put can
            # need a wake-up.
            if self._waiting:
                self._wakeup.set()
            return
        if len(pending) >= self.max_pending:
            # Merge into the newest buffered output, in place: it is ours (decoded for
            # this stream alone) and the consumer has not seen it yet.
            self._lp_parts = _merge_into(pending[-1], output, self._lp_parts)
            self.coalesced += 1
        else:
            if self._lp_parts is not None:
                _finish_merge(pending[-1], self._lp_parts)
                self._lp_parts = None
            pending.append(output)
        if output.finish_reason is not None:
            self._received_final = True

    def fail(self, error: Callable[[], BaseException]) -> None:
        """The request failed: ``error()`` is raised once the buffered outputs are read."""
        self.end(error)

    def abort_locally(self) -> None:
        """The client aborted the request: drop what is buffered and stop iterating."""
        self.aborted = True
        self._pending.clear()
        self._lp_parts = None
        self._notify()

    # -- consumer side ----------------------------------------------------------------

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> EngineCoreOutput:
        # The per-output path of every stream, inlined: an output buffered, no merge
        # pending on it, the yield not due and the cancellation predicate bound (after
        # the consumer's first call). Exactly what Mailbox.__anext__ and _take do for
        # that case, without their two method calls (docs/performance.md, issue 25);
        # everything else (waiting, yielding, the end, a pending merge) is theirs.
        pending = self._pending
        if pending and self._lp_parts is None and _monotonic() < self._yield_due:
            check = self._cancel_pending
            if check is not None:
                if check():
                    await checkpoint_if_cancelled()  # raises: nothing consumed
                output = pending.popleft()
                if output.finish_reason is not None:
                    self.finish_reason = output.finish_reason
                    self._done = True
                return output
        return await super().__anext__()

    def _at_end(self) -> bool:
        return self._done or self.aborted

    def _take(self) -> EngineCoreOutput:
        output = self._pending.popleft()
        if not self._pending and self._lp_parts is not None:
            _finish_merge(output, self._lp_parts)
            self._lp_parts = None
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason
            self._done = True
        return output

    def take_now(self) -> EngineCoreOutput | None:
        return None  # _take's bookkeeping: always the awaiting path (unused by the client)

    def _take_all(self) -> list[EngineCoreOutput]:
        # Only the last output needs _take's bookkeeping (a pending merge, the final
        # output: nothing is queued after it).
        pending = self._pending
        outputs = [pending.popleft() for _ in range(len(pending) - 1)]
        outputs.append(self._take())
        return outputs

    async def collect(self) -> list[int]:
        """Consume the rest of the stream and return all new token ids, concatenated."""
        tokens: list[int] = []
        async for output in self:
            tokens.extend(output.new_token_ids)
        return tokens
