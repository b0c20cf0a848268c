"""Engines shared by several frontend processes: `open_shared_engines`, `AttachedEngines`.

vLLM's ``vllm serve --api-server-count N`` starts the engines in a parent process and
N API-server processes, each with its own engine-core client; every engine serves all
of them. The wire protocol carries it (docs/protocol.md §2.1, §5.6): the init metadata
lists one input and one output address per frontend, the engine connects to all of
them, sends its ready response on every input, and routes each request's results (and
each utility reply) to ``outputs[client_index]`` of the request.

Here the parent opens `open_shared_engines(engines, clients=N)`: it spawns (or waits
for) the engines and does the handshake alone (`ClientHandshake` stage
``"handshake"``), advertising N address pairs that nobody has bound yet. Its handle's
`SharedEngines.attachment` is a small picklable value; worker ``k`` opens
``open_client(attachment.client(k))`` (or ``open_llm(...)``), which binds pair ``k``,
waits for every engine's ready response (stage ``"input"``) and from then on is an
ordinary client whose requests carry ``client_index = k``. ZeroMQ connects before a
bind succeed later, so the workers may start before, during or after the handshake.

Death: the parent watches the processes it spawned (`SharedEngines.wait_dead`); each
worker watches its input socket's connections (a dead engine's connection drops), so
every worker's streams end with `EngineDeadError` on its own.
"""

from __future__ import annotations

import contextlib
import json
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from .._exceptions import EngineDeadError
from ..protocol.handshake import ClientHandshake
from ..transport import tcp_endpoint
from ._args import integer
from ._engines import EngineSource, SocketLayout, check_sources
from ._startup import (
    DEFAULT_SHUTDOWN_GRACE,
    HandshakeRun,
    Sockets,
    SourceSet,
    default_ready_timeout,
    start_engines,
    stop_processes,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence

    from ._process import EngineProcess
    from ._startup import StartupProgress

__all__ = ["AttachedEngines", "EngineAttachment", "SharedEngines", "open_shared_engines"]

_MAX_CLIENTS = 1024


@dataclass(frozen=True, slots=True)
class EngineAttachment:
    """Where the frontends of shared engines bind: picklable, and JSON (`to_json`).

    ``inputs[k]`` / ``outputs[k]``: the addresses frontend ``k`` binds its input
    ROUTER and output PULL at (the engines connect there); ``ranks``: the engines'
    data-parallel ranks; ``vllm_version`` is not known here (each frontend reads it
    from the ready responses).
    """

    ranks: tuple[int, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @property
    def client_count(self) -> int:
        """The number of frontends the engines were told about."""
        return len(self.inputs)

    def client(self, client_index: int) -> AttachedEngines:
        """The engine source for frontend ``client_index`` (0 ... ``client_count - 1``)."""
        return AttachedEngines(self, client_index)

    def to_json(self) -> str:
        return json.dumps(
            {"ranks": list(self.ranks), "inputs": list(self.inputs), "outputs": list(self.outputs)}
        )

    @classmethod
    def from_json(cls, text: str) -> EngineAttachment:
        """Parse `to_json`'s output; ``ValueError`` for anything else."""
        try:
            data = json.loads(text)
            attachment = cls(
                ranks=tuple(int(r) for r in data["ranks"]),
                inputs=tuple(str(a) for a in data["inputs"]),
                outputs=tuple(str(a) for a in data["outputs"]),
            )
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"not an engine attachment: {text[:200]!r} ({exc})") from exc
        if not attachment.ranks or len(attachment.inputs) != len(attachment.outputs):
            raise ValueError(f"not an engine attachment: {text[:200]!r}")
        return attachment


class AttachedEngines(EngineSource):
    """Engines shared with other frontends: frontend ``client_index`` of an attachment.

    Pass it to `open_client` or `open_llm` in a worker process; it spawns nothing and
    does no handshake (the process that opened `open_shared_engines` did). The client
    binds the attachment's addresses for ``client_index``, waits for every engine's
    ready response (``ready_timeout``), stamps ``client_index`` into every request and
    utility call, and treats a dropped engine connection as that engine's death.
    Cancellation, death and shutdown are as for any other source; leaving the client
    stops no engine (the sharing process owns them).
    """

    def __init__(self, attachment: EngineAttachment, client_index: int) -> None:
        if not isinstance(attachment, EngineAttachment):
            raise TypeError(
                f"AttachedEngines(attachment=...) must be an EngineAttachment, got "
                f"{type(attachment).__name__}"
            )
        ranks = list(attachment.ranks)
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            raise ValueError(f"AttachedEngines: ranks {ranks} are not consecutive")
        super().__init__(len(ranks), ranks[0])
        self.attachment = attachment
        self.client_index = integer(
            "AttachedEngines(client_index=...)",
            client_index,
            minimum=0,
            maximum=attachment.client_count - 1,
        )
        self.client_count = attachment.client_count

    def layout(self) -> SocketLayout:
        k = self.client_index
        return SocketLayout(
            None,
            None,
            None,
            None,
            None,
            watch_disconnects=True,
            attach=(self.attachment.inputs[k], self.attachment.outputs[k]),
        )

    def describe(self) -> str:
        return (
            f"{self.count} shared engine(s) (ranks {self.ranks}, frontend "
            f"{self.client_index} of {self.client_count})"
        )

    def startup_hint(self) -> str:
        return (
            "Is the process that opened open_shared_engines still running, and did its "
            "engines start?"
        )


def _free_port(host: str) -> int:
    # vLLM picks its ports the same way (bind to port 0, read it back, close): the
    # address must be known before the frontend that binds it exists.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host.strip("[]"), 0))
        return int(probe.getsockname()[1])


class SharedEngines:
    """The parent's handle on shared engines (from `open_shared_engines`)."""

    def __init__(self, attachment: EngineAttachment, processes: list[EngineProcess]) -> None:
        self.attachment = attachment
        self._processes = processes
        self._dead: EngineDeadError | None = None
        self._died = anyio.Event()

    @property
    def engine_pids(self) -> dict[int, int]:
        """Rank -> pid of each engine process this parent spawned."""
        return {rank: p.pid for p in self._processes for rank in p.ranks}

    @property
    def dead(self) -> bool:
        """True once a spawned engine process exited."""
        return self._dead is not None

    async def wait_dead(self) -> EngineDeadError:
        """Wait until a spawned engine exits; returns the error describing it.

        Engines started elsewhere (`ExternalEngines`) are not watched here: the
        frontends notice their dropped connections. Cancellation: nothing changes.
        """
        await self._died.wait()
        assert self._dead is not None
        return self._dead

    def engine_exited(self, process: EngineProcess) -> None:
        """Record a spawned engine's exit (called by `open_shared_engines`)."""
        if self._dead is None:
            self._dead = EngineDeadError(process.describe_exit())
            self._died.set()


@contextlib.asynccontextmanager
async def open_shared_engines(
    engines: EngineSource | Sequence[EngineSource],
    *,
    clients: int,
    ready_timeout: float | None = None,
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE,
    on_progress: Callable[[StartupProgress], None] | None = None,
) -> AsyncIterator[SharedEngines]:
    """Start (or wait for) engines that ``clients`` frontend processes will share.

    Does the handshake (the engines are told one input and one output address per
    frontend) and yields once every engine sent READY; frontends attach with
    ``open_client(shared.attachment.client(k))`` in their own processes, before or
    after this returns. Their ready responses queue until they bind.

    Raises ``ValueError`` for a bad argument and `EngineStartupError` as `open_client`
    does (an engine exited, the handshake failed, or ``ready_timeout`` passed).

    On exit, by return, exception or cancellation: spawned engines get SIGTERM,
    ``shutdown_grace`` seconds, then SIGKILL and are reaped; sockets are closed and
    the ipc directory is removed. Stop the frontends first: once the engines are gone
    each of them is dead.
    """
    count = integer("open_shared_engines(clients=...)", clients, minimum=1, maximum=_MAX_CLIENTS)
    sources = check_sources(engines)
    if any(isinstance(s, AttachedEngines) for s in sources):
        raise ValueError("open_shared_engines: engines cannot be AttachedEngines")
    timeout = default_ready_timeout() if ready_timeout is None else float(ready_timeout)
    source_set = SourceSet(sources)
    sockets = Sockets(watch_disconnects=False)
    processes: list[EngineProcess] = []
    body_error: BaseException | None = None
    try:
        parts: list[ClientHandshake] = []
        binds: list[str] = []
        outs: list[str] = []
        first_key: tuple[str | None, str | None] = (None, None)
        first_in: list[str] = []
        first_out: list[str] = []
        for index, (source, layout) in enumerate(
            zip(source_set.sources, source_set.layouts, strict=True)
        ):
            advertised_in: list[str] = []
            advertised_out: list[str] = []
            key = (layout.data_host, layout.data_bind_host)
            if index > 0:
                # Every source's engines connect to the same N pairs (bound once, by
                # the frontends): the layouts must agree on where those are.
                if key != first_key:
                    raise ValueError(
                        "open_shared_engines: several engine sources must share one socket "
                        "layout (pass sources of one kind)"
                    )
                advertised_in, advertised_out = first_in, first_out
            for k in range(count if index == 0 else 0):
                if layout.data_host is None:
                    bind_in = sockets.ipc_dir.endpoint(f"input{k}-{index}")
                    bind_out = sockets.ipc_dir.endpoint(f"output{k}-{index}")
                    adv_in, adv_out = bind_in, bind_out
                else:
                    host = layout.data_bind_host or layout.data_host
                    in_port, out_port = _free_port(host), _free_port(host)
                    bind_in, bind_out = tcp_endpoint(host, in_port), tcp_endpoint(host, out_port)
                    adv_in = tcp_endpoint(layout.data_host, in_port)
                    adv_out = tcp_endpoint(layout.data_host, out_port)
                advertised_in.append(adv_in)
                advertised_out.append(adv_out)
                if index == 0:
                    binds.append(bind_in)
                    outs.append(bind_out)
            if index == 0:
                first_key, first_in, first_out = key, advertised_in, advertised_out
            parts.append(
                ClientHandshake(
                    source.ranks,
                    inputs=advertised_in,
                    outputs=advertised_out,
                    expect_local=layout.expect_local,
                    expect_headless=layout.expect_headless,
                    stage="handshake",
                )
            )
        attachment = EngineAttachment(tuple(source_set.ranks), tuple(binds), tuple(outs))
        shared = SharedEngines(attachment, processes)
        run = HandshakeRun(parts, on_progress)

        def exited(process: EngineProcess) -> None:
            if not run.process_exited(process):
                shared.engine_exited(process)

        async with anyio.create_task_group() as tg:
            try:
                handshake_socket = sockets.handshake_socket()
                addresses = sockets.bind_handshakes(handshake_socket, source_set.layouts)
                try:
                    await start_engines(
                        run,
                        source_set,
                        handshake_socket,
                        addresses,
                        processes=processes,
                        task_group=tg,
                        on_exit=exited,
                        input_socket=None,
                        ready_timeout=timeout,
                    )
                finally:
                    handshake_socket.close()
                for process in processes:  # one may have exited since READY
                    if process.exited.is_set():
                        shared.engine_exited(process)
                try:
                    yield shared
                except BaseException as exc:  # re-raised below, never in a group
                    body_error = exc
            finally:
                await stop_processes(processes, shutdown_grace)
                tg.cancel_scope.cancel()
    finally:
        sockets.close()
    if body_error is not None:
        raise body_error
