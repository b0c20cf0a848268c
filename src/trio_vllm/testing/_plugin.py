"""The pytest plugin of trio-vllm's testing kit (entry point ``pytest11``: ``trio_vllm``).

Fixtures (function scope):

* ``reference_engine_config``: the `EngineConfig` for the test,
  from the ``reference_engines`` marker and/or indirect parametrization;
* ``reference_engines``: a running `ReferenceEngineSet`
  (engines, connected client, controls), stopped after the test;
* ``engine_client``: its client; ``engine_control``: the control of its first engine;
* ``engine_clock``: `engine_mock_clock` (pytest-trio uses any
  fixture whose value is a clock as the test's clock).

The async fixture works under anyio's plugin (``@pytest.mark.anyio``, either backend)
and under pytest-trio (``@pytest.mark.trio`` or trio mode): both run an async generator
fixture's setup and teardown in one task, which ``open_client`` requires.

Loaded in every pytest run wherever trio-vllm is installed, so it imports only pytest
at the top; the kit (trio, anyio, zmq, the client) is imported when a fixture runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    import trio.testing

    from ..client import EngineCoreClient
    from ._control import EngineControl
    from ._engines import EngineConfig, ReferenceEngineSet

MARKER = "reference_engines"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(**fields): configure the reference_engines fixture with EngineConfig "
        "fields (count, model, protocol, faults, extra_args, ...)",
    )


@pytest.fixture
def reference_engine_config(request: pytest.FixtureRequest) -> EngineConfig:
    """The engine configuration of this test.

    Starts from `EngineConfig` defaults, applies the closest
    ``@pytest.mark.reference_engines(**fields)`` marker, then an indirect parameter
    (an `EngineConfig`, which replaces the result so far, or a dict of fields).
    Override the fixture to set project-wide defaults.
    """
    from ._engines import EngineConfig

    config = EngineConfig()
    marker = request.node.get_closest_marker(MARKER)
    if marker is not None:
        if marker.args:
            raise TypeError(f"@pytest.mark.{MARKER} takes keyword arguments only")
        config = config.replace(**marker.kwargs)
    param: Any = getattr(request, "param", None)
    if isinstance(param, EngineConfig):
        config = param
    elif isinstance(param, dict):
        config = config.replace(**param)
    elif param is not None:
        raise TypeError(
            f"reference_engine_config parameter must be an EngineConfig or dict, got {param!r}"
        )
    return config


@pytest.fixture
async def reference_engines(
    reference_engine_config: EngineConfig,
) -> AsyncIterator[ReferenceEngineSet]:
    """Running reference engines with a connected client and their controls."""
    from ._engines import open_reference_engines

    async with open_reference_engines(reference_engine_config) as engines:
        yield engines


@pytest.fixture
def engine_client(reference_engines: ReferenceEngineSet) -> EngineCoreClient:
    """The client connected to the ``reference_engines``."""
    return reference_engines.client


@pytest.fixture
def engine_control(reference_engines: ReferenceEngineSet) -> EngineControl:
    """The control of the first engine of ``reference_engines``."""
    return reference_engines.control()


@pytest.fixture
def engine_clock() -> trio.testing.MockClock:
    """A trio MockClock for tests with engines (autojump after 0.25 s of real idleness)."""
    from ._clock import engine_mock_clock

    return engine_mock_clock()
