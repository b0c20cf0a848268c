"""Every exception trio-vllm raises on purpose lives here.

Named by cause, as trio does: *Protocol* (the peer sent something we cannot accept),
*EngineDead* (an engine is gone; nothing more will come from it), *EngineStartup*
(an engine never became ready), *UtilityCall* (the engine ran a utility and it failed),
*Unroutable* (a ROUTER send to an identity that has no connection), *InvalidRequest*
(the text layer refused a request before sending it).

Errors that anyio already names (``anyio.ClosedResourceError`` for a resource you
closed yourself, ``anyio.BrokenResourceError``, ``anyio.BusyResourceError``) are
used as they are and are not redefined here.
"""

from __future__ import annotations

__all__ = [
    "EngineDeadError",
    "EngineStartupError",
    "InsecureSerializationError",
    "InvalidRequestError",
    "ProtocolError",
    "TrioVllmError",
    "UnroutableError",
    "UtilityCallError",
]


class TrioVllmError(Exception):
    """Base class of every error trio-vllm raises on purpose."""


class ProtocolError(TrioVllmError):
    """A frame or message could not be decoded or violates the wire protocol.

    The message names what was being decoded and what was wrong. Decoding never
    raises any other exception type.
    """


class InsecureSerializationError(ProtocolError):
    """A pickle/cloudpickle payload arrived and insecure serialization is not allowed."""


class EngineDeadError(TrioVllmError):
    """An engine died (process exit, ``ENGINE_CORE_DEAD``, or a broken connection).

    Raised by every pending and every later operation that needs that engine. The
    underlying reason, when there is one (a `ProtocolError`, an exit status),
    is chained as ``__cause__``. ``rank`` is the data-parallel rank of the engine that
    died, or ``None`` when the whole client is gone.
    """

    def __init__(self, message: str = "engine core is dead", *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class EngineStartupError(TrioVllmError):
    """An engine did not become ready: it exited during startup, or a deadline passed.

    The message says which engine, what was observed (exit code, the last lines of its
    stderr, how long we waited) and what to try next.
    """


class UtilityCallError(TrioVllmError):
    """The engine ran a utility method and it failed; ``args[0]`` is the engine's message."""

    def __init__(self, method: str, failure_message: str, *, rank: int | None = None) -> None:
        super().__init__(f"utility {method!r} failed on the engine: {failure_message}")
        self.method = method
        self.failure_message = failure_message
        self.rank = rank


class UnroutableError(TrioVllmError):
    """A ROUTER send named an identity that has no live connection (``ROUTER_MANDATORY``)."""


class InvalidRequestError(TrioVllmError, ValueError):
    """A request the text layer refuses before anything is sent to an engine.

    Bad sampling parameters, a prompt that does not fit (the message then says
    "maximum context length"), a token id outside the vocabulary, a malformed chat
    message, a value msgpack cannot encode. The message says what was wrong; the
    server answers it with HTTP 400. The raw client raises it too, for a request a
    stock engine could die on. ``param`` is the parameter vLLM names in its error (the
    HTTP 400's ``param``; ``None`` where vLLM names none), ``field`` the field at fault
    when a request rule (``trio_vllm.protocol.rules``) refused it.
    """

    def __init__(self, message: str, *, param: str | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.field = field
