"""SyncClient has the async client's API, blocking: one utilities table serves both."""

from __future__ import annotations

import inspect

import pytest

from trio_vllm import EngineCoreClient, EngineDeadError, SyncClient, UtilityCallError
from trio_vllm.client import ReferenceEngines, _utilities, make_request
from trio_vllm.client._utilities import NamedUtilities, NamedUtility

READY = 120


@pytest.fixture(params=["trio", "asyncio"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def test_sync_client_has_every_public_name_of_the_async_client() -> None:
    # Streams, the wait for death and the async-only dead_error live on the async side.
    async_only = {"wait_dead", "dead_error", "get_output_nowait", "current_wave", "waves_started"}
    missing = _public(EngineCoreClient) - _public(SyncClient) - async_only
    assert missing == set()


def test_named_utilities_come_from_one_table() -> None:
    specs = {
        name: value
        for name, value in vars(NamedUtilities).items()
        if isinstance(value, NamedUtility)
    }
    assert len(specs) == 21
    for name, spec in specs.items():
        assert spec.name == name
        assert getattr(EngineCoreClient, name) is spec
        assert getattr(SyncClient, name) is spec
        assert spec.fan_out in ("one", "all", "agree")
    # The methods keep the table's signatures and documentation.
    assert list(inspect.signature(_utilities.sleep.arguments).parameters) == ["level", "mode"]


def test_arguments_a_release_does_not_take_are_left_off_or_refused() -> None:
    from trio_vllm.protocol import V0_25_1, V0_32_0, V0_33_0

    args = _utilities.profile.arguments(True, "p", None, None, None)
    assert _utilities.wire_args(_utilities.profile, args, V0_25_1) == [True, "p"]
    assert _utilities.wire_args(_utilities.profile, args, V0_32_0) == [True, "p", None, None]
    assert len(_utilities.wire_args(_utilities.profile, args, V0_33_0)) == 5
    with pytest.raises(ValueError, match=r"profile\(\) takes at most 2 argument"):
        _utilities.wire_args(
            _utilities.profile, _utilities.profile.arguments(True, None, 3), V0_25_1
        )


def test_sync_parity_against_engines(backend: str) -> None:
    engines = ReferenceEngines(model="echo", count=2, faults=["--fail-utility", "reset_mm_cache"])
    with SyncClient(engines, backend=backend, ready_timeout=READY) as client:
        assert client.live_ranks == [0, 1]
        assert client.protocol_profile.vllm_version == client.vllm_version
        assert "generate" in client.get_supported_tasks()
        assert client.is_sleeping() is False
        client.profile(True)
        client.profile(False)
        results = client.call_utility_all("reset_mm_cache", return_exceptions=True)
        assert [type(r) for r in results] == [UtilityCallError, UtilityCallError]
        with pytest.raises(UtilityCallError):
            client.reset_mm_cache()
        added = client.add_engines(ReferenceEngines(model="echo", start_rank=2))
        assert added == [2]
        assert client.live_ranks == [0, 1, 2]
        assert client.generate(make_request([5], max_tokens=2), rank=2).collect() == [5, 5]
        client.retire_rank(1)
        event = client.engine_events.receive(timeout=30)
        assert (event.kind, event.rank) == ("rank_retired", 1)
        assert client.live_ranks == [0, 2]
        with pytest.raises(TimeoutError):
            client.engine_events.receive(timeout=0.05)


def test_engine_events_end_when_the_client_closes(backend: str) -> None:
    with SyncClient(ReferenceEngines(model="echo"), backend=backend, ready_timeout=READY) as c:
        events = c.engine_events
        assert c.call_utility("is_sleeping") is False
        with pytest.raises(TimeoutError):
            events.receive(timeout=0.05)
    with pytest.raises(EngineDeadError, match="closed"):
        events.receive(timeout=1)
