"""Bad input from callers is refused with a clear error before anything is sent.

The engine here is a :class:`~._peer.Peer` on real sockets that records every message
reaching the engine side, so "nothing was sent" is checked where it matters: after the
refused calls, one sentinel utility call goes out, and the peer must have received
exactly the messages the test expects, the sentinel last (ZeroMQ keeps the order of one
connection, so anything sent before the sentinel has arrived by then).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import pytest

from trio_vllm import (
    EngineCoreRequest,
    EngineDeadError,
    SamplingParams,
    UtilityCallError,
    make_request,
)
from trio_vllm.protocol import UtilityCall

from ._peer import Peer, PeerEngines, peer_client, peers_client

if TYPE_CHECKING:
    from trio_vllm import EngineCoreClient

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def _sentinel(client: EngineCoreClient, peer: Peer, expected_before: int) -> None:
    """Send one utility call; the peer must have got exactly ``expected_before`` messages
    before it, and nothing undecodable."""
    with anyio.fail_after(30):
        assert await client.call_utility("echo", "sentinel") == ["sentinel"]
    received = peer.received
    assert peer.undecodable == []
    assert len(received) == expected_before + 1, received
    last = received[-1]
    assert isinstance(last, UtilityCall)
    assert last.method == "echo"
    assert last.args == ["sentinel"]


async def _start(client: EngineCoreClient, api: str, request: Any) -> None:
    """Start ``request`` with ``add_request`` or ``generate`` (leaving the block at once)."""
    if api == "add_request":
        await client.add_request(request)
    else:
        async with client.generate(request):
            pytest.fail("the request must be refused")


def _request(rid: str = "ok", **sampling: Any) -> EngineCoreRequest:
    params = {"max_tokens": 4, "temperature": 0.0, **sampling}
    return EngineCoreRequest(
        rid, prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(**params)
    )


async def test_duplicate_live_request_ids_are_refused() -> None:
    async with peer_client() as (client, peer):
        with anyio.fail_after(30):
            async with client.generate(make_request([1], request_id="dup")):
                for api in ("add_request", "generate"):
                    with pytest.raises(ValueError, match="'dup' is already live"):
                        await _start(client, api, make_request([1], request_id="dup"))
                await client.add_request(make_request([1], request_id="raw-dup"))
                with pytest.raises(ValueError, match="'raw-dup' is already live"):
                    await client.add_request(make_request([2], request_id="raw-dup"))
                with pytest.raises(ValueError, match="'raw-dup' is already live"):
                    async with client.generate(make_request([2], request_id="raw-dup")):
                        pytest.fail("a duplicate stream must not start")
                # Exactly the two first ADDs reached the engine.
                await _sentinel(client, peer, expected_before=2)
                assert [r.request_id for r in peer.requests()] == ["dup", "raw-dup"]
                assert sorted(client.live_requests) == ["dup", "raw-dup"]
            # Leaving the block aborted "dup"; the id is free again.
            await client.abort_requests(["raw-dup"])
            assert client.live_requests == []
            await client.add_request(make_request([1], request_id="dup"))
            assert client.live_requests == ["dup"]


_BAD_SAMPLING: list[tuple[str, dict[str, Any]]] = [
    ("max_tokens", {"max_tokens": None}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": -3}),
    ("temperature", {"temperature": -0.5}),
    ("temperature", {"temperature": math.nan}),
    ("top_p", {"top_p": 0.0, "temperature": 1.0}),
    ("top_p", {"top_p": 1.5, "temperature": 1.0}),
    ("top_k", {"top_k": -7, "temperature": 1.0}),
    ("min_p", {"min_p": 2.0, "temperature": 1.0}),
    ("min_tokens", {"min_tokens": 9}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("presence_penalty", {"presence_penalty": 3.0}),
    ("logprobs", {"logprobs": -5}),
    ("seed", {"seed": 2**70}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("n", {"n": 3}),
]


def _bad_requests() -> list[tuple[str, Any]]:
    cases: list[tuple[str, Any]] = [
        (field, _request(f"bad-{i}", **sampling))
        for i, (field, sampling) in enumerate(_BAD_SAMPLING)
    ]
    good = _request("shape")
    cases += [
        ("request_id", msgspec.structs.replace(good, request_id="")),
        ("prompt", msgspec.structs.replace(good, prompt_token_ids=[])),
        ("prompt", msgspec.structs.replace(good, prompt_token_ids=None)),
        ("prompt", msgspec.structs.replace(good, prompt_token_ids=list(range(300)))),
        ("prompt_token_ids", msgspec.structs.replace(good, prompt_token_ids=[1, -2])),
        ("sampling_params/pooling_params", msgspec.structs.replace(good, sampling_params=None)),
        ("client_index", msgspec.structs.replace(good, client_index=1)),
        ("arrival_time", msgspec.structs.replace(good, arrival_time=math.inf)),
        ("priority", msgspec.structs.replace(good, priority=2**80)),
        ("EngineCoreRequest", {"request_id": "a dict is not a request"}),
        ("EngineCoreRequest", None),
    ]
    return cases


@pytest.mark.parametrize("api", ["add_request", "generate"])
async def test_invalid_requests_are_refused_before_sending(api: str) -> None:
    cases = _bad_requests()
    async with peer_client() as (client, peer):
        for field, request in cases:
            with pytest.raises((ValueError, TypeError)) as info:
                await _start(client, api, request)
            message = str(info.value)
            # A clear error: it names the field (or the expected type) that is wrong, in
            # its message or (a request rule's verdict, with vLLM's message) as .field.
            named = field.split("/")[0]
            at_fault = getattr(info.value, "field", None) or ""
            assert named in message or at_fault.startswith(named), (field, message)
            assert client.live_requests == []
        await _sentinel(client, peer, expected_before=0)
        # The client still works after all that.
        await client.add_request(_request("fine"))
        assert [r.request_id for r in (await peer.wait_for(2))[1:]] == ["fine"]


async def test_bad_utility_calls_are_refused_before_sending() -> None:
    async with peer_client() as (client, peer):
        refused: list[tuple[type[Exception], Any]] = [
            (ValueError, lambda: client.call_utility("")),
            (ValueError, lambda: client.call_utility(None)),  # type: ignore[arg-type]
            (ValueError, lambda: client.call_utility(42)),  # type: ignore[arg-type]
            (ValueError, lambda: client.call_utility("echo", object())),
            (ValueError, lambda: client.call_utility("echo", rank=3)),
            (TypeError, lambda: client.abort_requests([1])),
            (TypeError, lambda: client.abort_requests(["ok", b"bytes"])),
            (ValueError, lambda: client.add_request(_request("r"), rank=5)),
        ]
        for kind, call in refused:
            with pytest.raises(kind):
                await call()
            assert client.pending_utility_calls == 0
        await _sentinel(client, peer, expected_before=0)


async def test_call_utility_all_refuses_unencodable_args_plainly() -> None:
    """call_utility_all refuses what call_utility refuses, with the same plain ValueError
    (not an exception group of one per rank), and sends nothing to any rank."""
    async with peers_client(2) as (client, peers):
        with pytest.raises(ValueError, match="cannot be encoded"):
            await client.call_utility_all("get_supported_tasks", object())
        assert client.pending_utility_calls == 0
        for rank, peer in enumerate(peers):
            with anyio.fail_after(30):
                assert await client.call_utility("echo", "sentinel", rank=rank) == ["sentinel"]
            # The sentinel is the first and only message each rank received.
            assert [m.method for m in peer.received] == ["echo"], peer.received


async def test_unknown_utility_name_fails_on_the_engine_only() -> None:
    """The client cannot know an engine's methods (vLLM allows any); an unknown name
    goes out and comes back as UtilityCallError with the engine's message; the client
    stays usable."""
    async with peer_client() as (client, peer):
        with anyio.fail_after(30), pytest.raises(UtilityCallError) as info:
            await client.call_utility("no_such_method", 1)
        assert info.value.method == "no_such_method"
        assert "no_such_method" in str(info.value)
        assert client.pending_utility_calls == 0
        await _sentinel(client, peer, expected_before=1)


async def test_calls_after_close_raise_and_send_nothing() -> None:
    peer = Peer()
    source = PeerEngines()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(peer.serve, source)
            async with open_client_for(source) as client:
                with anyio.fail_after(30):
                    assert await client.call_utility("echo", 1) == [1]
            assert client.dead
            calls: list[Any] = [
                lambda: client.add_request(_request("late")),
                lambda: client.call_utility("echo", 2),
                lambda: client.call_utility_all("echo"),
                lambda: client.get_output(),
                lambda: client.abort_requests(["late"]),
                lambda: client.get_supported_tasks(),
                lambda: client.is_sleeping(),
                lambda: client.reset_prefix_cache(),
                lambda: client.wait_dead(),
            ]
            for call in calls:
                with anyio.fail_after(30):
                    if call is calls[-1]:
                        error = await call()
                    else:
                        with pytest.raises(EngineDeadError) as info:
                            await call()
                        error = info.value
                assert "closed" in str(error)
            with pytest.raises(EngineDeadError, match="closed"):
                async with client.generate(_request("late")):
                    pytest.fail("must not start")
            with pytest.raises(EngineDeadError, match="closed"):
                client.get_output_nowait()
            await anyio.sleep(0.05)
            assert len(peer.received) == 1  # only the echo made while open
            tg.cancel_scope.cancel()
    finally:
        peer.close()


def open_client_for(source: PeerEngines) -> Any:
    from trio_vllm import open_client

    return open_client(source, ready_timeout=10)


async def test_duplicate_id_across_data_parallel_ranks_is_refused() -> None:
    """A live id is refused on every rank, not just on the one serving it (the engines,
    asked over their control sockets, hold only the first)."""
    from trio_vllm.testing import open_reference_engines

    async with open_reference_engines(
        count=2, model="echo", extra_args=("--max-model-len", "1000000")
    ) as engines:
        client = engines.client
        request = make_request([1], max_tokens=900_000, request_id="dp-dup")
        with anyio.fail_after(30):
            async with client.generate(request, rank=0) as stream:
                await stream.receive()
                for rank in (0, 1):
                    with pytest.raises(ValueError, match="'dp-dup' is already live"):
                        await client.add_request(request, rank=rank)
                    with pytest.raises(ValueError, match="'dp-dup' is already live"):
                        await _start(client, "generate", request)
                statuses = await engines.statuses()
                assert [s.requests for s in statuses] == [1, 0]
            await engines.wait_idle(within=5)
