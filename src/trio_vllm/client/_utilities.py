"""The named utilities (docs/protocol.md §6.3), written once for both clients.

Each entry of the table says what vLLM's own client does for one utility: its wire
name, which engines it goes to (``"one"``: the least busy live rank, ``"all"``: every
live rank, ``"agree"``: every live rank and they must agree, else
`ProtocolError`), how the user's arguments become wire arguments
(a typed function, whose signature is the method's) and how the per-rank results
combine. How many arguments a release takes is not here but in the protocol profile
(``ProtocolProfile.utility_arity``): trailing arguments a release does not know are
left off when they are ``None``, refused with ``ValueError`` otherwise.

`NamedUtilities` holds the table as descriptors: on an
`EngineCoreClient` each is an ``async`` method, on a
`SyncClient` a blocking one, with the same name, arguments and
documentation. Both clients implement ``run_named_utility(spec, args)``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    Literal,
    ParamSpec,
    Protocol,
    TypeVar,
    overload,
)

from .._exceptions import ProtocolError
from ..protocol.rules import LORA

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping, Sequence

    from ..protocol.profiles import ProtocolProfile
    from ..protocol.structs import LoRARequest

__all__ = ["FanOut", "NamedUtilities", "NamedUtility", "combine_results", "wire_args"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
FanOut = Literal["one", "all", "agree"]


# The two kinds of client, told apart by their ``run_named_utility``: the table needs no
# import of either client (each imports this module).
class _AsyncClient(Protocol):
    def run_named_utility(
        self, spec: NamedUtility[..., T], args: list[object], /
    ) -> Awaitable[T]: ...


class _SyncClient(Protocol):
    def run_named_utility(self, spec: NamedUtility[..., T], args: list[object], /) -> T: ...


@dataclass(frozen=True, slots=True)
class NamedUtility(Generic[P, R]):
    """One row of the table; a descriptor giving each client its method."""

    name: str
    fan_out: FanOut
    arguments: Callable[P, list[object]]
    combine: Callable[[list[Any]], R]

    @overload
    def __get__(self, obj: None, owner: type) -> NamedUtility[P, R]: ...

    @overload
    def __get__(self, obj: _AsyncClient, owner: type) -> Callable[P, Awaitable[R]]: ...

    @overload
    def __get__(self, obj: _SyncClient, owner: type) -> Callable[P, R]: ...

    def __get__(self, obj: object, owner: type) -> object:
        if obj is None:
            return self
        call = obj.run_named_utility  # type: ignore[attr-defined]
        spec = self

        @functools.wraps(self.arguments)
        def method(*args: P.args, **kwargs: P.kwargs) -> object:
            return call(spec, spec.arguments(*args, **kwargs))

        return method


def utility(
    fan_out: FanOut, combine: Callable[[list[Any]], R]
) -> Callable[[Callable[P, list[object]]], NamedUtility[P, R]]:
    def make(arguments: Callable[P, list[object]]) -> NamedUtility[P, R]:
        return NamedUtility(arguments.__name__, fan_out, arguments, combine)

    return make


def wire_args(
    spec: NamedUtility[Any, Any], args: list[object], profile: ProtocolProfile
) -> list[object]:
    """The arguments as the engines' release takes them (see the module documentation)."""
    arity = profile.utility_arity.get(spec.name)
    if arity is None or len(args) <= arity[1]:
        return args
    dropped = args[arity[1] :]
    if any(value is not None for value in dropped):
        raise ValueError(
            f"{spec.name}() takes at most {arity[1]} argument(s) with vLLM "
            f"{profile.vllm_version}; got values for more: {dropped!r}"
        )
    return args[: arity[1]]


def combine_results(spec: NamedUtility[Any, R], results: list[Any]) -> R:
    """Combine per-rank results (rank order); ``"agree"`` checks they are all equal."""
    if spec.fan_out == "agree" and any(r != results[0] for r in results[1:]):
        raise ProtocolError(f"engines disagree on {spec.name}: {results}")
    return spec.combine(results)


def _none(results: list[Any]) -> None:
    return None


def _first_tuple(results: list[Any]) -> tuple[str, ...]:
    return tuple(results[0])


def _first_bool(results: list[Any]) -> bool:
    return bool(results[0])


def _first_str(results: list[Any]) -> str:
    return str(results[0])


def _all_true(results: list[Any]) -> bool:
    return all(bool(r) for r in results)


def _all_awake(results: list[Any]) -> bool:
    return all(r is None or bool(r) for r in results)  # 0.25.1 returns nil


def _union(results: list[Any]) -> set[int]:
    return {lora_id for result in results for lora_id in result}


def _concat(results: list[Any]) -> list[object]:
    return [item for result in results for item in result]


def _checksums(results: list[Any]) -> list[dict[str, str]]:
    return [dict(item) for result in results for item in result]


# ---------------------------------------------------------------------- the table


@utility("one", _first_tuple)
def get_supported_tasks() -> list[object]:
    """Tasks the model supports, e.g. ``("generate",)``."""
    return []


@utility("agree", _first_bool)
def is_sleeping() -> list[object]:
    """Whether the engines sleep (all engines must agree)."""
    return []


@utility("all", _none)
def sleep(level: int = 1, mode: str = "abort") -> list[object]:
    """Put every engine to sleep (level 0 pauses, 1 offloads weights, 2 drops all)."""
    return [level, mode]


@utility("all", _all_awake)
def wake_up(tags: Sequence[str] | None = None) -> list[object]:
    """Wake every engine (``tags`` among weights/kv_cache/scheduling; None = all)."""
    return [None if tags is None else list(tags)]


@utility("all", _all_true)
def reset_prefix_cache(
    reset_running_requests: bool = False, reset_connector: bool = False
) -> list[object]:
    """Reset the prefix cache of every engine; True if all succeeded."""
    return [reset_running_requests, reset_connector]


@utility("all", _none)
def reset_mm_cache() -> list[object]:
    """Reset the multimodal cache of every engine."""
    return []


@utility("all", _none)
def reset_encoder_cache() -> list[object]:
    """Reset the encoder cache of every engine."""
    return []


@utility("all", _none)
def profile(
    is_start: bool = True,
    profile_prefix: str | None = None,
    delay_iterations: int | None = None,
    max_iterations: int | None = None,
    profiler_kwargs: Mapping[str, object] | None = None,
) -> list[object]:
    """Start or stop the torch profiler on every engine (the arguments a release does
    not take are left off: 0.25.1 takes two, 0.32.0 four, 0.33.0 five)."""
    kwargs = None if profiler_kwargs is None else dict(profiler_kwargs)
    return [is_start, profile_prefix, delay_iterations, max_iterations, kwargs]


@utility("all", _all_true)
def add_lora(lora_request: LoRARequest) -> list[object]:
    """Load a LoRA adapter on every engine (`InvalidRequestError` for a malformed one,
    before anything is sent)."""
    LORA.raise_for(lora_request, engine_only=True)
    return [lora_request]


@utility("all", _all_true)
def remove_lora(lora_id: int) -> list[object]:
    """Unload a LoRA adapter from every engine."""
    return [lora_id]


@utility("all", _union)
def list_loras() -> list[object]:
    """The LoRA ids loaded (union over engines)."""
    return []


@utility("all", _all_true)
def pin_lora(lora_id: int) -> list[object]:
    """Pin a LoRA adapter on every engine."""
    return [lora_id]


@utility("all", _none)
def pause_scheduler(mode: str = "abort", clear_cache: bool = True) -> list[object]:
    """Pause scheduling on every engine; returns once the pause completed."""
    return [mode, clear_cache]


@utility("all", _none)
def resume_scheduler() -> list[object]:
    """Resume scheduling on every engine."""
    return []


@utility("agree", _first_bool)
def is_scheduler_paused() -> list[object]:
    """Whether scheduling is paused (all engines must agree)."""
    return []


@utility("all", _concat)
def collective_rpc(
    method: str,
    timeout: float | None = None,
    args: Sequence[object] = (),
    kwargs: Mapping[str, object] | None = None,
) -> list[object]:
    """Run ``method`` on every worker of every engine; one result per worker
    (``timeout`` is the engine-side RPC timeout)."""
    return [method, timeout, list(args), None if kwargs is None else dict(kwargs)]


@utility("all", _none)
def execute_dummy_batch() -> list[object]:
    """Run a dummy batch on every engine."""
    return []


@utility("one", _none)
def save_sharded_state(
    path: str, pattern: str | None = None, max_size: int | None = None
) -> list[object]:
    """Save the model's sharded state (one engine)."""
    return [path, pattern, max_size]


@utility("agree", _first_str)
def get_weight_version() -> list[object]:
    """The engines' weight version (all must agree)."""
    return []


@utility("all", _none)
def set_weight_version(weight_version: str) -> list[object]:
    """Set the weight version label on every engine."""
    return [weight_version]


@utility("all", _checksums)
def compute_weight_checksums() -> list[object]:
    """Weight checksums, one map per worker, concatenated over engines."""
    return []


class NamedUtilities:
    """The named utilities as methods (async on the client, blocking on SyncClient)."""

    __slots__ = ()

    get_supported_tasks = get_supported_tasks
    is_sleeping = is_sleeping
    sleep = sleep
    wake_up = wake_up
    reset_prefix_cache = reset_prefix_cache
    reset_mm_cache = reset_mm_cache
    reset_encoder_cache = reset_encoder_cache
    profile = profile
    add_lora = add_lora
    remove_lora = remove_lora
    list_loras = list_loras
    pin_lora = pin_lora
    pause_scheduler = pause_scheduler
    resume_scheduler = resume_scheduler
    is_scheduler_paused = is_scheduler_paused
    collective_rpc = collective_rpc
    execute_dummy_batch = execute_dummy_batch
    save_sharded_state = save_sharded_state
    get_weight_version = get_weight_version
    set_weight_version = set_weight_version
    compute_weight_checksums = compute_weight_checksums
