"""The narrow view of a running engine that its collaborators get.

`EngineServer` satisfies `EngineState`; the utilities, the control socket and the
DP-wave logic are typed against this protocol, never against the server, so none of
them imports ``_server`` and the server's other state stays its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..protocol.profiles import ProtocolProfile
    from ._model import Model
    from ._options import EngineOptions
    from ._outputs import OutputPath
    from ._scheduler import Scheduler
    from ._wire import Wire

__all__ = ["EngineState"]


class EngineState(Protocol):
    """What a collaborator may read (and the few flags it may set) on the engine."""

    options: EngineOptions
    profile: ProtocolProfile
    rank: int
    wire: Wire
    output: OutputPath
    model: Model
    scheduler: Scheduler
    loaded: bool  # model and scheduler exist (startup got that far)
    steps: int
    stalled: bool
    input_dead: bool
    shutdown_requested: bool

    def firehose_requests(self) -> int:
        """How many requests the firehose is streaming."""
        ...

    def has_work(self) -> bool:
        """Whether a request is unfinished (scheduled or in the firehose)."""
        ...

    def run_dummy_batch(self) -> None:
        """One model forward pass on a dummy sequence (an idle DP rank's step)."""
        ...
