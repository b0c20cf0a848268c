"""A user's program, type-checked by ``tests/typed_api/test_typed_api.py`` with ``mypy
--strict``: what the public API promises to a type checker (never run, never imported)."""

from __future__ import annotations

from typing import assert_type

import trio_vllm as tv


async def main() -> None:
    request = tv.make_request([1, 2, 3], max_tokens=4)
    assert_type(request, tv.EngineCoreRequest)
    async with tv.open_client(tv.ReferenceEngines(model="echo")) as client:
        assert_type(client, tv.EngineCoreClient)
        assert_type(client.protocol_profile, tv.ProtocolProfile)
        async with client.generate(request) as stream:
            assert_type(stream, tv.RequestStream)
            async for output in stream:
                assert_type(output, tv.EngineCoreOutput)
                assert_type(output.new_token_ids, list[int])
            assert_type(await stream.collect(), list[int])
        await client.add_request(tv.make_request([4]))
        batch = await client.get_output()
        assert_type(batch, tv.EngineCoreOutputs)
        assert_type(client.get_output_nowait(), tv.EngineCoreOutputs)
        assert_type(await client.get_supported_tasks(), tuple[str, ...])
        assert_type(await client.is_sleeping(), bool)
        assert_type(await client.sleep(1, "abort"), None)
        assert_type(await client.list_loras(), set[int])
        assert_type(await client.get_weight_version(), str)
        assert_type(await client.compute_weight_checksums(), list[dict[str, str]])
        assert_type(await client.collective_rpc("echo", args=[1]), list[object])
        assert_type(await client.call_utility("x"), object)
        assert_type(await client.add_engines(tv.ReferenceEngines(start_rank=1)), list[int])
        event = await client.engine_events.receive()
        assert_type(event, tv.EngineEvent)
        assert_type(event.kind, str)
        assert_type(await client.wait_dead(), tv.EngineDeadError)


def blocking() -> None:
    with tv.SyncClient(tv.ReferenceEngines(model="echo"), ready_timeout=60) as client:
        assert_type(client.get_supported_tasks(), tuple[str, ...])
        assert_type(client.is_sleeping(), bool)
        assert_type(client.profile(True), None)
        for output in client.generate(tv.make_request([5])):
            assert_type(output, tv.EngineCoreOutput)
        assert_type(client.get_output(timeout=1.0), tv.EngineCoreOutputs)
        assert_type(client.engine_events.receive(timeout=1.0), tv.EngineEvent)
        assert_type(client.retire_rank(0), None)


async def options() -> None:
    # One ClientOptions for every entry point: mypy checks each keyword's name and type
    # (the ignores below are errors of their own, unused-ignore, if mypy stops seeing them).
    engines = tv.ReferenceEngines(model="echo")
    async with tv.open_client(engines, stream_buffer=8, on_engine_death="continue"):
        pass
    async with tv.open_client(engines, stream_bufer=8):  # type: ignore[call-arg]
        pass
    async with tv.open_llm(engines, shutdown_grace="5"):  # type: ignore[arg-type]
        pass
    with tv.SyncLLM(engines, on_engine_death="maybe"):  # type: ignore[arg-type]
        pass
    settings: tv.ClientOptions = {"ready_timeout": 30.0, "waves": False}
    with tv.SyncClient(engines, backend="asyncio", **settings) as client:
        assert_type(client.dead, bool)
