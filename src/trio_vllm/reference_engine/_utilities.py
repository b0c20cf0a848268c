"""The utility methods of docs/protocol.md §6.3, with vLLM's semantics.

The engine loop looks a method up by name on `Utilities`, calls it with the
positional arguments from the wire and replies with the result, or with
``"Call to <method> method failed: <text>"`` when it raises. A method that must wait for
the engine to drain (``sleep``, ``pause_scheduler``) returns a `Deferred`; the loop
replies once its condition holds, and keeps serving other input meanwhile, so replies
can come out of order, as in vLLM.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._errors import UtilityError
from ._scheduler import FinishReason, PauseState

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._state import EngineState

__all__ = ["Deferred", "Utilities", "UtilityCalls", "UtilityError"]

_PAUSE_MODES = ("abort", "wait", "keep")


@dataclass(eq=False)
class Deferred:
    """A reply that is sent when ``ready()`` first returns true; ``finish()`` gives the value."""

    ready: Callable[[], bool]
    finish: Callable[[], Any]


class _Worker:
    """The single worker ``collective_rpc`` reaches (world size 1)."""

    def __init__(self, server: EngineState) -> None:
        self._server = server

    def check_health(self) -> None:
        return None

    def get_supported_tasks(self) -> list[str]:
        return list(self._server.options.supported_tasks)

    def reference_engine_info(self) -> dict[str, Any]:
        """Reference engine only: the model facts a client needs (eos id, vocab, hidden)."""
        model = self._server.model
        from ._model import BOS_TOKEN_ID

        opts = self._server.options
        return {
            "model": model.name,
            "vocab_size": model.vocab_size,
            "hidden_size": model.hidden_size,
            "bos_token_id": BOS_TOKEN_ID if opts.model_dir is None else None,
            "eos_token_id": opts.eos_token_id,
            "model_dir": opts.model_dir,
            "device": model.device,
            "dtype": model.dtype,
        }

    def embed_tokens(self, token_ids: list[int]) -> list[list[float]]:
        """Reference engine only: the input embeddings of ``token_ids`` (for prompt_embeds
        tests: feeding them back must give the same output as the ids)."""
        rows: list[list[float]] = self._server.model.embed_tokens(list(token_ids)).tolist()
        return rows

    def echo(self, *args: Any) -> list[Any]:
        """Reference engine only: returns its arguments (for round-trip tests)."""
        return list(args)


class Utilities:
    """Engine-side utility methods. Public methods are exactly the callable names."""

    def __init__(self, server: EngineState) -> None:
        # Named _server: test engines that add utilities reach the engine through it.
        self._server = server
        self._worker = _Worker(server)
        self._weight_version = "default"
        self._sleeping_tags: set[str] = set()
        self._paused_by_sleep = False
        self._loras: dict[int, Any] = {}
        self._pinned: set[int] = set()
        self._profiling = False
        self.generation_paused = False  # 0.33 pause_generation in abort/wait mode
        self.last_argc = 0  # positional arguments of the call being served

    # ---- dispatch ------------------------------------------------------------------

    def lookup(self, method: str) -> Callable[..., Any]:
        """The bound method for ``method`` or `UtilityError` as vLLM words it."""
        unavailable = self._server.profile.unavailable_utilities
        func = None
        if not method.startswith("_") and method not in unavailable and method != "lookup":
            func = getattr(self, method, None)
        if func is None or not callable(func):
            cls = (
                "DPEngineCoreProc"
                if self._server.options.data_parallel_size > 1
                else ("EngineCoreProc")
            )
            raise UtilityError(f"'{cls}' object has no attribute '{method}'")
        return func  # type: ignore[no-any-return]

    def call(self, method: str, args: list[Any]) -> Any:
        self.last_argc = len(args)
        func = self.lookup(method)
        if method in self._server.options.fail_utilities:
            raise UtilityError(f"injected failure of {method}")
        params = list(inspect.signature(func).parameters.values())
        if not any(p.kind is p.VAR_POSITIONAL for p in params) and len(args) > len(params):
            raise UtilityError("")  # vLLM: an assertion without message
        try:
            return func(*args)
        except UtilityError:
            raise
        except Exception as exc:
            # vLLM catches every exception of a utility and replies with its text.
            raise UtilityError(str(exc)) from exc

    # ---- helpers ---------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self._weight_version

    def _idle(self) -> bool:
        sched = self._server.scheduler
        if sched.pause_state is PauseState.PAUSED_ALL:
            return True
        return not sched.running

    def _pause(self, mode: str, clear_cache: bool) -> Deferred:
        if mode not in _PAUSE_MODES:
            raise UtilityError(f"Invalid pause mode: {mode!r}; expected one of {_PAUSE_MODES}")
        sched = self._server.scheduler
        if mode == "abort":
            self._server.output.send_engine_finished(sched.finish_all(FinishReason.ABORT))
            sched.pause_state = PauseState.PAUSED_NEW
        elif mode == "wait":
            sched.pause_state = PauseState.PAUSED_NEW
        else:
            sched.pause_state = PauseState.PAUSED_ALL

        def finish() -> None:
            if clear_cache:
                sched.reset_prefix_cache(reset_running_requests=True)

        return Deferred(self._idle, finish)

    # ---- methods of docs/protocol.md §6.3 ---------------------------------------------------

    def get_supported_tasks(self) -> list[str]:
        return list(self._server.options.supported_tasks)

    def profile(
        self,
        is_start: bool = True,
        profile_prefix: str | None = None,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
        profiler_kwargs: dict[str, Any] | None = None,
    ) -> None:
        # The release's own argument count, from its profile (as the client trims).
        limit = self._server.profile.utility_arity["profile"][1]
        if self.last_argc > limit:
            raise UtilityError("")
        self._profiling = bool(is_start)

    def reset_mm_cache(self) -> None:
        return None

    def reset_encoder_cache(self) -> None:
        return None

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return self._server.scheduler.reset_prefix_cache(bool(reset_running_requests))

    def sleep(self, level: Any = 1, mode: str = "abort") -> Deferred:
        if not isinstance(level, int) or level not in (0, 1, 2):
            raise UtilityError(f"Invalid sleep level: {level!r}")
        if level >= 1 and not self._server.options.enable_sleep_mode:
            raise UtilityError("Sleep mode is not enabled (start with --enable-sleep-mode)")
        pause = self._pause(mode, clear_cache=level >= 1)
        self._paused_by_sleep = True

        def finish() -> None:
            pause.finish()
            self._sleeping_tags.add("scheduling")
            if level >= 1:
                self._server.model.offload(level)
                self._sleeping_tags.update(("weights", "kv_cache"))

        return Deferred(pause.ready, finish)

    def wake_up(self, tags: list[str] | None = None) -> bool | None:
        woken = set(self._sleeping_tags) if tags is None else set(tags) & self._sleeping_tags
        if "weights" in woken:
            self._server.model.reload()
        self._sleeping_tags -= woken
        if not self._sleeping_tags and self._paused_by_sleep:
            self._paused_by_sleep = False
            self._server.scheduler.pause_state = PauseState.UNPAUSED
        if not self._server.profile.wake_up_reports_awake:
            return None
        return not self._sleeping_tags

    def is_sleeping(self) -> bool:
        return bool(self._sleeping_tags)

    def weights_asleep(self) -> bool:
        """Whether the model's weights are offloaded (``sleep`` at level 1 or 2)."""
        return "weights" in self._sleeping_tags

    def release_kv_cache_memory(self) -> None:
        sched = self._server.scheduler
        if sched.pause_state is PauseState.UNPAUSED or sched.has_unfinished():
            raise UtilityError("release_kv_cache_memory requires a completed pause and no requests")
        if self._sleeping_tags - {"scheduling"}:
            raise UtilityError("release_kv_cache_memory: memory is already asleep")
        sched.reset_prefix_cache(reset_running_requests=True)
        self._sleeping_tags.add("kv_cache")

    def execute_dummy_batch(self) -> None:
        self._server.run_dummy_batch()

    def _check_lora(self) -> None:
        if self._server.options.max_loras <= 0:
            raise UtilityError("LoRA is not enabled. Use --max-loras N to enable LoRA.")

    def add_lora(self, lora_request: Any) -> bool:
        self._check_lora()
        lora = self._server.wire.convert_lora(lora_request)
        if lora.lora_int_id in self._loras:
            return False
        limit = self._server.options.max_cpu_loras or self._server.options.max_loras
        while len(self._loras) >= limit:
            evictable = [i for i in self._loras if i not in self._pinned]
            if not evictable:
                raise UtilityError(f"No free LoRA slots (max_cpu_loras={limit}, all pinned)")
            del self._loras[evictable[0]]
        self._loras[lora.lora_int_id] = lora
        return True

    def add_lora_from_request(self, lora: Any) -> None:
        """Not a utility of vLLM's: the engine loads a request's adapter on demand."""
        if lora.lora_int_id not in self._loras:
            self.add_lora(lora)

    def remove_lora(self, lora_id: int) -> bool:
        self._check_lora()
        self._pinned.discard(lora_id)
        return self._loras.pop(lora_id, None) is not None

    def list_loras(self) -> list[int]:
        self._check_lora()
        return sorted(self._loras)

    def pin_lora(self, lora_id: int) -> bool:
        self._check_lora()
        if lora_id not in self._loras:
            raise UtilityError(f"Pinning failed. LoRA {lora_id} is not registered.")
        self._pinned.add(lora_id)
        return True

    def save_sharded_state(
        self, path: str, pattern: str | None = None, max_size: int | None = None
    ) -> None:
        self._server.model.save(path, self._server.options.index)

    def collective_rpc(
        self,
        method: Any,
        timeout: float | None = None,
        args: list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        if not isinstance(method, str) or method.startswith("_"):
            raise UtilityError(f"'Worker' object has no attribute {method!r}")
        func = getattr(self._worker, method, None)
        if func is None:
            raise UtilityError(f"'Worker' object has no attribute '{method}'")
        return [func(*(args or ()), **(kwargs or {}))]

    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> Deferred:
        return self._pause(mode, bool(clear_cache))

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> Deferred:
        deferred = self._pause(mode, bool(clear_cache))
        self.generation_paused = mode in ("abort", "wait")
        return deferred

    def resume_scheduler(self) -> None:
        self._server.scheduler.pause_state = PauseState.UNPAUSED
        self.generation_paused = False

    def is_scheduler_paused(self) -> bool:
        return self._server.scheduler.pause_state is not PauseState.UNPAUSED

    def set_weight_version(self, weight_version: str) -> None:
        self._weight_version = str(weight_version)

    def get_weight_version(self) -> str:
        return self._weight_version

    def compute_weight_checksums(self) -> list[dict[str, str]]:
        return [self._server.model.weight_checksums()]

    def get_kv_cache_group_metadata(self) -> list[dict[str, Any]]:
        return [
            {
                "group_idx": 0,
                "kind": "full_attention",
                "block_size": self._server.options.block_size,
                "sliding_window": None,
            }
        ]

    def reinitialize_distributed(self, request: Any) -> str:
        raise UtilityError("Elastic EP is not supported by this engine")

    def commit_prepared_elastic_ep(self) -> None:
        raise UtilityError("Elastic EP is not supported by this engine")

    def barrier(self) -> None:
        return None


class UtilityCalls:
    """Utility calls from the wire: served at once, or replied to later (`Deferred`)."""

    def __init__(
        self, utilities: Utilities, reply: Callable[[int, int, str | None, Any], None]
    ) -> None:
        self._utilities = utilities
        self._reply = reply
        self._pending: list[tuple[int, int, str, Deferred]] = []

    def handle(self, client_index: int, call_id: int, method: str, args: list[Any]) -> None:
        """Call ``method``; reply with its value or failure now, or once it is ready."""
        try:
            result = self._utilities.call(method, args)
        except UtilityError as exc:
            self._reply(client_index, call_id, f"Call to {method} method failed: {exc}", None)
            return
        if isinstance(result, Deferred):
            self._pending.append((client_index, call_id, method, result))
            return
        self._reply(client_index, call_id, None, result)

    def complete(self) -> None:
        """Reply to every deferred call whose condition now holds."""
        if not self._pending:
            return
        still = []
        for client_index, call_id, method, deferred in self._pending:
            if not deferred.ready():
                still.append((client_index, call_id, method, deferred))
                continue
            try:
                value = deferred.finish()
            except Exception as exc:
                self._reply(client_index, call_id, f"Call to {method} method failed: {exc}", None)
            else:
                self._reply(client_index, call_id, None, value)
        self._pending = still

    def fail_all(self, failure: str) -> None:
        """Reply ``failure`` to every deferred call (shutdown)."""
        for client_index, call_id, _method, _deferred in self._pending:
            self._reply(client_index, call_id, failure, None)
        self._pending = []
