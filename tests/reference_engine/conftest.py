"""Fixtures: start reference engine processes and always clean them up."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from ._harness import Frontend

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator


@pytest.fixture
def spawn() -> Iterator[Callable[..., Frontend]]:
    """``spawn(args, **frontend_kwargs)`` starts an engine (handshake done unless told not
    to) and kills it at teardown."""
    started: list[Frontend] = []

    def _spawn(args: list[str] | None = None, *, start: bool = True, **kwargs: Any) -> Frontend:
        fe = Frontend(args, **kwargs)
        started.append(fe)
        return fe.start() if start else fe

    try:
        yield _spawn
    finally:
        for fe in started:
            fe.close()


@pytest.fixture(scope="module")
def echo_engine() -> Iterator[Frontend]:
    """One echo engine shared by a module's tests (each test uses fresh request ids)."""
    fe = Frontend(["--max-loras", "2"])
    try:
        fe.start()
        yield fe
    finally:
        fe.close()
