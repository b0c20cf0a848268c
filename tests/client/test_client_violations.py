"""Protocol violations and startup failures, against a scripted engine process.

The scripted engine (``_fake_engine.py``) is a real process on real sockets that can
break the protocol in ways the reference engine never does: a wrong ``engine_index``,
valid msgpack of the wrong shape, a wrong identity in the handshake.
"""

from __future__ import annotations

import time

import anyio
import pytest

from trio_vllm import EngineDeadError, EngineStartupError, ProtocolError
from trio_vllm.client import make_request, open_client

from .conftest import FakeEngines

pytestmark = pytest.mark.anyio


async def _stream_until_death(fault: str, n: int) -> EngineDeadError:
    async with open_client(FakeEngines(fault, n), ready_timeout=20) as client:
        request = make_request([1, 2, 3], max_tokens=1000)
        with anyio.fail_after(30):
            async with client.generate(request) as stream:
                with pytest.raises(EngineDeadError) as info:
                    async for _ in stream:
                        pass
        with pytest.raises(EngineDeadError):
            await client.call_utility("echo", 1)
        return info.value


async def test_fake_engine_round_trip() -> None:
    async with open_client(FakeEngines(), ready_timeout=20) as client:
        assert client.vllm_version == "0.32.0"
        assert client.max_model_len == 256
        request = make_request([4, 5, 6], max_tokens=7)
        async with client.generate(request) as stream:
            tokens = await stream.collect()
        assert tokens == [4, 5, 6, 4, 5, 6, 4]
        assert stream.finish_reason == 1
        assert await client.call_utility("echo", 1, "x") == [1, "x"]


async def test_malformed_frame_is_protocol_error_cause() -> None:
    error = await _stream_until_death("garbage", 3)
    assert isinstance(error.__cause__, ProtocolError)
    assert "EngineCoreOutputs" in str(error.__cause__)


async def test_wrong_shape_is_protocol_error_cause() -> None:
    error = await _stream_until_death("wrong-shape", 2)
    assert isinstance(error.__cause__, ProtocolError)


async def test_unexpected_engine_index_is_protocol_error_cause() -> None:
    error = await _stream_until_death("bad-index", 2)
    assert isinstance(error.__cause__, ProtocolError)
    assert "engine_index 7" in str(error.__cause__)


async def test_unexpected_identity_on_input_socket() -> None:
    error = await _stream_until_death("rogue", 2)
    assert isinstance(error.__cause__, ProtocolError)
    assert "unexpected identity 0900" in str(error.__cause__)


async def test_stray_ready_response_after_startup() -> None:
    error = await _stream_until_death("second-ready", 2)
    assert isinstance(error.__cause__, ProtocolError)
    assert "after startup" in str(error.__cause__)


async def test_engine_core_dead_frame() -> None:
    error = await _stream_until_death("dead", 3)
    assert "ENGINE_CORE_DEAD" in str(error)
    assert error.rank == 0


async def test_process_exit_mid_stream() -> None:
    error = await _stream_until_death("exit", 3)
    assert "exited with code 5" in str(error)


def _block_event_loop(seconds: float) -> None:
    time.sleep(seconds)


async def test_outputs_queued_before_exit_are_delivered_first() -> None:
    """The exit and the last outputs become visible together (the loop was blocked);
    the outputs still reach the stream, in order, before it raises."""
    async with open_client(FakeEngines("flush-exit", 5), ready_timeout=20) as client:
        async with client.generate(make_request([1, 2, 3], max_tokens=1000)) as stream:
            tokens = list((await stream.receive()).new_token_ids)
            _block_event_loop(1.0)  # meanwhile the engine sends 3 more steps and exits

            async def consume() -> None:
                async for out in stream:
                    tokens.extend(out.new_token_ids)

            with pytest.raises(EngineDeadError, match="exited with code 5"), anyio.fail_after(30):
                await consume()
        assert tokens == [1, 2, 3, 1]


async def test_exit_during_startup_names_code_and_output() -> None:
    start = time.monotonic()
    with pytest.raises(EngineStartupError) as info:
        async with open_client(FakeEngines("exit-before-hello"), ready_timeout=600):
            pytest.fail("startup should fail")
    assert time.monotonic() - start < 30  # noticed at the exit, not at the ready_timeout
    message = str(info.value)
    assert "exited with code 7" in message
    assert "failing before HELLO" in message


async def test_startup_timeout_says_what_is_missing() -> None:
    # The timeout must come after the engine's HELLO (its interpreter and imports),
    # which can take more than 1.5 s on a loaded machine: the message then says "no HELLO".
    with pytest.raises(EngineStartupError) as info:
        async with open_client(FakeEngines("hang-before-ready"), ready_timeout=5):
            pytest.fail("startup should time out")
    message = str(info.value)
    assert "within 5 s" in message
    assert "no READY yet from rank(s) [0]" in message


async def test_unexpected_identity_in_handshake() -> None:
    with pytest.raises(EngineStartupError) as info:
        async with open_client(FakeEngines("bad-identity"), ready_timeout=20):
            pytest.fail("startup should fail")
    assert isinstance(info.value.__cause__, ProtocolError)
    assert "identity" in str(info.value)
