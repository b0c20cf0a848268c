"""trio-vllm's testing kit: reference engines for tests, fault injection at run time, a
cancel-at-every-checkpoint harness and invariant assertions. See ``docs/testing.md``.

The pytest plugin (fixtures ``reference_engines``, ``engine_client``, ``engine_control``,
``reference_engine_config``, ``engine_clock``; marker ``reference_engines``) lives in
:mod:`trio_vllm.testing._plugin` and is registered through the ``pytest11`` entry point,
so ``pip install trio-vllm[test]`` is all a project needs. This module imports neither
pytest nor torch.
"""

from __future__ import annotations

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
]
