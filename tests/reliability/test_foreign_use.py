"""Issue 16 class (c): every public method used from another thread or another loop.

A client belongs to the event loop (and thread) that opened it. Issue 16 item 5: from a
second thread, ``anyio.run(client.call_utility, ...)`` sent the message; on trio the
reply's ``Event.set()`` then tripped trio's runner assertion inside the receive task and
the client died for everyone, on asyncio the caller hung and a pending call leaked.

Here every public method of :class:`~trio_vllm.EngineCoreClient` (the table must name
them all: a new method fails :func:`test_the_table_covers_every_public_method`) is called
from a second thread running trio or asyncio, and from a second loop nested in the
owner's thread (``asyncio.run`` inside trio, ``trio.run`` inside asyncio). Each call must
raise ``RuntimeError`` naming the method; the peer engine must have received nothing
(a sentinel call from the owner is the only message it sees), and the client must stay
alive and usable for its owner, with no pending call and no live request left.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import pytest
import trio

from trio_vllm import EngineCoreClient, LoRARequest, make_pooling_request, make_request
from trio_vllm.client._utilities import NamedUtility
from trio_vllm.protocol import UtilityCall

from ._peer import peer_client
from ._scripted import ScriptedSource

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def _generate(client: EngineCoreClient) -> None:
    async with client.generate(make_request([1, 2], max_tokens=2, request_id="g")):
        pytest.fail("generate must refuse a foreign caller")


async def _nowait(client: EngineCoreClient) -> None:
    client.get_output_nowait()


CALLS: dict[str, Callable[[EngineCoreClient], Awaitable[Any]]] = {
    "wait_dead": lambda c: c.wait_dead(),
    "add_request": lambda c: c.add_request(make_request([1, 2], max_tokens=2, request_id="a")),
    "get_output": lambda c: c.get_output(),
    "get_output_nowait": _nowait,
    "abort_requests": lambda c: c.abort_requests(["x"]),
    "generate": _generate,
    "encode": lambda c: c.encode(make_pooling_request([1, 2], request_id="e")),
    "call_utility": lambda c: c.call_utility("echo", 1),
    "call_utility_all": lambda c: c.call_utility_all("echo", 1),
    "retire_rank": lambda c: c.retire_rank(0),
    "add_engines": lambda c: c.add_engines(ScriptedSource(start_rank=1), ready_timeout=1),
    "get_supported_tasks": lambda c: c.get_supported_tasks(),
    "is_sleeping": lambda c: c.is_sleeping(),
    "sleep": lambda c: c.sleep(),
    "wake_up": lambda c: c.wake_up(),
    "reset_prefix_cache": lambda c: c.reset_prefix_cache(),
    "reset_mm_cache": lambda c: c.reset_mm_cache(),
    "reset_encoder_cache": lambda c: c.reset_encoder_cache(),
    "profile": lambda c: c.profile(),
    "add_lora": lambda c: c.add_lora(LoRARequest("a", 1, "/nonexistent")),
    "remove_lora": lambda c: c.remove_lora(1),
    "list_loras": lambda c: c.list_loras(),
    "pin_lora": lambda c: c.pin_lora(1),
    "pause_scheduler": lambda c: c.pause_scheduler(),
    "resume_scheduler": lambda c: c.resume_scheduler(),
    "is_scheduler_paused": lambda c: c.is_scheduler_paused(),
    "collective_rpc": lambda c: c.collective_rpc("method"),
    "execute_dummy_batch": lambda c: c.execute_dummy_batch(),
    "save_sharded_state": lambda c: c.save_sharded_state("/nonexistent"),
    "get_weight_version": lambda c: c.get_weight_version(),
    "set_weight_version": lambda c: c.set_weight_version("v2"),
    "compute_weight_checksums": lambda c: c.compute_weight_checksums(),
    # The named utilities' common path; its refusal names the utility it runs.
    "run_named_utility": lambda c: c.run_named_utility(EngineCoreClient.get_supported_tasks, []),
}
REFUSED_AS = {"run_named_utility": "get_supported_tasks"}
# Plain reads, safe from anywhere (the sync facade reads dead_error() from its callers'
# threads): they send nothing and wait for nothing.
NOT_CHECKED = {"dead_error"}


def test_the_table_covers_every_public_method() -> None:
    # The named utilities are descriptors (rows of _utilities.py's table) that become
    # methods on an instance; on the class they are the rows themselves.
    public = {
        name
        for name, member in inspect.getmembers(EngineCoreClient)
        if not name.startswith("_")
        and (callable(member) or isinstance(member, NamedUtility))
        and not isinstance(member, property)
    }
    assert public - NOT_CHECKED == set(CALLS)


def _outcome(run: Callable[[], object]) -> BaseException | None:
    try:
        run()
    except BaseException as exc:
        return exc
    return None


async def _check_refused(
    error: BaseException | None, name: str, client: EngineCoreClient, peer: Any
) -> None:
    assert isinstance(error, RuntimeError), f"{name}: {error!r}"
    assert f"EngineCoreClient.{REFUSED_AS.get(name, name)}()" in str(error)
    # Nothing was sent: the owner's sentinel is the only message the engine got.
    with anyio.fail_after(30):
        assert await client.call_utility("echo", "sentinel") == ["sentinel"]
    assert peer.undecodable == []
    assert len(peer.received) == 1, peer.received
    assert isinstance(peer.received[0], UtilityCall)
    assert not client.dead
    assert client.pending_utility_calls == 0
    assert client.live_requests == []


@pytest.mark.parametrize("foreign", ["trio", "asyncio"])
@pytest.mark.parametrize("name", sorted(CALLS))
async def test_foreign_thread(name: str, foreign: str) -> None:
    """From a second thread running its own loop: RuntimeError, nothing sent."""
    async with peer_client() as (client, peer):
        call = CALLS[name]

        async def in_foreign_loop() -> None:
            with anyio.fail_after(30):  # unchecked, the call hangs here
                await call(client)

        error = await anyio.to_thread.run_sync(
            _outcome, lambda: anyio.run(in_foreign_loop, backend=foreign)
        )
        await _check_refused(error, name, client, peer)


@pytest.mark.parametrize("name", sorted(CALLS))
async def test_foreign_loop_same_thread(name: str, anyio_backend: str) -> None:
    """From a loop nested in the owner's thread (asyncio in trio, trio in asyncio)."""
    async with peer_client() as (client, peer):
        call = CALLS[name]

        async def in_foreign_loop() -> None:
            await call(client)

        if anyio_backend == "trio":
            error = _outcome(lambda: asyncio.run(in_foreign_loop()))
        else:
            error = _outcome(lambda: trio.run(in_foreign_loop))
        await _check_refused(error, name, client, peer)


async def test_foreign_call_does_not_kill_the_client_under_load() -> None:
    """The issue's exact call (``anyio.run(client.call_utility, ...)`` from a thread)
    while the owner keeps calling: the owner's calls all succeed, the foreign one is
    refused, nothing leaks."""
    async with peer_client() as (client, _peer):

        def foreign() -> BaseException | None:
            return _outcome(lambda: anyio.run(client.call_utility, "echo", "foreign"))

        async with anyio.create_task_group() as tg:

            async def owner() -> None:
                for i in range(50):
                    assert await client.call_utility("echo", i) == [i]

            tg.start_soon(owner)
            error = await anyio.to_thread.run_sync(foreign)
        assert isinstance(error, RuntimeError)
        assert not client.dead
        assert client.pending_utility_calls == 0
