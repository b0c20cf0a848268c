from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import zmq

if TYPE_CHECKING:
    from collections.abc import Iterator

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dev dependency
    uvloop = None

_BACKENDS = [
    pytest.param("trio", id="trio"),
    pytest.param("asyncio", id="asyncio"),
]
if uvloop is not None:
    _BACKENDS.append(
        pytest.param(("asyncio", {"loop_factory": uvloop.new_event_loop}), id="uvloop")
    )


@pytest.fixture(params=_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    """Transport tests run on trio, asyncio and (when installed) asyncio with uvloop."""
    return request.param


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    """A private zmq context per test; every socket must be closed by the test."""
    context: zmq.Context[Any] = zmq.Context()
    yield context
    # term() would hang on a socket a test forgot to close; destroy() makes that a
    # visible failure of the linger check below instead of a hang.
    open_sockets = [s for s in list(context._sockets) if not s.closed]  # type: ignore[attr-defined]
    context.destroy(linger=0)
    assert not open_sockets, f"test left {len(open_sockets)} zmq socket(s) open"
