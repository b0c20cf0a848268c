"""Where engines come from: the bundled reference engine, stock vLLM, or elsewhere.

An engine source tells `open_client` three things: which ranks to
expect, how to lay out the sockets (ipc in a private directory, or TCP on a host),
and how to start the processes once the handshake socket is bound. The client owns
everything else (binding, the handshake, watching and stopping the processes).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ._args import (
    RANK_LIMIT,
    argument_list,
    choice,
    environment,
    integer,
    path,
    ready_timeout,
    text,
    type_name,
)
from ._process import EngineProcess, spawn_engine_process

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "EngineSource",
    "ExternalEngines",
    "ReferenceEngines",
    "VllmEngines",
    "check_add_engines",
    "check_source",
    "check_sources",
]

_HEADLESS_ENTRY_POINT = Path(__file__).with_name("_vllm_headless.py")


@dataclass(frozen=True, slots=True)
class SocketLayout:
    """How the client binds its sockets for a source.

    ``handshake_bind``: where to bind the handshake ROUTER; ``None`` means an ipc path
    in the client's private directory. ``data_host``: ``None`` binds input/output on
    ipc; otherwise TCP, bound at ``data_bind_host`` port 0 and advertised with
    ``data_host``. ``watch_disconnects``: treat a dropped engine connection on the
    input socket as the engine's death (for engines whose process the client cannot
    watch).
    """

    handshake_bind: str | None
    data_host: str | None
    data_bind_host: str | None
    expect_local: bool | None
    expect_headless: bool | None
    watch_disconnects: bool = False
    attach: tuple[str, str] | None = None


class EngineSource:
    """Base class of the engine sources; see the subclasses.

    ``count`` engines with the consecutive data-parallel ranks ``start_rank`` upward.
    """

    count: int
    start_rank: int
    # Which of the engines' frontends this client is (several only when attached to
    # shared engines, `AttachedEngines`): stamped into every request and utility call.
    client_index: int = 0
    client_count: int = 1

    def __init__(self, count: int, start_rank: int) -> None:
        kind = type(self).__name__
        self.count = integer(f"{kind}(count=...)", count, minimum=1, maximum=RANK_LIMIT)
        self.start_rank = integer(
            f"{kind}(start_rank=...)", start_rank, minimum=0, maximum=RANK_LIMIT - 1
        )

    @property
    def ranks(self) -> list[int]:
        """The data-parallel ranks (= routing identities) of the engines."""
        return list(range(self.start_rank, self.start_rank + self.count))

    def layout(self) -> SocketLayout:  # pragma: no cover - abstract
        raise NotImplementedError

    async def spawn(self, handshake_address: str) -> list[EngineProcess]:
        """Start the engine processes; they connect to ``handshake_address``.

        Returns the spawned processes (none for external engines). If starting a
        later one fails, the earlier ones are stopped before the error propagates.
        """
        return []

    def describe(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def startup_hint(self) -> str:
        """A sentence on what to try when startup times out."""
        return "Raise ready_timeout if the engines are just slow to load."


async def _spawn_all(
    commands: Sequence[tuple[str, Sequence[int], Sequence[str]]],
    env: Mapping[str, str] | None,
) -> list[EngineProcess]:
    processes: list[EngineProcess] = []
    try:
        for name, ranks, command in commands:
            processes.append(await spawn_engine_process(command, name=name, ranks=ranks, env=env))
    except BaseException:
        for process in processes:
            await process.stop(grace=0)
        raise
    return processes


class ReferenceEngines(EngineSource):
    """Spawn the bundled reference engine (``python -m trio_vllm.reference_engine``).

    A real engine-core process that speaks the protocol over real sockets, one
    process per rank, doing the headless handshake.

    Args:
        count: number of engines (ranks ``start_rank`` ...).
        model: reference model name (``"echo"`` or ``"tiny"``).
        device: torch device for models that use torch (``"cpu"``, ``"cuda"``).
        faults: extra fault-injection arguments passed verbatim (see
            ``python -m trio_vllm.reference_engine --help``).
        protocol: vLLM version whose wire layout the engine speaks (``None``: default).
        extra_args: more command-line arguments, verbatim.
        python: the interpreter to run it with (default: this one).
        env: environment variables added for the engine processes.
        transport: ``"ipc"`` (default) or ``"tcp"`` (loopback) for all sockets.
    """

    def __init__(
        self,
        count: int = 1,
        *,
        model: str = "echo",
        device: str | None = None,
        faults: Sequence[str] = (),
        protocol: str | None = None,
        extra_args: Sequence[str] = (),
        python: str | None = None,
        env: Mapping[str, str] | None = None,
        transport: Literal["ipc", "tcp"] = "ipc",
        start_rank: int = 0,
    ) -> None:
        super().__init__(count, start_rank)
        self.model = model
        self.device = device
        self.faults = argument_list("ReferenceEngines(faults=...)", faults)
        self.protocol = protocol
        self.extra_args = argument_list("ReferenceEngines(extra_args=...)", extra_args)
        self.python = sys.executable if python is None else python
        self.env = environment("ReferenceEngines(env=...)", env)
        self.transport = transport
        check_source(self)

    def layout(self) -> SocketLayout:
        if self.transport == "tcp":
            return SocketLayout("tcp://127.0.0.1:0", "127.0.0.1", "127.0.0.1", False, True)
        return SocketLayout(None, None, None, False, True)

    def command(self, handshake_address: str, rank: int) -> list[str]:
        """The command line that starts the engine of ``rank``."""
        cmd = [
            self.python,
            "-m",
            "trio_vllm.reference_engine",
            "--handshake-address",
            handshake_address,
            "--index",
            str(rank),
            "--model",
            self.model,
            # The engine runs in its own session; without this it would outlive a
            # client process that is killed outright.
            "--parent-pid",
            str(os.getpid()),
        ]
        if self.device is not None:
            cmd += ["--device", self.device]
        if self.protocol is not None:
            cmd += ["--protocol", self.protocol]
        return cmd + self.faults + self.extra_args

    async def spawn(self, handshake_address: str) -> list[EngineProcess]:
        return await _spawn_all(
            [
                (f"reference engine {rank}", [rank], self.command(handshake_address, rank))
                for rank in self.ranks
            ],
            self.env,
        )

    def describe(self) -> str:
        return f"{self.count} reference engine(s) (model {self.model!r}, ranks {self.ranks})"


class VllmEngines(EngineSource):
    """Spawn stock vLLM engine cores in headless mode with another python.

    Runs ``PYTHON <bundled entry point> --model MODEL --data-parallel-address 127.0.0.1
    --data-parallel-rpc-port PORT [extra_args]``, the code path of ``vllm serve MODEL
    --headless``. The given python needs vLLM; this process does not.

    Args:
        model: model path or name, as for ``vllm serve``.
        python: an interpreter with vLLM installed.
        extra_args: more ``vllm serve`` arguments (``--dtype``, ``--max-model-len``, ...).
        count: engines to start (one launcher with ``--data-parallel-size-local``).
        env: environment added for the launcher (e.g. ``VLLM_CPU_KVCACHE_SPACE``).
    """

    def __init__(
        self,
        model: str,
        *,
        python: str,
        extra_args: Sequence[str] = (),
        count: int = 1,
        start_rank: int = 0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(count, start_rank)
        self.model = model
        self.python = python
        self.extra_args = argument_list("VllmEngines(extra_args=...)", extra_args)
        self.env = environment("VllmEngines(env=...)", env)
        check_source(self)

    def layout(self) -> SocketLayout:
        # Headless engines always reach the handshake over TCP (§2.3).
        return SocketLayout("tcp://127.0.0.1:0", "127.0.0.1", "127.0.0.1", False, True)

    def command(self, handshake_address: str) -> list[str]:
        """The launcher's command line for a handshake ``tcp://HOST:PORT``."""
        host, port = _split_tcp(handshake_address)
        cmd = [
            self.python,
            str(_HEADLESS_ENTRY_POINT),
            "--model",
            self.model,
            "--data-parallel-address",
            host,
            "--data-parallel-rpc-port",
            str(port),
        ]
        if self.count > 1 or self.start_rank > 0:
            cmd += [
                "--data-parallel-size",
                str(self.start_rank + self.count),
                "--data-parallel-size-local",
                str(self.count),
                "--data-parallel-start-rank",
                str(self.start_rank),
            ]
        return cmd + self.extra_args

    async def spawn(self, handshake_address: str) -> list[EngineProcess]:
        name = f"vLLM headless launcher ({self.python})"
        return await _spawn_all([(name, self.ranks, self.command(handshake_address))], self.env)

    def describe(self) -> str:
        return f"{self.count} vLLM engine(s) for {self.model!r} (python {self.python})"

    def startup_hint(self) -> str:
        return (
            "vLLM can take minutes to load and compile; raise ready_timeout, and check "
            "that the python has vLLM and the model path exists."
        )


class ExternalEngines(EngineSource):
    """Wait for engines started elsewhere (e.g. on other hosts).

    Binds ``handshake_address`` (``tcp://HOST:PORT``) and waits for ``count`` engines
    started with ``vllm serve MODEL --headless --data-parallel-address HOST
    --data-parallel-rpc-port PORT`` (plus ``--data-parallel-start-rank`` for ranks
    other than 0). Input and output sockets are bound on ``bind_host`` (default: the
    handshake host) at kernel-chosen ports and advertised as ``advertise_host``
    (default: the handshake host; required when that is a wildcard); engines must be
    able to reach them. Nothing is spawned, so nothing is stopped at exit. An engine
    that dies is noticed through ``ENGINE_CORE_DEAD`` or when its connection to the
    input socket drops (process exit, closed socket); a host that vanishes without
    closing its connections is only noticed by the deadlines of your calls.
    """

    def __init__(
        self,
        handshake_address: str,
        count: int = 1,
        *,
        start_rank: int = 0,
        advertise_host: str | None = None,
        bind_host: str | None = None,
    ) -> None:
        super().__init__(count, start_rank)
        self.handshake_address = handshake_address
        self.advertise_host = advertise_host
        self.bind_host = bind_host
        check_source(self)
        self._host, self._port = _split_tcp(handshake_address)

    def layout(self) -> SocketLayout:
        wildcard = self._host in ("*", "0.0.0.0", "::", "[::]")
        advertise = self.advertise_host or (None if wildcard else self._host)
        if advertise is None:
            raise ValueError(
                f"handshake address {self.handshake_address} is a wildcard: pass "
                "advertise_host, the address engines use to reach this machine"
            )
        bind = self.bind_host or (self._host if wildcard else advertise)
        return SocketLayout(
            self.handshake_address, advertise, bind, False, True, watch_disconnects=True
        )

    def describe(self) -> str:
        return f"{self.count} external engine(s) at {self.handshake_address} (ranks {self.ranks})"

    def startup_hint(self) -> str:
        return (
            f"Start each engine with `vllm serve MODEL --headless --data-parallel-address "
            f"{self._host} --data-parallel-rpc-port {self._port}` "
            "(and --data-parallel-start-rank for other ranks), or raise ready_timeout."
        )


def _split_tcp(address: str) -> tuple[str, int]:
    if not address.startswith("tcp://"):
        raise ValueError(f"expected a tcp://HOST:PORT address, got {address!r}")
    rest = address[len("tcp://") :]
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected a tcp://HOST:PORT address, got {address!r}")
    return host.strip("[]") if host.startswith("[") else host, int(port)


# ---- argument checks (the helpers are in _args.py) ------------------------------


def _reference_choices() -> dict[str, Sequence[str]]:
    # The reference engine's own parser is the authority on its choices (it imports
    # neither torch nor zmq), so a new model or protocol needs no change here.
    from ..reference_engine._options import build_parser

    parser = build_parser()
    choices: dict[str, Sequence[str]] = {}
    for action in parser._actions:
        for option in ("--model", "--device", "--protocol"):
            if option in action.option_strings and action.choices is not None:
                choices[option[2:]] = [str(c) for c in action.choices]
    return choices


def check_source(source: object, name: str = "engines") -> None:
    """Check an engine source's type and every one of its arguments."""
    if not isinstance(source, EngineSource):
        raise TypeError(
            f"{name} must be an engine source (ReferenceEngines, VllmEngines, "
            f"ExternalEngines) or a list of them, got {type_name(source)}"
        )
    kind = type(source).__name__
    count = integer(f"{kind}(count=...)", source.count, minimum=1, maximum=RANK_LIMIT)
    start = integer(f"{kind}(start_rank=...)", source.start_rank, minimum=0, maximum=RANK_LIMIT - 1)
    if start + count > RANK_LIMIT:
        raise ValueError(
            f"{kind}: ranks {start}..{start + count - 1} do not fit a 2-byte identity "
            f"(at most {RANK_LIMIT - 1})"
        )
    if isinstance(source, ReferenceEngines):
        choices = _reference_choices()
        choice(f"{kind}(model=...)", source.model, choices.get("model", ()))
        choice(f"{kind}(device=...)", source.device, choices.get("device", ()), optional=True)
        choice(f"{kind}(protocol=...)", source.protocol, choices.get("protocol", ()), optional=True)
        argument_list(f"{kind}(faults=...)", source.faults)
        argument_list(f"{kind}(extra_args=...)", source.extra_args)
        path(f"{kind}(python=...)", source.python)
        environment(f"{kind}(env=...)", source.env)
        choice(f"{kind}(transport=...)", source.transport, ("ipc", "tcp"))
    elif isinstance(source, VllmEngines):
        path(f"{kind}(model=...)", source.model)
        path(f"{kind}(python=...)", source.python)
        argument_list(f"{kind}(extra_args=...)", source.extra_args)
        environment(f"{kind}(env=...)", source.env)
    elif isinstance(source, ExternalEngines):
        _tcp_address(f"{kind}(handshake_address=...)", source.handshake_address)
        text(f"{kind}(advertise_host=...)", source.advertise_host, optional=True)
        text(f"{kind}(bind_host=...)", source.bind_host, optional=True)


def _tcp_address(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a 'tcp://HOST:PORT' str, got {value!r}")
    host, sep, port = value.removeprefix("tcp://").rpartition(":")
    if not value.startswith("tcp://") or not sep or not host or not port.isdigit():
        raise ValueError(f"{name} must be 'tcp://HOST:PORT', got {value!r}")
    if int(port) > 65535:
        raise ValueError(f"{name}: port {port} is out of range (0-65535)")


def check_sources(engines: object) -> list[EngineSource]:
    """Check `open_client`'s ``engines``: one source or a non-empty list of them."""
    if isinstance(engines, EngineSource):
        check_source(engines)
        return [engines]
    if isinstance(engines, (str, bytes)) or not isinstance(engines, Sequence):
        check_source(engines)  # raises the TypeError naming the argument
    assert isinstance(engines, Sequence)
    if not engines:
        raise ValueError("engines must name at least one engine source, got an empty list")
    for i, source in enumerate(engines):
        check_source(source, f"engines[{i}]")
    return list(engines)


def check_add_engines(source: object, ready_timeout_s: object) -> None:
    """Check the arguments of ``add_engines``."""
    check_source(source, "source")
    ready_timeout(ready_timeout_s)
