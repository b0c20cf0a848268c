"""Client side of the engine startup handshake (docs/protocol.md §2), sans-I/O.

The machine is fed ``(identity, payload)`` pairs as they arrive on the two
sockets that take part in startup and answers with a list of events; it never
touches a socket, a clock or a task:

* `ClientHandshake.receive_handshake` for messages on the handshake ROUTER
  (``HELLO``, ``READY``). A ``HELLO`` yields `SendInitMetadata`, the one
  reply the caller must send back to that identity.
* `ClientHandshake.receive_input` for messages on the input ROUTER during
  startup (the EngineCoreReadyResponse, one per engine).

Rules of this file:

* Per rank the states are ``WAIT_HELLO -> WAIT_READY -> READY``; the ready
  response on the input socket may arrive before or after ``READY`` (the engine
  sends it first, but on another socket), never before ``HELLO`` (the engine only
  learns the input address from our reply).
* Every error of docs/protocol.md §2.4 (unexpected rank, local/headless mismatch, a
  message in the wrong state, undecodable payloads, engines disagreeing on
  ``parallel_config_hash`` or ``vllm_version``) raises `ProtocolError` and
  moves the machine to ``ERROR``; any later use raises again. The caller turns that
  into an `EngineStartupError`.
* Timeouts belong to the caller; `ClientHandshake.describe_waiting` says what
  is still missing, for its error message.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from .._exceptions import ProtocolError
from .codec import encode_handshake_metadata
from .structs import EngineHandshakeMetadata, EngineZmqAddresses

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = [
    "ClientHandshake",
    "EngineHello",
    "EngineReady",
    "HandshakeComplete",
    "HandshakeEvent",
    "HandshakeState",
    "RankState",
    "ReadyResponseReceived",
    "SendInitMetadata",
    "encode_init_metadata",
    "identity_for_rank",
    "rank_for_identity",
]


def identity_for_rank(rank: int) -> bytes:
    """The ZMQ routing id of an engine: its data-parallel rank, 2 bytes little-endian."""
    if not 0 <= rank < 1 << 16:
        raise ValueError(f"data-parallel rank {rank} does not fit a 2-byte identity")
    return rank.to_bytes(2, "little")


def rank_for_identity(identity: bytes) -> int:
    """Inverse of `identity_for_rank`; `ProtocolError` for anything else."""
    if len(identity) != 2:
        raise ProtocolError(
            f"unexpected routing identity {identity.hex() or '(empty)'}: "
            "an engine's identity is its rank as 2 little-endian bytes"
        )
    return int.from_bytes(identity, "little")


def encode_init_metadata(
    *,
    inputs: Sequence[str],
    outputs: Sequence[str],
    coordinator_input: str | None = None,
    coordinator_output: str | None = None,
    frontend_stats_publish_address: str | None = None,
    parallel_config: Mapping[str, int | str | list[int]] | None = None,
) -> bytes:
    """EngineHandshakeMetadata, the reply to HELLO, byte-identical to vLLM's (§2.1)."""
    if not inputs or len(inputs) != len(outputs):
        raise ValueError("inputs and outputs must be non-empty and of the same length")
    for address in (*inputs, *outputs):
        if "0.0.0.0" in address or "://*" in address:
            raise ValueError(f"never advertise a wildcard address to engines: {address!r}")
    # One encoder for the wire format: the codec's (same field order as vLLM's structs).
    metadata = EngineHandshakeMetadata(
        addresses=EngineZmqAddresses(
            inputs=list(inputs),
            outputs=list(outputs),
            coordinator_input=coordinator_input,
            coordinator_output=coordinator_output,
            frontend_stats_publish_address=frontend_stats_publish_address,
        ),
        parallel_config=dict(parallel_config or {}),
    )
    return encode_handshake_metadata(metadata)


class HandshakeState(enum.Enum):
    """Overall state: waiting for engines, complete, or failed (refuses further use)."""

    WAITING = "waiting"
    COMPLETE = "complete"
    ERROR = "error"


class RankState(enum.Enum):
    """Where one engine is on the handshake socket."""

    WAIT_HELLO = "waiting for HELLO"
    WAIT_READY = "sent init metadata, waiting for READY"
    READY = "READY"


@dataclass(frozen=True, slots=True)
class SendInitMetadata:
    """Action: send ``[identity][payload]`` on the handshake ROUTER (reply to HELLO)."""

    rank: int
    identity: bytes
    payload: bytes


@dataclass(frozen=True, slots=True)
class EngineHello:
    """An engine connected and said HELLO (informational, for progress displays)."""

    rank: int
    local: bool
    headless: bool


@dataclass(frozen=True, slots=True)
class EngineReady:
    """An engine sent READY on the handshake socket."""

    rank: int
    message: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ReadyResponseReceived:
    """An engine's EngineCoreReadyResponse arrived on the input socket."""

    rank: int
    response: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class HandshakeComplete:
    """Every expected engine sent READY and its ready response; traffic may start.

    ``vllm_version`` is the version every engine reported (``None`` when the ready
    responses carry none, e.g. the legacy empty form).
    """

    ready_responses: Mapping[int, Mapping[str, Any]]
    vllm_version: str | None


HandshakeEvent = (
    SendInitMetadata | EngineHello | EngineReady | ReadyResponseReceived | HandshakeComplete
)


def _kind(*, local: bool, headless: bool) -> str:
    return "local" if local else "remote"


@dataclass(slots=True)
class _Rank:
    state: RankState = RankState.WAIT_HELLO
    local: bool | None = None
    headless: bool | None = None
    ready_response: Mapping[str, Any] | None = None
    parallel_config_hash: str | None = None


@dataclass(slots=True)
class _Config:
    init_payload: bytes
    expect_local: bool | None
    expect_headless: bool | None


class ClientHandshake:
    """The frontend's handshake with a fixed set of engine ranks (docs/protocol.md §2.2/§2.3).

    Args:
        ranks: the data-parallel ranks expected to connect (identities ``rank`` as 2
            bytes little-endian).
        inputs, outputs: the input ROUTER / output PULL addresses to advertise, one
            per frontend (index = ``client_index``); never wildcards.
        coordinator_input, coordinator_output, frontend_stats_publish_address,
            parallel_config: the remaining fields of the init metadata (§2.1).
        expect_local, expect_headless: what the engines' HELLO/READY must say; ``None``
            accepts either. Headless engines say ``local=False, headless=True``.
        stage: ``"both"`` (one frontend: complete once every rank sent READY *and*
            its ready response), ``"handshake"`` (the parent of several frontends:
            complete on READY alone, since each ready response goes to the input
            socket of every frontend, not to the parent) or ``"input"`` (one of
            several frontends: another process did the handshake; complete once
            every rank's ready response arrived here; `receive_handshake` refuses).
    """

    def __init__(
        self,
        ranks: Sequence[int],
        *,
        inputs: Sequence[str],
        outputs: Sequence[str],
        coordinator_input: str | None = None,
        coordinator_output: str | None = None,
        frontend_stats_publish_address: str | None = None,
        parallel_config: Mapping[str, int | str | list[int]] | None = None,
        expect_local: bool | None = None,
        expect_headless: bool | None = None,
        stage: Literal["both", "handshake", "input"] = "both",
    ) -> None:
        if stage not in ("both", "handshake", "input"):
            raise ValueError(f"stage must be 'both', 'handshake' or 'input', got {stage!r}")
        if not ranks:
            raise ValueError("expected at least one engine rank")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"duplicate ranks in {list(ranks)}")
        for rank in ranks:
            identity_for_rank(rank)  # validates the range
        self.stage = stage
        # Attached (stage "input"): the handshake socket is someone else's; every rank
        # is as good as READY there.
        first = RankState.READY if stage == "input" else RankState.WAIT_HELLO
        self._ranks: dict[int, _Rank] = {rank: _Rank(state=first) for rank in sorted(ranks)}
        self._config = _Config(
            init_payload=encode_init_metadata(
                inputs=inputs,
                outputs=outputs,
                coordinator_input=coordinator_input,
                coordinator_output=coordinator_output,
                frontend_stats_publish_address=frontend_stats_publish_address,
                parallel_config=parallel_config,
            ),
            expect_local=expect_local,
            expect_headless=expect_headless,
        )
        self.state = HandshakeState.WAITING
        self._error: ProtocolError | None = None
        self.vllm_version: str | None = None
        self._version_rank: int | None = None

    # -- queries ---------------------------------------------------------------------

    @property
    def ranks(self) -> list[int]:
        """The expected ranks, ascending."""
        return list(self._ranks)

    def rank_state(self, rank: int) -> RankState:
        """Handshake-socket state of one rank."""
        return self._ranks[rank].state

    @property
    def connected(self) -> list[int]:
        """Ranks that said HELLO."""
        return [r for r, s in self._ranks.items() if s.state is not RankState.WAIT_HELLO]

    @property
    def ready(self) -> list[int]:
        """Ranks that sent READY on the handshake socket."""
        return [r for r, s in self._ranks.items() if s.state is RankState.READY]

    @property
    def responded(self) -> list[int]:
        """Ranks whose ready response arrived on the input socket."""
        return [r for r, s in self._ranks.items() if s.ready_response is not None]

    @property
    def handshake_socket_done(self) -> bool:
        """True once every rank sent READY: the handshake socket may be closed."""
        return all(s.state is RankState.READY for s in self._ranks.values())

    def describe_waiting(self) -> str:
        """What is still missing, in words (for timeout messages)."""
        parts: list[str] = []
        no_hello = [r for r, s in self._ranks.items() if s.state is RankState.WAIT_HELLO]
        no_ready = [r for r, s in self._ranks.items() if s.state is RankState.WAIT_READY]
        no_response = [
            r
            for r, s in self._ranks.items()
            if s.state is not RankState.WAIT_HELLO
            and s.ready_response is None
            and self.stage != "handshake"
        ]
        if no_hello:
            parts.append(f"no HELLO yet from rank(s) {no_hello} (engine not connected)")
        if no_ready:
            parts.append(f"no READY yet from rank(s) {no_ready} (engine still loading)")
        if no_response:
            parts.append(f"no ready response on the input socket yet from rank(s) {no_response}")
        return "; ".join(parts) if parts else "nothing (handshake complete)"

    # -- events ----------------------------------------------------------------------

    def receive_handshake(self, identity: bytes, payload: bytes) -> list[HandshakeEvent]:
        """Feed one ``[identity][payload]`` message from the handshake ROUTER.

        Returns the events it caused; a `SendInitMetadata` among them must be
        sent. Raises `ProtocolError` (and enters ``ERROR``) on any violation.
        """
        self._check_usable()
        try:
            if self.stage == "input":
                raise ProtocolError(
                    "handshake message on an attached client (the engines' handshake "
                    "is done by the process that shares them)"
                )
            return self._receive_handshake(identity, payload)
        except ProtocolError as exc:
            self._fail(exc)
            raise

    def receive_input(self, identity: bytes, payload: bytes) -> list[HandshakeEvent]:
        """Feed one ``[identity][payload]`` message from the input ROUTER during startup."""
        self._check_usable()
        try:
            if self.stage == "handshake":
                raise ProtocolError(
                    "input message on a handshake-only client (the ready responses go "
                    "to the frontends that share the engines)"
                )
            return self._receive_input(identity, payload)
        except ProtocolError as exc:
            self._fail(exc)
            raise

    # -- internals -------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self.state is HandshakeState.ERROR:
            raise ProtocolError(f"handshake already failed: {self._error}")
        if self.state is HandshakeState.COMPLETE:
            raise ProtocolError("handshake already complete; no further startup messages expected")

    def _fail(self, exc: ProtocolError) -> None:
        self.state = HandshakeState.ERROR
        self._error = exc

    def _lookup(self, identity: bytes) -> tuple[int, _Rank]:
        rank = rank_for_identity(identity)
        entry = self._ranks.get(rank)
        if entry is None:
            raise ProtocolError(
                f"Message from engine with unexpected data parallel rank: {rank} "
                f"(expected ranks {list(self._ranks)})"
            )
        return rank, entry

    def _receive_handshake(self, identity: bytes, payload: bytes) -> list[HandshakeEvent]:
        rank, entry = self._lookup(identity)
        message = _decode_map(payload, f"handshake message from engine {rank}")
        status = message.get("status")
        local = message.get("local")
        headless = message.get("headless")
        if not isinstance(status, str) or not isinstance(local, bool):
            raise ProtocolError(
                f"malformed handshake message from engine {rank}: expected "
                f"{{status: str, local: bool, headless: bool}}, got {message!r}"
            )
        if not isinstance(headless, bool):
            # Very old engines omit "headless"; only local engines did that.
            headless = False
        self._check_kind(rank, status, local=local, headless=headless)
        if status == "HELLO":
            if entry.state is not RankState.WAIT_HELLO:
                raise ProtocolError(
                    f"Unexpected HELLO message for {_kind(local=local, headless=headless)} "
                    f"engine {rank} in {entry.state.name} state."
                )
            entry.state = RankState.WAIT_READY
            entry.local, entry.headless = local, headless
            return [
                EngineHello(rank, local, headless),
                SendInitMetadata(rank, identity_for_rank(rank), self._config.init_payload),
            ]
        if status == "READY":
            if entry.state is not RankState.WAIT_READY:
                raise ProtocolError(
                    f"Unexpected READY message for {_kind(local=local, headless=headless)} "
                    f"engine {rank} in {entry.state.name} state."
                )
            if (local, headless) != (entry.local, entry.headless):
                raise ProtocolError(
                    f"Configuration mismatch detected for engine {rank}: HELLO said "
                    f"local={entry.local}, headless={entry.headless}; READY says "
                    f"local={local}, headless={headless}"
                )
            config_hash = message.get("parallel_config_hash")
            if config_hash is not None:
                if not isinstance(config_hash, str):
                    raise ProtocolError(
                        f"malformed READY from engine {rank}: parallel_config_hash "
                        f"{config_hash!r} is not a string"
                    )
                for other_rank, other in self._ranks.items():
                    other_hash = other.parallel_config_hash
                    if other_hash is not None and other_hash != config_hash:
                        raise ProtocolError(
                            f"Configuration mismatch detected for engine {rank}: "
                            f"parallel_config_hash {config_hash!r} differs from engine "
                            f"{other_rank}'s {other_hash!r}; all engines must be started "
                            "with the same parallel configuration"
                        )
                entry.parallel_config_hash = config_hash
            entry.state = RankState.READY
            events: list[HandshakeEvent] = [EngineReady(rank, message)]
            events.extend(self._maybe_complete())
            return events
        raise ProtocolError(
            f"unexpected handshake status {status!r} from engine {rank} in "
            f"{entry.state.name} state (expected HELLO or READY)"
        )

    def _check_kind(self, rank: int, status: str, *, local: bool, headless: bool) -> None:
        expect_local = self._config.expect_local
        expect_headless = self._config.expect_headless
        if expect_local is not None and local != expect_local:
            want = "local" if expect_local else "remote"
            raise ProtocolError(
                f"{status} message from {_kind(local=local, headless=headless)} engine "
                f"{rank}, expected it to be {want}"
            )
        if expect_headless is not None and headless != expect_headless:
            must = "must" if expect_headless else "must not"
            raise ProtocolError(
                f"Remote engine {rank} {must} use --headless (its {status} "
                f"said headless={headless})"
            )

    def _receive_input(self, identity: bytes, payload: bytes) -> list[HandshakeEvent]:
        rank, entry = self._lookup(identity)
        if entry.state is RankState.WAIT_HELLO:
            raise ProtocolError(
                f"ready response from engine {rank} on the input socket before its HELLO"
            )
        if entry.ready_response is not None:
            raise ProtocolError(
                f"second message from engine {rank} on the input socket during startup "
                "(an engine sends exactly one ready response)"
            )
        # An empty frame is the legacy "ready, no metadata" form (§2.1).
        response = (
            {} if payload == b"" else _decode_map(payload, f"ready response of engine {rank}")
        )
        reported_rank = response.get("data_parallel_rank")
        if reported_rank is not None and reported_rank != rank:
            raise ProtocolError(
                f"ready response from identity {identity.hex()} (rank {rank}) reports "
                f"data_parallel_rank {reported_rank!r}"
            )
        version = response.get("vllm_version")
        if version is not None:
            if not isinstance(version, str):
                raise ProtocolError(f"ready response of engine {rank}: vllm_version {version!r}")
            if self.vllm_version is None:
                self.vllm_version, self._version_rank = version, rank
            elif version != self.vllm_version:
                raise ProtocolError(
                    f"engines run different vLLM versions: engine {self._version_rank} "
                    f"reports {self.vllm_version}, engine {rank} reports {version}; all "
                    "engines behind one client must run the same version"
                )
        entry.ready_response = response
        events: list[HandshakeEvent] = [ReadyResponseReceived(rank, response)]
        events.extend(self._maybe_complete())
        return events

    def _maybe_complete(self) -> list[HandshakeEvent]:
        need_response = self.stage != "handshake"
        if not all(
            s.state is RankState.READY and (s.ready_response is not None or not need_response)
            for s in self._ranks.values()
        ):
            return []
        self.state = HandshakeState.COMPLETE
        responses = {
            r: s.ready_response for r, s in self._ranks.items() if s.ready_response is not None
        }
        return [HandshakeComplete(responses, self.vllm_version)]


def _decode_map(payload: bytes, what: str) -> dict[str, Any]:
    try:
        value = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ProtocolError(
            f"cannot decode {what} ({len(payload)} bytes, starts {payload[:16].hex()}): {exc}"
        ) from exc
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ProtocolError(f"{what} is not a map with string keys: {value!r}"[:300])
    return value
