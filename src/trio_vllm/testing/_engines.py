"""Reference engines for tests: a configuration, and a running set with its client."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, final

import anyio
import zmq

from ..client import EngineCoreClient, ReferenceEngines, open_client
from ..transport import PrivateIpcDir
from ._clock import real_time
from ._control import EngineControl, EngineStatus

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping, Sequence

__all__ = ["EngineConfig", "ReferenceEngineSet", "open_reference_engines"]


@dataclass(frozen=True)
class EngineConfig:
    """How to start a set of reference engines for a test.

    Attributes:
        count: number of engines (data-parallel ranks 0 .. count-1).
        model: ``"echo"`` (exactly predictable, the default) or ``"tiny"`` (a small
            torch transformer).
        protocol: vLLM release whose wire layout the engines speak (``"0.25.1"``,
            ``"0.32.0"``, ``"0.33.0"``; ``None``: the engine's default).
        faults: fault flags fixed at startup, passed verbatim, e.g.
            ``("--die-after-steps", "3")`` (see
            ``python -m trio_vllm.reference_engine --help``). Run-time faults go
            through `EngineControl` instead.
        extra_args: more engine command-line arguments, verbatim.
        device: torch device for ``model="tiny"`` (default: the engine's choice).
        transport: ``"ipc"`` or ``"tcp"`` (loopback) between client and engines.
        env: environment variables added for the engine processes.
        ready_timeout: seconds to wait for the engines to be ready.
        shutdown_grace: seconds between SIGTERM and SIGKILL at the end.
        stream_buffer: the client's default per-stream buffer.
        control_timeout: seconds a control command waits for the engine's reply.
    """

    count: int = 1
    model: str = "echo"
    protocol: str | None = None
    faults: Sequence[str] = ()
    extra_args: Sequence[str] = ()
    device: str | None = None
    transport: Literal["ipc", "tcp"] = "ipc"
    env: Mapping[str, str] = field(default_factory=dict)
    ready_timeout: float = 30.0
    shutdown_grace: float = 2.0
    stream_buffer: int = 64
    control_timeout: float = 10.0

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` applied (unknown names raise ``TypeError``)."""
        return dataclasses.replace(self, **changes)


class _ControlledReferenceEngines(ReferenceEngines):
    """The bundled reference engine, each rank with its own control socket."""

    def __init__(self, config: EngineConfig, control_addresses: Mapping[int, str]) -> None:
        super().__init__(
            config.count,
            model=config.model,
            device=config.device,
            faults=config.faults,
            protocol=config.protocol,
            extra_args=config.extra_args,
            env=config.env,
            transport=config.transport,
        )
        self.control_addresses = dict(control_addresses)

    def command(self, handshake_address: str, rank: int) -> list[str]:
        return [
            *super().command(handshake_address, rank),
            "--control-address",
            self.control_addresses[rank],
        ]


@final
class ReferenceEngineSet:
    """Running reference engines, the client connected to them, and their controls.

    Created by `open_reference_engines` (or the ``reference_engines`` fixture).

    Attributes:
        client: the connected `EngineCoreClient`.
        controls: one `EngineControl` per rank, in rank order.
        config: the `EngineConfig` the engines were started with.
    """

    def __init__(
        self, client: EngineCoreClient, controls: Sequence[EngineControl], config: EngineConfig
    ) -> None:
        self.client = client
        self.controls = list(controls)
        self.config = config

    def __repr__(self) -> str:
        return f"<ReferenceEngineSet ranks={self.ranks} model={self.config.model!r}>"

    @property
    def ranks(self) -> list[int]:
        """The engines' data-parallel ranks."""
        return [c.rank for c in self.controls]

    def control(self, rank: int | None = None) -> EngineControl:
        """The control of engine ``rank`` (default: the first)."""
        if rank is None:
            return self.controls[0]
        for control in self.controls:
            if control.rank == rank:
                return control
        raise ValueError(f"no engine with rank {rank} (ranks: {self.ranks})")

    async def statuses(self) -> list[EngineStatus]:
        """Every engine's status, in rank order."""
        return [await c.status() for c in self.controls]

    async def wait_idle(self, within: float = 5.0) -> None:
        """Wait until no engine holds a request; ``TimeoutError`` otherwise."""
        for control in self.controls:
            await control.wait_idle(within)


async def _ask_to_shut_down(client: EngineCoreClient, controls: Sequence[EngineControl]) -> None:
    """Make the engines exit promptly before ``open_client`` stops them (best effort).

    The reference engine can miss a SIGTERM that arrives while it blocks in ``poll``
    (the signal may be delivered to a helper thread), which costs the whole
    ``shutdown_grace`` before SIGKILL; the control socket's ``shutdown`` takes the same
    clean path at once. Once the client is dead nothing is left to observe, and an
    engine on vLLM's fatal path lingers seconds to flush ``ENGINE_CORE_DEAD``: those get
    SIGKILL (their pids cannot be reused before ``open_client`` reaps them).
    ``open_client`` then sends SIGTERM, waits and reaps as usual.
    """
    if client.dead:
        for control in controls:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                control.send_signal(signal.SIGKILL)
        return
    with anyio.CancelScope(shield=True):
        for control in controls:
            with anyio.move_on_after(0.5), contextlib.suppress(TimeoutError, RuntimeError):
                await control.shutdown()


@contextlib.asynccontextmanager
async def open_reference_engines(
    config: EngineConfig | None = None, /, **changes: Any
) -> AsyncIterator[ReferenceEngineSet]:
    """Start reference engines with control sockets, connect a client, yield the set.

    ``config`` (default `EngineConfig()`) with ``changes`` applied, e.g.
    ``open_reference_engines(count=2, protocol="0.25.1")``. Startup and shutdown run in
    real time under a trio ``MockClock``.

    Raises `EngineStartupError` if the engines do not start. On
    exit, by return, exception or cancellation, the client is closed and every engine
    process stopped and reaped (see `open_client`); exceptions
    from the body propagate as they are. Enter and leave it in the same task (an async
    generator fixture does).
    """
    config = (config or EngineConfig()).replace(**changes)
    ipc = PrivateIpcDir(prefix="trio-vllm-test-")
    context: zmq.Context[Any] = zmq.Context()
    try:
        addresses = {r: ipc.endpoint(f"control-{r}") for r in range(config.count)}
        source = _ControlledReferenceEngines(config, addresses)
        client_cm = open_client(
            source,
            ready_timeout=config.ready_timeout,
            shutdown_grace=config.shutdown_grace,
            stream_buffer=config.stream_buffer,
        )
        with real_time():
            client = await client_cm.__aenter__()
        try:
            pids = client.engine_pids
            controls = [
                EngineControl(
                    rank=rank,
                    address=addresses[rank],
                    pid=pids[rank],
                    context=context,
                    timeout=config.control_timeout,
                )
                for rank in source.ranks
            ]
            yield ReferenceEngineSet(client, controls, config)
        except BaseException as exc:
            with real_time():
                await _ask_to_shut_down(client, controls)
                if not await client_cm.__aexit__(type(exc), exc, exc.__traceback__):
                    raise
        else:
            with real_time():
                await _ask_to_shut_down(client, controls)
                await client_cm.__aexit__(None, None, None)
    finally:
        context.destroy(linger=0)  # never blocks, even on a command still in flight
        ipc.cleanup()
