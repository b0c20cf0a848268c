"""trio-vllm's testing kit: reference engines for tests, fault injection at run time, a
cancel-at-every-checkpoint harness and invariant assertions. See ``docs/testing.md``.

The pytest plugin (fixtures ``reference_engines``, ``engine_client``, ``engine_control``,
``reference_engine_config``, ``engine_clock``; marker ``reference_engines``) lives in
``trio_vllm.testing._plugin`` and is registered through the ``pytest11`` entry point,
so ``pip install 'trio-vllm[testing]'`` is all a project needs.

The names are imported on first use: pytest loads the plugin, and with it this
package, in every run wherever trio-vllm is installed, and most runs use no engine.
The kit never imports torch; ``trio.testing`` (the virtual clock) imports pytest when
it is installed, and the kit works without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._assertions import TaskSnapshot as TaskSnapshot
    from ._assertions import assert_client_dies as assert_client_dies
    from ._assertions import assert_engine_idle as assert_engine_idle
    from ._assertions import assert_no_inflight_requests as assert_no_inflight_requests
    from ._assertions import assert_no_task_leaks as assert_no_task_leaks
    from ._clock import engine_mock_clock as engine_mock_clock
    from ._clock import real_time as real_time
    from ._control import EngineControl as EngineControl
    from ._control import EngineStatus as EngineStatus
    from ._engines import EngineConfig as EngineConfig
    from ._engines import ReferenceEngineSet as ReferenceEngineSet
    from ._engines import open_reference_engines as open_reference_engines
    from ._harness import CancellationReport as CancellationReport
    from ._harness import CheckpointRun as CheckpointRun
    from ._harness import Violation as Violation
    from ._harness import check_cancellation as check_cancellation
    from ._lora import write_lora_adapter as write_lora_adapter

# name -> the private module that defines it
_LAZY = {
    "TaskSnapshot": "._assertions",
    "assert_client_dies": "._assertions",
    "assert_engine_idle": "._assertions",
    "assert_no_inflight_requests": "._assertions",
    "assert_no_task_leaks": "._assertions",
    "engine_mock_clock": "._clock",
    "real_time": "._clock",
    "EngineControl": "._control",
    "EngineStatus": "._control",
    "EngineConfig": "._engines",
    "ReferenceEngineSet": "._engines",
    "open_reference_engines": "._engines",
    "CancellationReport": "._harness",
    "CheckpointRun": "._harness",
    "Violation": "._harness",
    "check_cancellation": "._harness",
    "write_lora_adapter": "._lora",
}

__all__ = [
    "CancellationReport",
    "CheckpointRun",
    "EngineConfig",
    "EngineControl",
    "EngineStatus",
    "ReferenceEngineSet",
    "TaskSnapshot",
    "Violation",
    "assert_client_dies",
    "assert_engine_idle",
    "assert_no_inflight_requests",
    "assert_no_task_leaks",
    "check_cancellation",
    "engine_mock_clock",
    "open_reference_engines",
    "real_time",
    "write_lora_adapter",
]


def __getattr__(name: str) -> Any:
    """PEP 562: import a name's module on first access (then cached here)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
