"""The client's sending side: every frame to an engine goes through `Sender`.

A send that finds no peer (`UnroutableError`) is the session's business: the rank is
noticed as gone (declared after the receive task drained it) and the caller gets its
`EngineDeadError`. Aborts are queued without a checkpoint where possible, so they also
work in cancelled code.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import anyio

from .._exceptions import TrioVllmError, UnroutableError
from ..protocol.handshake import identity_for_rank

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ..protocol.session import ClientSession
    from ..transport import AsyncSocket
    from ._wire import Wire

__all__ = ["Sender"]


class Sender:
    """Sends frames to ranks over the client's input socket."""

    def __init__(
        self,
        input_socket: AsyncSocket,
        # Any handles: the sender only reads and records deaths, never a stream or call
        # (and _calls, which holds Call, imports this module).
        session: ClientSession[Any, Any],
        wire: Wire,
        wake: Callable[[], None],
    ) -> None:
        self._input = input_socket
        self._session = session
        self._wire = wire
        self._wake = wake  # the receive task: drain, then declare a noticed death

    async def send(
        self, rank: int, frames: Sequence[bytes], *, request_id: str | None = None
    ) -> None:
        """Send one message to ``rank``; `EngineDeadError` if it (or the client) is gone.
        ``request_id``: the message is that request's ADD (a failed send then fails the
        request with the rank's death, and its ``rank_lost`` event lists it).
        Cancellation: as the socket's send (nothing sent)."""
        try:
            await self._input.send([identity_for_rank(rank), *frames])
        except UnroutableError as exc:
            record = self._session.notice_rank(
                rank, f"engine {rank} is no longer connected", exc, request_id=request_id
            )
            self._wake()
            raise record.error() from exc
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            raise self._session.dead_error() from exc

    def send_nowait_best_effort(self, rank: int, frames: Sequence[bytes]) -> bool:
        """Try to queue a message without a checkpoint; False if it could not go now."""
        if self._session.dead:
            return True
        try:
            self._input.send_nowait([identity_for_rank(rank), *frames])
        except anyio.WouldBlock:
            return False
        except (UnroutableError, anyio.ClosedResourceError, anyio.BrokenResourceError):
            return True  # nothing to abort on an engine that is gone
        return True

    async def send_abort(self, rank: int, request_ids: list[str]) -> None:
        """Queue an ABORT without a checkpoint when possible (safe in cancelled code)."""
        frames = self._wire.encode_abort(request_ids)
        if self.send_nowait_best_effort(rank, frames):
            return
        # The peer's queue is full (only with a finite HWM): wait briefly, shielded.
        with (
            anyio.CancelScope(shield=True),
            anyio.move_on_after(1.0),
            contextlib.suppress(TrioVllmError, anyio.ClosedResourceError),
        ):
            await self.send(rank, frames)
