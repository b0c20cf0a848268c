"""A scripted engine peer on real sockets, in the test's own process and event loop.

:class:`PeerEngines` is an engine source that spawns nothing: ``open_client`` binds its
sockets as for a reference engine, and a :class:`Peer` task connects to them and does
the headless handshake of PROTOCOL.md §2.3 byte for byte (HELLO, init metadata, ready
response on the input socket, READY). After that the peer records every message that
reaches the engine side (decoded with the engine codec, the raw frames kept too) and
sends whatever the test tells it to on its PUSH output socket: valid outputs, or any
bytes at all (the fuzzer's frames). It replies to utility calls (``echo`` returns its
arguments, any other method fails as in vLLM) unless told not to.

Used where the reference engine cannot help: to send arbitrary frames (fuzzing), and to
see on the engine side exactly what arrived (bad caller input must send nothing).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import anyio
import zmq

from trio_vllm import (
    EngineCodec,
    EngineCoreClient,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    ReferenceEngines,
    UtilityOutput,
    UtilityResult,
    open_client,
    profile_for_version,
)
from trio_vllm.protocol import (
    UtilityCall,
    decode_handshake_metadata,
    encode_hello,
    encode_ready,
    encode_ready_response,
)
from trio_vllm.protocol.structs import HandshakeReady
from trio_vllm.transport import AsyncSocket

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from trio_vllm import EngineSource
    from trio_vllm.client._process import EngineProcess


class PeerEngines(ReferenceEngines):
    """An engine source for ``count`` in-process :class:`Peer` s (nothing is spawned),
    data-parallel ranks from ``start_rank``."""

    def __init__(self, count: int = 1, *, start_rank: int = 0) -> None:
        super().__init__(count, model="echo", start_rank=start_rank)
        self.handshake_address: str | None = None
        self.address_known = anyio.Event()

    async def spawn(self, handshake_address: str) -> list[EngineProcess]:
        self.handshake_address = handshake_address
        self.address_known.set()
        return []

    def describe(self) -> str:
        return f"{self.count} in-process peer engine(s)"


class Peer:
    """The engine side of one connection; see the module documentation."""

    def __init__(
        self, *, rank: int = 0, vllm_version: str = "0.32.0", max_model_len: int = 256
    ) -> None:
        self.rank = rank
        self.vllm_version = vllm_version
        self.max_model_len = max_model_len
        self.profile = profile_for_version(vllm_version)
        self.codec = EngineCodec(self.profile)
        self.identity = rank.to_bytes(2, "little")
        self.context: zmq.Context[Any] = zmq.Context()
        self.input: AsyncSocket | None = None
        self.output: AsyncSocket | None = None
        self.output_options: dict[int, int | bytes | str] = {}
        self.ready = anyio.Event()
        self.received: list[Any] = []  # decoded input messages, in arrival order
        self.undecodable: list[list[bytes]] = []
        self.reply_utilities = True
        self.arrived = anyio.Event()  # set on every arrival (replaced after each wait)

    def close(self) -> None:
        if self.output is not None:
            self.output.close(linger=0)
        self.context.term()

    # -- sending ------------------------------------------------------------------------

    def encode(self, outputs: Sequence[EngineCoreOutput] = (), **fields: Any) -> list[Any]:
        """The frames of one valid EngineCoreOutputs message from this engine."""
        fields.setdefault("engine_index", self.rank)
        return self.codec.encode_outputs(EngineCoreOutputs(outputs=list(outputs), **fields))

    async def send_frames(self, frames: Sequence[Any]) -> None:
        """Send one message of arbitrary frames on the output socket."""
        assert self.output is not None
        await self.output.send(list(frames))

    async def send(self, outputs: Sequence[EngineCoreOutput] = (), **fields: Any) -> None:
        await self.send_frames(self.encode(outputs, **fields))

    async def reply(self, call: UtilityCall, value: Any = None, failure: str | None = None) -> None:
        result = None if failure is not None else UtilityResult(None, value)
        await self.send(utility_output=UtilityOutput(call.call_id, failure, result))

    # -- what arrived -------------------------------------------------------------------

    def requests(self) -> list[EngineCoreRequest]:
        return [m for m in self.received if isinstance(m, EngineCoreRequest)]

    async def wait_for(self, count: int) -> list[Any]:
        """Wait until at least ``count`` messages arrived; return them all (give up
        after 5 s)."""
        with anyio.fail_after(30):
            while len(self.received) + len(self.undecodable) < count:
                self.arrived = anyio.Event()
                await self.arrived.wait()
        return list(self.received)

    # -- the engine's side of the connection ---------------------------------------------

    async def serve(self, source: Any) -> None:
        """Handshake through ``source``'s address (a :class:`PeerEngines` or anything
        with its ``handshake_address`` and ``address_known``), then `receive` until
        cancelled."""
        await source.address_known.wait()
        assert source.handshake_address is not None
        ident: dict[int, int | bytes | str] = {zmq.IDENTITY: self.identity}
        with (
            AsyncSocket.create(self.context, zmq.DEALER, options=ident, linger=2000) as hs,
            AsyncSocket.create(self.context, zmq.DEALER, options=ident, linger=0) as inp,
        ):
            self.input = inp
            self.output = AsyncSocket.create(
                self.context, zmq.PUSH, options=self.output_options, linger=0
            )
            hs.connect(source.handshake_address)
            await hs.send([encode_hello(local=False, headless=True)])
            (frame, *_) = await hs.receive()
            metadata = decode_handshake_metadata(frame)
            inp.connect(metadata.addresses.inputs[0])
            self.output.connect(metadata.addresses.outputs[0])
            await self.before_ready()
            response = EngineCoreReadyResponse(
                max_model_len=self.max_model_len, vllm_version=self.vllm_version
            )
            await inp.send([encode_ready_response(response, self.profile)])
            await hs.send([encode_ready(HandshakeReady(local=False, headless=True))])
            self.ready.set()
            await self.receive(inp)

    async def before_ready(self) -> None:
        """Runs once the init metadata arrived, before the ready response goes out."""

    async def receive(self, inp: AsyncSocket) -> None:
        """Record every input message (undecodable ones apart), answering utility
        calls unless ``reply_utilities`` is off."""
        while True:
            frames = [_bytes(f) for f in await inp.receive()]
            try:
                message = self.codec.decode_input(frames)
            except Exception:
                self.undecodable.append(frames)
            else:
                self.received.append(message)
                if self.reply_utilities and isinstance(message, UtilityCall):
                    if message.method == "echo":
                        await self.reply(message, message.args)
                    else:
                        await self.reply(
                            message,
                            failure=f"Call to {message.method} method failed: unknown method",
                        )
            self.arrived.set()


def _bytes(frame: Any) -> bytes:
    return frame if isinstance(frame, bytes) else bytes(frame.bytes)


@contextlib.asynccontextmanager
async def serving(
    peers: Sequence[Peer], source: EngineSource, where: Any = None, **client_options: Any
) -> AsyncIterator[EngineCoreClient]:
    """``open_client(source)`` with ``peers`` serving it at ``where``'s address (default:
    ``source``'s); yields the client once every peer is ready, closes the peers after.

    Exceptions from the body propagate unwrapped.
    """
    client_options.setdefault("ready_timeout", 10)
    try:
        try:
            async with anyio.create_task_group() as tg:
                for peer in peers:
                    tg.start_soon(peer.serve, source if where is None else where)
                async with open_client(source, **client_options) as client:
                    with anyio.fail_after(30):
                        for peer in peers:
                            await peer.ready.wait()
                    yield client
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
    finally:
        for peer in peers:
            peer.close()


@contextlib.asynccontextmanager
async def peer_client(
    peer: Peer | None = None, **client_options: Any
) -> AsyncIterator[tuple[EngineCoreClient, Peer]]:
    """``open_client`` connected to a :class:`Peer`; yields ``(client, peer)``.

    Exceptions from the body propagate unwrapped.
    """
    peer = peer or Peer()
    async with serving([peer], PeerEngines(), **client_options) as client:
        yield client, peer


@contextlib.asynccontextmanager
async def peers_client(
    count: int, **client_options: Any
) -> AsyncIterator[tuple[EngineCoreClient, list[Peer]]]:
    """``open_client`` connected to ``count`` peers (data-parallel ranks 0 ..)."""
    peers = [Peer(rank=rank) for rank in range(count)]
    async with serving(peers, PeerEngines(count), **client_options) as client:
        yield client, peers
