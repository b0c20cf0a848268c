"""Utility calls on the wire: one call to one rank, and one call to every live rank.

The session's utility-call table matches replies to calls (reserved ids are engine
events, never replies); `Call` is the slot a reply fills, handed to the session as the
call's handle and filled by the client's ``apply`` (`ResolveCall`, `FailCall`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from .._exceptions import EngineDeadError, TrioVllmError, UtilityCallError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ..protocol.session import ClientSession, DeathRecord
    from ._sender import Sender
    from ._streams import RequestStream
    from ._wire import Wire

__all__ = ["Call", "call_all", "call_one"]


@dataclass(slots=True)
class Call:
    """The reply slot of one pending call: a failure text, a result, or a death."""

    event: anyio.Event
    failure: str | None = None
    result: object = None
    record: DeathRecord | None = None


async def call_one(
    session: ClientSession[RequestStream, Call],
    wire: Wire,
    sender: Sender,
    method: str,
    args: list[object],
    rank: int | None,
) -> object:
    """Call ``method(*args)`` on ``rank`` (else the least busy) and wait for the reply;
    see `EngineCoreClient.call_utility`."""
    if not method:
        raise ValueError(f"method must be a non-empty string, got {method!r}")
    target = session.choose_rank(rank)
    call = Call(anyio.Event())
    call_id = session.start_call(method, target, call)
    try:
        frames = wire.encode_utility(wire.client_index, call_id, method, args)
        await sender.send(target, frames)
        await call.event.wait()
    finally:
        session.end_call(call_id)
    if call.record is not None:
        raise call.record.error()
    if call.failure is not None:
        raise UtilityCallError(method, call.failure, rank=target)
    return call.result


async def call_all(
    call: Callable[[int], Awaitable[object]], ranks: list[int], *, return_exceptions: bool
) -> list[object]:
    """``call(rank)`` for every rank concurrently; see `EngineCoreClient.call_utility_all`."""
    results: dict[int, object] = {}
    errors: dict[int, Exception] = {}

    async def one(rank: int) -> None:
        try:
            results[rank] = await call(rank)
        except (TrioVllmError, ValueError, TypeError) as exc:
            # Caller errors (unencodable arguments) too, so they surface as the
            # same plain exception call_utility raises, not as an exception group.
            errors[rank] = exc

    async with anyio.create_task_group() as tg:
        for rank in ranks:
            tg.start_soon(one, rank)
    if return_exceptions:
        return [errors[r] if r in errors else results[r] for r in ranks]
    if errors:
        dead = [e for e in errors.values() if isinstance(e, EngineDeadError)]
        raise dead[0] if dead else errors[min(errors)]
    return [results[r] for r in ranks]
