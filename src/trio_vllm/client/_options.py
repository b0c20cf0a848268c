"""`ClientOptions`: the keywords that configure a client, written once.

`open_client`, `SyncClient`, `open_llm`, `SyncLLM` and ``run_openai_server`` (as its
``client_options``) all take them, typed by this one ``TypedDict``
(``**options: Unpack[ClientOptions]``: mypy and IDEs check each keyword's name and
type at the call site), and `resolve_options` checks them once, in `open_client`,
before any socket is bound or process started: an unknown keyword raises ``TypeError``
as Python does for a function's own keywords, a bad value ``TypeError``/``ValueError``
naming it (the rules in ``_args.py``).

Adding an option is a change to this module only: a key in `ClientOptions` (with its
type and its documentation), and its row in ``_OPTIONS`` (the default and the check,
which returns the value as `open_client` uses it). Every entry point takes it from then
on; `open_client` reads it from the resolved options. tests/client/test_options.py
holds the two in step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, Literal, TypedDict

from ..protocol.liveness import DEFAULT_HANG_TIMEOUT
from . import _args
from ._startup import DEFAULT_SHUTDOWN_GRACE

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from ..protocol.profiles import ProtocolProfile
    from ._startup import StartupProgress

__all__ = ["ClientOptions", "option_names", "resolve_options"]

_MAX_VOCAB_SIZE: Final = (1 << 31) - 1
# hang_timeout / stall_timeout bounds: libzmq takes heartbeat times in int ms; below
# 0.1 s a heartbeat is scheduling noise, above a day a typo.
_MIN_LIVENESS_S: Final = 0.1
_MAX_LIVENESS_S: Final = 86400.0


class ClientOptions(TypedDict, total=False):
    """The client's keywords (all optional), shared by every entry point.

    Attributes:
        ready_timeout: seconds to wait for every engine to be ready (default
            ``VLLM_ENGINE_READY_TIMEOUT_S`` or 600).
        profile: pin the protocol profile (a profile object or a vLLM version string)
            instead of taking it from the engines' ready responses.
        allow_insecure_serialization: accept pickle payloads from engines.
        shutdown_grace: seconds between SIGTERM and SIGKILL for spawned engines
            (default 5).
        stream_buffer: default per-stream buffer before coalescing (default 64).
        on_progress: called (synchronously, in the event loop's thread) on every
            startup step.
        on_engine_death: ``"fail"`` (default, as vLLM): one rank's death makes the
            client dead, the error naming the rank. ``"continue"``: only that rank's
            requests and utility calls fail (`EngineDeadError` with its ``rank``), new
            requests go to the surviving ranks, an `EngineEvent` ``"rank_lost"`` is
            queued; the client dies when the last rank does.
        waves: play the DP coordinator's wave role for MoE engines (docs/protocol.md
            §7.4/§7.5): wake idle ranks with START_DP_WAVE when a request goes to one
            of them, follow ``wave_complete``/``start_wave``. Only for engines that
            run DP waves (without a coordinator); others log each START_DP_WAVE.
        vocab_size: the model's vocabulary size, when known: a request holding a
            token id at or above it (prompt, ``allowed_token_ids``, ``logit_bias``,
            stop ids, ...) is refused with ``ValueError`` before it is sent, since a
            stock engine core dies of such an id.
        hang_timeout: seconds an engine may leave the client's heartbeats (ZMTP
            PINGs, answered by the engine's libzmq I/O thread, also during a long
            step) unanswered before it is declared dead: an `EngineDeadError` naming
            the rank on every stream and call, as for a crash (default 30; ``None``:
            no heartbeats). Catches a stopped or frozen process, a lost host or a cut
            network; see docs/reliability.md.
        stall_timeout: seconds with requests in flight on a rank and nothing heard
            from it before a probe utility call (``is_sleeping``, answered between
            steps) is sent, and again before an unanswered probe makes it dead: a
            loop that is stuck while its sockets answer (default ``None``: off). Must
            exceed the longest step (a GPU prefill can take seconds).
    """

    ready_timeout: float | None
    profile: ProtocolProfile | str | None
    allow_insecure_serialization: bool
    shutdown_grace: float
    stream_buffer: int
    on_progress: Callable[[StartupProgress], None] | None
    on_engine_death: Literal["fail", "continue"]
    waves: bool
    vocab_size: int | None
    hang_timeout: float | None
    stall_timeout: float | None


def _on_progress(name: str, value: object) -> object:
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be None or a callable, got {value!r}")
    return value


def _optional_int(maximum: int) -> Callable[[str, object], object]:
    def check(name: str, value: object) -> object:
        if value is None:
            return None
        return _args.integer(name, value, minimum=1, maximum=maximum)

    return check


def _one_of(*choices: str) -> Callable[[str, object], object]:
    def check(name: str, value: object) -> object:
        _args.choice(name, value, choices)
        return value

    return check


def _seconds(name: str, value: object) -> object:
    return _args.seconds(name, value, maximum=_args.MAX_SHUTDOWN_GRACE, allow_zero=True)


def _liveness_seconds(name: str, value: object) -> object:
    if value is None:
        return None
    number = _args.seconds(name, value, maximum=_MAX_LIVENESS_S, allow_zero=False)
    if number < _MIN_LIVENESS_S:
        raise ValueError(
            f"{name} must be at least {_MIN_LIVENESS_S:g} seconds (or None: off), got {value!r}"
        )
    return number


def _keep(check: Callable[[str, object], None]) -> Callable[[str, object], object]:
    def keep(name: str, value: object) -> object:
        check(name, value)
        return value

    return keep


# name -> (default, check): the check refuses a bad value (naming it) and returns the
# value as open_client uses it (ready_timeout: resolved from the environment; seconds
# as float).
_OPTIONS: Final[dict[str, tuple[object, Callable[[str, object], object]]]] = {
    "ready_timeout": (None, lambda name, value: _args.ready_timeout(value, name)),
    "profile": (None, _keep(_args.profile)),
    "allow_insecure_serialization": (False, _keep(_args.flag)),
    "shutdown_grace": (DEFAULT_SHUTDOWN_GRACE, _seconds),
    "stream_buffer": (
        64,
        lambda name, value: _args.integer(name, value, minimum=1, maximum=_args.MAX_STREAM_BUFFER),
    ),
    "on_progress": (None, _on_progress),
    "on_engine_death": ("fail", _one_of("fail", "continue")),
    "waves": (False, _keep(_args.flag)),
    "vocab_size": (None, _optional_int(_MAX_VOCAB_SIZE)),
    "hang_timeout": (DEFAULT_HANG_TIMEOUT, _liveness_seconds),
    "stall_timeout": (None, _liveness_seconds),
}


def resolve_options(options: Mapping[str, object], where: str = "open_client") -> ClientOptions:
    """Every option, checked, with its default where not given, as `open_client` uses
    it. Raises ``TypeError`` for a keyword ``where`` does not take (as Python words it)
    and ``TypeError``/``ValueError`` for a bad value, before anything starts."""
    unknown = [name for name in options if name not in _OPTIONS]
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")
    resolved: dict[str, object] = {}
    for name, (default, check) in _OPTIONS.items():
        resolved[name] = check(name, options.get(name, default))
    return resolved  # type: ignore[return-value]  # every key of ClientOptions, checked


def option_names() -> frozenset[str]:
    """The options `resolve_options` knows (for the test that holds them in step)."""
    return frozenset(_OPTIONS)
