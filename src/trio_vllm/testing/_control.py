"""The engine's side, reached from inside a test: the reference engine's control socket.

Each engine started by `open_reference_engines` binds a REP
socket (``--control-address``) that serves JSON commands while the client uses the
engine: kill it, make it send ``ENGINE_CORE_DEAD``, stall it, send a garbage frame, delay
its outputs, fail a utility, or report what it is running.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, final

import anyio
import zmq

from ..transport import AsyncSocket
from ._clock import real_time

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["EngineControl", "EngineStatus"]

DEFAULT_CONTROL_TIMEOUT: Final = 10.0


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """What one engine reports about itself (the control socket's ``ping``)."""

    pid: int
    steps: int
    running: int
    waiting: int
    firehose: int
    stalled: bool
    input_dead: bool
    output_dead: bool

    @property
    def requests(self) -> int:
        """Requests the engine holds: running, waiting and firehose ones."""
        return self.running + self.waiting + self.firehose

    @classmethod
    def from_reply(cls, reply: Mapping[str, Any]) -> EngineStatus:
        return cls(
            pid=int(reply["pid"]),
            steps=int(reply["steps"]),
            running=int(reply["running"]),
            waiting=int(reply["waiting"]),
            firehose=int(reply.get("firehose", 0)),
            stalled=bool(reply["stalled"]),
            input_dead=bool(reply["input_dead"]),
            output_dead=bool(reply["output_dead"]),
        )


@final
class EngineControl:
    """A handle on one running reference engine (one data-parallel rank).

    Obtained from a `ReferenceEngineSet` (or the
    ``engine_control`` fixture). Every command is one request/reply on the engine's
    control socket, served by the engine between two steps, so it takes effect at once
    and in order with the engine's own work. Commands work on trio and asyncio, run in
    real time under a trio ``MockClock``, and raise ``TimeoutError`` if the engine does
    not answer within ``timeout`` seconds (a killed or exited engine never answers).

    Cancellation: a cancelled command may or may not have reached the engine; the
    socket it used is closed either way.
    """

    def __init__(
        self,
        *,
        rank: int,
        address: str,
        pid: int,
        context: zmq.Context[Any],
        timeout: float = DEFAULT_CONTROL_TIMEOUT,
    ) -> None:
        self.rank = rank
        self.address = address
        self.pid = pid
        self.timeout = timeout
        self._context = context

    def __repr__(self) -> str:
        return f"<EngineControl rank={self.rank} pid={self.pid} {self.address}>"

    async def command(self, cmd: str, **args: Any) -> dict[str, Any]:
        """Send one raw control command and return the engine's reply map.

        Raises ``RuntimeError`` if the engine refused the command and ``TimeoutError``
        if it did not answer.
        """
        # A fresh REQ socket per command: a cancelled or timed-out request cannot leave
        # the REQ state machine waiting for a reply that belongs to someone else.
        with real_time(), AsyncSocket.create(self._context, zmq.REQ) as sock:
            sock.connect(self.address)
            await sock.send([json.dumps({"cmd": cmd, **args}).encode()])
            with anyio.move_on_after(self.timeout):
                frames = await sock.receive()
                first = frames[0]
                reply: dict[str, Any] = json.loads(
                    first if isinstance(first, bytes) else first.bytes
                )
                if not reply.get("ok"):
                    raise RuntimeError(
                        f"engine {self.rank} refused control command {cmd!r}: {reply.get('error')}"
                    )
                return reply
        raise TimeoutError(
            f"engine {self.rank} (pid {self.pid}) did not answer {cmd!r} within "
            f"{self.timeout:g} s (is it still running?)"
        )

    async def status(self) -> EngineStatus:
        """What the engine runs now (requests, steps, stalled, ...)."""
        return EngineStatus.from_reply(await self.command("ping"))

    async def kill(self, code: int = 1) -> None:
        """Make the engine exit at once with ``code`` (``os._exit``), sending nothing.

        Like a segfault or SIGKILL: the client notices the process exit. Returns once
        the engine acknowledged; it exits about 50 ms later.
        """
        await self.command("kill", code=code)

    async def send_engine_dead(self) -> None:
        """Make the engine send ``ENGINE_CORE_DEAD`` to its clients now and exit 1."""
        await self.command("dead")

    async def stall(self) -> None:
        """Stop the engine reading input and writing output (it stays up)."""
        await self.command("stall")

    async def unstall(self) -> None:
        """Resume a stalled engine."""
        await self.command("unstall")

    async def send_garbage(self) -> None:
        """Make the engine send one undecodable frame on its output sockets now."""
        await self.command("garbage")

    async def delay_outputs(self, ms: float) -> None:
        """Hold every later output message ``ms`` milliseconds (order kept; 0 = off)."""
        await self.command("delay", ms=float(ms))

    async def fail_utility(self, name: str) -> None:
        """Make every later call of utility ``name`` fail on the engine."""
        await self.command("fail_utility", name=name)

    async def unfail_utility(self, name: str) -> None:
        """Undo `fail_utility`."""
        await self.command("unfail_utility", name=name)

    async def shutdown(self) -> None:
        """Ask the engine to shut down cleanly (as on SIGTERM: aborts, then exits 0)."""
        await self.command("shutdown")

    def send_signal(self, signum: int = signal.SIGKILL) -> None:
        """Send a signal to the engine process (default SIGKILL); not a checkpoint."""
        os.kill(self.pid, signum)

    async def wait_idle(self, within: float = 5.0, *, allowed: int = 0) -> EngineStatus:
        """Wait up to ``within`` real seconds until the engine holds at most ``allowed``
        requests; return its status.

        Aborts reach the engine on another socket than control commands, so an abort
        sent just before may still be queued: this polls (every 5 ms, real time).
        Raises ``TimeoutError`` with the last status if it does not get there.
        """
        with real_time():
            status = await self.status()
            with anyio.move_on_after(within):
                while status.requests > allowed:
                    await anyio.sleep(0.005)
                    status = await self.status()
        if status.requests > allowed:
            raise TimeoutError(
                f"engine {self.rank} still holds {status.requests} request(s) after "
                f"{within:g} s ({status})"
            )
        return status
