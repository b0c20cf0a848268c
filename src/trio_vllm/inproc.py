"""``InprocEngine``: a vLLM engine core in this process, stepped by the caller.

The counterpart of vLLM's ``InprocClient`` (what ``LLMEngine`` uses with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``): no sockets, no processes, no background task;
`InprocEngine.get_output` runs one engine step in the calling thread and returns
what it produced. It needs vLLM importable *in this process*, which the rest of
trio-vllm never does: vLLM is imported lazily, only by `InprocEngine.start`.

Requests, utility arguments and outputs cross the same msgpack encoding they cross on
the wire: a request is encoded with trio-vllm's codec and decoded with vLLM's
``MsgpackDecoder``; outputs are encoded with vLLM's ``MsgpackEncoder`` and decoded
into trio-vllm's structs. So callers use the same types as with
`open_client`, and the in-process path checks the codec for free.

What it cannot do (as vLLM's ``InprocClient``):

* ``sleep`` / ``pause_scheduler`` in ``"wait"`` mode: waiting needs the engine to keep
  stepping while the call blocks; refused with ``ValueError`` before anything happens;
* concurrency: it is synchronous and not thread-safe; a step blocks the caller for the
  whole forward pass. For async code, run it in a worker thread or use
  `VllmEngines` (a separate process) instead;
* data parallelism, death detection (an engine exception propagates from the call that
  hit it) and pickled payloads.

Utility results are vLLM's own Python values (as ``InprocClient`` returns them), not
decoded from the wire.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any, final

from .protocol.codec import ClientCodec
from .protocol.profiles import profile_for_version
from .protocol.structs import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping
    from types import TracebackType

__all__ = ["InprocEngine"]

# Utilities with a pause mode, and the position of that argument.
_MODE_ARG = {"sleep": 1, "pause_scheduler": 0}


@final
class InprocEngine:
    """A vLLM ``EngineCore`` built in this process (vLLM's ``InprocClient`` parity).

    Args:
        model: model path or name, as for ``vllm serve``.
        engine_args: more ``vllm.engine.arg_utils.EngineArgs`` fields, e.g.
            ``{"load_format": "dummy", "dtype": "float32", "max_model_len": 256}``.
        log_stats: let the engine attach scheduler stats to outputs.

    Use as a context manager (``with InprocEngine(...) as engine:``): entering builds
    the engine core (loads the model; can take minutes), leaving shuts it down. Raises
    ``ImportError`` on entering if vLLM is not importable here
    (`available` tells beforehand). Not thread-safe.
    """

    def __init__(
        self,
        model: str,
        *,
        engine_args: Mapping[str, object] | None = None,
        log_stats: bool = False,
    ) -> None:
        self.model = model
        self.engine_args = dict(engine_args or {})
        self.log_stats = log_stats
        self._core: Any = None
        self._codec: ClientCodec | None = None
        self._vllm_request_decoder: Any = None
        self._vllm_generic_decoder: Any = None
        self._vllm_encoder: Any = None
        self._convert_args: Any = None
        self._live: set[str] = set()
        self.vllm_version: str | None = None

    @staticmethod
    def available() -> bool:
        """True if an installed distribution provides the ``vllm`` package.

        Asks the package metadata rather than the import system, so that a directory
        named ``vllm`` on ``sys.path`` (a source checkout, a test folder) does not
        count. Imports nothing.
        """
        return "vllm" in importlib.metadata.packages_distributions()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Build the engine core (imports vLLM; loads the model in this thread)."""
        if self._core is not None:
            raise RuntimeError("the InprocEngine is already started")
        if not self.available():
            raise ImportError(
                "InprocEngine needs vLLM importable in this process; trio-vllm itself does "
                "not depend on vLLM. Use VllmEngines(python=...) to run stock vLLM from "
                "another environment instead."
            )
        vllm = importlib.import_module("vllm")
        arg_utils = importlib.import_module("vllm.engine.arg_utils")
        core_module = importlib.import_module("vllm.v1.engine.core")
        executor_module = importlib.import_module("vllm.v1.executor")
        engine_module = importlib.import_module("vllm.v1.engine")
        serial = importlib.import_module("vllm.v1.serial_utils")

        self.vllm_version = str(vllm.__version__)
        # Unknown versions raise ProtocolError here, before the model loads.
        self._codec = ClientCodec(profile_for_version(self.vllm_version))
        config = arg_utils.EngineArgs(model=self.model, **self.engine_args).create_engine_config()
        executor_class = executor_module.Executor.get_class(config)
        self._vllm_request_decoder = serial.MsgpackDecoder(engine_module.EngineCoreRequest)
        self._vllm_generic_decoder = serial.MsgpackDecoder()
        self._vllm_encoder = serial.MsgpackEncoder()
        self._convert_args = core_module.EngineCoreProc._convert_msgspec_args
        self._core = core_module.EngineCore(config, executor_class, self.log_stats)

    def shutdown(self) -> None:
        """Shut the engine core down (idempotent)."""
        core, self._core = self._core, None
        self._live.clear()
        if core is not None:
            core.shutdown()

    def __enter__(self) -> InprocEngine:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    def _started(self) -> Any:
        if self._core is None:
            raise RuntimeError("the InprocEngine is not started (use it as a context manager)")
        return self._core

    @property
    def max_model_len(self) -> int:
        """The engine's context length."""
        return int(self._started().vllm_config.model_config.max_model_len)

    # ------------------------------------------------------------------ raw API

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue ``request`` on the engine (vLLM's ``InprocClient.add_request``).

        Validated and encoded by trio-vllm's codec (``ValueError`` before anything reaches
        the engine), decoded by vLLM's, then preprocessed as the engine's input thread
        would. A live duplicate id is refused with ``ValueError``.
        """
        core = self._started()
        assert self._codec is not None
        if request.request_id in self._live:
            raise ValueError(f"request id {request.request_id!r} is already live")
        frames = self._codec.encode_add(request)
        vllm_request = self._vllm_request_decoder.decode([memoryview(f) for f in frames[1:]])
        prepared, wave = core.preprocess_add_request(vllm_request)
        core.add_request(prepared, wave)
        self._live.add(request.request_id)

    def get_output(self) -> EngineCoreOutputs:
        """Run one engine step and return its outputs (possibly an empty batch).

        Blocks this thread for the step. Finished requests leave `live_requests`.
        """
        core = self._started()
        assert self._codec is not None
        outputs_by_client, model_executed = core.step_fn()
        core.post_step(model_executed=model_executed)
        outputs = (outputs_by_client or {}).get(0)
        if outputs is None:
            return EngineCoreOutputs()
        frames = self._vllm_encoder.encode(outputs)
        decoded = self._codec.decode_outputs([bytes(f) for f in frames])
        assert isinstance(decoded, EngineCoreOutputs)  # an engine never steps "dead"
        for output in decoded.outputs:
            if output.finish_reason is not None:
                self._live.discard(output.request_id)
        return decoded

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests by id; no output follows for them."""
        core = self._started()
        ids = list(request_ids)
        if ids:
            core.abort_requests(ids)
            self._live.difference_update(ids)

    @property
    def live_requests(self) -> list[str]:
        """Ids added and not yet finished or aborted."""
        return sorted(self._live)

    def has_unfinished_requests(self) -> bool:
        """Whether the engine's scheduler has work (running or waiting requests)."""
        return bool(self._started().scheduler.has_requests())

    def generate(self, request: EngineCoreRequest) -> Iterator[EngineCoreOutput]:
        """Add ``request`` and step the engine, yielding its outputs until the final one.

        Outputs of other live requests produced by the same steps are dropped: use
        `add_request` and `get_output` to run several at once. Closing the
        generator early (``break``, an exception) aborts the request.
        """
        self.add_request(request)
        request_id = request.request_id
        try:
            while request_id in self._live:
                for output in self.get_output().outputs:
                    if output.request_id == request_id:
                        yield output
        finally:
            if request_id in self._live and self._core is not None:
                self.abort_requests([request_id])

    # ------------------------------------------------------------------ utilities

    def call_utility(self, method: str, *args: object) -> object:
        """Call the engine core's ``method(*args)`` directly; returns vLLM's value.

        Arguments cross the wire encoding first (so trio-vllm structs such as
        ``LoRARequest`` arrive as the engine expects). ``"wait"`` mode of ``sleep`` and
        ``pause_scheduler`` raises ``ValueError`` (nothing would step the engine while
        waiting). Exceptions from the engine method propagate unchanged.
        """
        core = self._started()
        assert self._codec is not None
        if method.startswith("_"):
            raise ValueError(f"not a utility method: {method!r}")
        mode_at = _MODE_ARG.get(method)
        if mode_at is not None and args[mode_at : mode_at + 1] == ("wait",):
            raise ValueError(f"'wait' pause mode is not supported in-process ({method})")
        frames = self._codec.encode_utility(0, 0, method, list(args))
        _, _, _, wire_args = self._vllm_generic_decoder.decode([memoryview(f) for f in frames[1:]])
        func = getattr(core, method)
        result = func(*self._convert_args(func, wire_args))
        if hasattr(result, "done") and hasattr(result, "result"):  # a concurrent Future
            if not result.done():
                raise RuntimeError(f"{method} returned a pending future; nothing steps it here")
            result = result.result()
        return result

    def get_supported_tasks(self) -> tuple[str, ...]:
        """Tasks the model supports."""
        tasks = self.call_utility("get_supported_tasks")
        assert isinstance(tasks, (list, tuple))
        return tuple(str(task) for task in tasks)

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Reset the prefix cache."""
        return bool(
            self.call_utility("reset_prefix_cache", reset_running_requests, reset_connector)
        )

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Put the engine to sleep (``mode="wait"`` is refused)."""
        self.call_utility("sleep", level, mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wake the engine."""
        result = self.call_utility("wake_up", tags)
        return result is None or bool(result)

    def is_sleeping(self) -> bool:
        """Whether the engine sleeps."""
        return bool(self.call_utility("is_sleeping"))
