"""Scripted peers for the issue-16 test classes: late answers, deaths with outputs queued.

:class:`ScriptedPeer` is the :class:`~._peer.Peer` (the real handshake on real sockets,
in the test's process) with three more knobs:

* ``hold_ready``: an event the peer waits on after it received the init metadata and
  before it sends its ready response and READY, so that a test can make an engine answer
  *after* the client gave up (a startup or a join that timed out or was cancelled);
* :meth:`queue_outputs`: send many outputs at once without a checkpoint, then block the
  event loop while ZeroMQ's I/O threads move them into the client's socket (the client's
  loop is "busy": every output is queued there before the client sees the death);
* :meth:`close_input`: drop the connection to the client's input socket (what a dead
  engine process does), so that the client's next send fails or its monitor fires.

:class:`ScriptedSource` is an engine source for such peers with any ``start_rank`` (for
``add_engines``), optionally with a stand-in process per rank (a sleeping python) so the
client's process watcher has something to watch and the test something to kill.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio
import zmq

from trio_vllm import EngineCoreClient, EngineCoreOutput
from trio_vllm.client._process import spawn_engine_process
from trio_vllm.protocol import UtilityCall

from ._peer import Peer, PeerEngines, _bytes, serving

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from trio_vllm.client._process import EngineProcess
    from trio_vllm.transport import AsyncSocket

# A stand-in engine process: alive until killed (SIGTERM included: it ignores it, like
# an engine that is still loading and does not handle signals yet).
_SLEEPER = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


class ScriptedSource(PeerEngines):
    """``count`` in-process peers from ``start_rank``; with ``processes``, one stand-in
    process per rank that the client watches (and stops at exit)."""

    def __init__(self, count: int = 1, *, start_rank: int = 0, processes: bool = False) -> None:
        super().__init__(count, start_rank=start_rank)
        self.with_processes = processes
        self.processes: list[EngineProcess] = []

    async def spawn(self, handshake_address: str) -> list[EngineProcess]:
        await super().spawn(handshake_address)
        if self.with_processes:
            for rank in self.ranks:
                self.processes.append(
                    await spawn_engine_process(
                        [sys.executable, "-c", _SLEEPER], name=f"stand-in {rank}", ranks=[rank]
                    )
                )
        return list(self.processes)

    def describe(self) -> str:
        return f"{self.count} scripted peer(s) (ranks {self.ranks})"


class ExternalAddress:
    """What :meth:`ScriptedPeer.serve` needs of a source whose address is known already
    (an :class:`~trio_vllm.ExternalEngines` handshake address)."""

    def __init__(self, handshake_address: str) -> None:
        self.handshake_address: str | None = handshake_address
        self.address_known = anyio.Event()
        self.address_known.set()


class ScriptedPeer(Peer):
    """A :class:`~._peer.Peer` with the knobs of the module documentation."""

    def __init__(self, *, rank: int = 0, hold_ready: anyio.Event | None = None) -> None:
        super().__init__(rank=rank)
        self.hold_ready = hold_ready
        self.got_metadata = anyio.Event()
        self.answered = anyio.Event()  # the ready response and READY went out
        # Unbounded, so that queue_outputs never meets a high-water mark.
        self.output_options = {zmq.SNDHWM: 0}

    async def before_ready(self) -> None:
        self.got_metadata.set()
        if self.hold_ready is not None:
            await self.hold_ready.wait()

    async def receive(self, inp: AsyncSocket) -> None:
        # Strict, unlike Peer's: an undecodable message fails the test; only "echo" is
        # answered; the loop ends quietly once close_input() closed the socket.
        self.answered.set()
        with _closed_ok():
            while True:
                frames = [_bytes(f) for f in await inp.receive()]
                message = self.codec.decode_input(frames)
                self.received.append(message)
                self.arrived.set()
                if (
                    self.reply_utilities
                    and isinstance(message, UtilityCall)
                    and message.method == "echo"
                ):
                    await self.reply(message, message.args)

    def queue_outputs(self, messages: Sequence[Sequence[Any]], *, settle: float = 0.3) -> None:
        """Send ``messages`` (frame lists) now, without a checkpoint, then block the loop
        ``settle`` seconds: ZeroMQ's I/O threads move them into the client's queue
        meanwhile, while no task of the client runs."""
        assert self.output is not None
        for frames in messages:
            self.output.send_nowait(list(frames))
        time.sleep(settle)  # the client's loop is "busy" on purpose

    def token_outputs(self, request_id: str, count: int) -> list[list[Any]]:
        """``count`` messages of one token each (ids 0, 1, ...), none finishing."""
        return [
            self.encode([EngineCoreOutput(request_id, new_token_ids=[i % 256])])
            for i in range(count)
        ]

    def close_input(self) -> None:
        """Drop the connection to the client's input socket, as a dead process does."""
        assert self.input is not None
        self.input.close(linger=0)


class _closed_ok:
    """Swallow the end of the peer's receive loop when a test closed its input socket."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, anyio.ClosedResourceError)


def kill(process: EngineProcess) -> None:
    """SIGKILL a stand-in process (no checkpoint)."""
    os.kill(process.pid, signal.SIGKILL)


@contextlib.asynccontextmanager
async def scripted_client(
    peers: Sequence[ScriptedPeer], source: Any, **client_options: Any
) -> AsyncIterator[EngineCoreClient]:
    """``open_client(source)`` with ``peers`` serving it (each on ``source``'s address, or
    ``address`` for external sources); exceptions from the body propagate unwrapped."""
    where = client_options.pop("address", None)
    async with serving(peers, source, where, **client_options) as client:
        yield client


def free_tcp_port() -> int:
    """A port that was free a moment ago (for an ExternalEngines handshake address)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
