"""Per-release wire layouts (docs/protocol.md §9) and the choice of one from a version string.

vLLM's array-like structs are positional: a release that inserts a field in the middle
(0.32.0 put ``ec_transfer_params`` at index 9 of EngineCoreOutput) shifts every later
position, and a peer of another release misreads it. A `ProtocolProfile` records,
for one release, the field names of every positional struct in wire order and the keys of
the map-encoded ones. The structs in `structs` hold the union of all fields; the
codec uses the profile to write exactly the release's arrays and to read them back.

This module is the only place that knows how releases differ.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

from .._exceptions import ProtocolError

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "PROFILES",
    "V0_25_1",
    "V0_32_0",
    "V0_33_0",
    "ProtocolProfile",
    "newest_profile",
    "profile_for_version",
]


@dataclass(frozen=True)
class ProtocolProfile:
    """The wire layout of one vLLM release.

    ``layouts`` maps a positional struct's class name to its field names in wire order;
    ``map_keys`` maps a map-encoded struct's class name to its keys in declaration
    order. ``reserved_call_ids`` are the utility call ids the engine uses for its own
    notifications; ``utility_arity`` the positional-argument count limits of the
    utilities the release's own client calls; ``unavailable_utilities`` the utility
    methods its engine core lacks (a call fails with vLLM's ``AttributeError`` text).
    ``wake_up_reports_awake``: the engine's ``wake_up`` returns whether it is fully
    awake (else ``None``). ``any_rank_requests_wave``: an idle DP rank that gets work
    asks the coordinator for a new wave (else only rank 0 does, docs/protocol.md §7.4).
    ``requested_version`` is the version string this profile was chosen for (differs
    from ``vllm_version`` for a fallback).
    """

    vllm_version: str
    layouts: Mapping[str, tuple[str, ...]]
    map_keys: Mapping[str, tuple[str, ...]]
    reserved_call_ids: frozenset[int]
    utility_arity: Mapping[str, tuple[int, int]]
    requested_version: str = ""
    fallback: bool = False
    # Added after the fields above so that positional construction keeps its meaning.
    unavailable_utilities: frozenset[str] = frozenset()
    wake_up_reports_awake: bool = True
    any_rank_requests_wave: bool = False

    @property
    def version_tuple(self) -> tuple[int, int, int]:
        """``(major, minor, patch)`` of `vllm_version`."""
        return _parse(self.vllm_version) or (0, 0, 0)

    def fields(self, struct: str) -> tuple[str, ...]:
        """Wire field order (positional structs) or keys (map structs) of ``struct``."""
        if struct in self.layouts:
            return self.layouts[struct]
        return self.map_keys[struct]


# ---- field layouts ---------------------------------------------------------------------

_REQUEST_0_25: Final = (
    "request_id",
    "prompt_token_ids",
    "mm_features",
    "sampling_params",
    "pooling_params",
    "arrival_time",
    "lora_request",
    "cache_salt",
    "data_parallel_rank",
    "prompt_embeds",
    "prompt_is_token_ids",
    "client_index",
    "current_wave",
    "priority",
    "trace_headers",
    "resumable",
    "external_req_id",
    "reasoning_ended",
    "reasoning_parser_kwargs",
    "abort_immediately",
)
_REQUEST_0_32: Final = (*_REQUEST_0_25, "session_id", "kv_hints")

_OUTPUT_0_25: Final = (
    "request_id",
    "new_token_ids",
    "new_logprobs",
    "new_prompt_logprobs_tensors",
    "pooling_output",
    "finish_reason",
    "stop_reason",
    "events",
    "kv_transfer_params",
    "trace_headers",
    "prefill_stats",
    "routed_experts",
    "num_nans_in_logits",
)
_OUTPUT_0_32: Final = (
    "request_id",
    "new_token_ids",
    "new_logprobs",
    "new_prompt_logprobs_tensors",
    "pooling_output",
    "finish_reason",
    "stop_reason",
    "events",
    "kv_transfer_params",
    "ec_transfer_params",
    "trace_headers",
    "prefill_stats",
    "routed_experts",
    "num_nans_in_logits",
    "mm_cache_miss_hashes",
    "new_sampling_mask",
    "spec_decode_metrics",
    "prompt_token_id_logprobs",
)
_OUTPUT_0_33: Final = (*_OUTPUT_0_32, "error")

_OUTPUTS_0_25: Final = (
    "engine_index",
    "outputs",
    "scheduler_stats",
    "timestamp",
    "utility_output",
    "finished_requests",
    "wave_complete",
    "start_wave",
)
_OUTPUTS_0_32: Final = (*_OUTPUTS_0_25, "weight_version")

_LORA_0_25: Final = (
    "lora_name",
    "lora_int_id",
    "lora_path",
    "base_model_name",
    "tensorizer_config_dict",
    "load_inplace",
    "is_3d_lora_weight",
)
_LORA_0_32: Final = (
    "lora_name",
    "lora_int_id",
    "lora_path",
    "base_model_name",
    "load_inplace",
    "is_3d_lora_weight",
)

_POOLING_0_25: Final = (
    "use_activation",
    "dimensions",
    "step_tag_id",
    "returned_token_ids",
    "task",
    "requires_token_ids",
    "skip_reading_prefix_cache",
    "late_interaction_params",
    "extra_kwargs",
    "output_kind",
)
_POOLING_0_33: Final = (*_POOLING_0_25, "late_chunking_params")

_LP_TENSORS_0_25: Final = (
    "logprob_token_ids",
    "logprobs",
    "selected_token_ranks",
    "cu_num_generated_tokens",
)
_LP_TENSORS_0_32: Final = (*_LP_TENSORS_0_25, "cu_num_generated_tokens_tensor")
_LP_LISTS: Final = (
    "logprob_token_ids",
    "logprobs",
    "sampled_token_ranks",
    "cu_num_generated_tokens",
)
_SAMPLING_MASK: Final = ("token_ids", "offsets", "cu_num_generated_tokens")
_UTILITY_OUTPUT: Final = ("call_id", "failure_message", "result")
_LATE_INTERACTION: Final = ("mode", "query_key", "query_uses")

_SAMPLING_0_25: Final = (
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "logprob_token_ids",
    "flat_logprobs",
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "output_kind",
    "skip_clone",
    "output_text_buffer_length",
    "_eos_token_id",
    "_all_stop_token_ids",
    "structured_outputs",
    "logit_bias",
    "allowed_token_ids",
    "extra_args",
    "routed_experts_prompt_start",
    "bad_words",
    "_bad_words_token_ids",
    "skip_reading_prefix_cache",
    "thinking_token_budget",
    "repetition_detection",
)
_SAMPLING_0_32: Final = (
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "watermarking",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "prompt_logprob_token_ids",
    "prompt_logprob_start",
    "logprob_token_ids",
    "flat_logprobs",
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "output_kind",
    "stream_interval",
    "skip_clone",
    "output_text_buffer_length",
    "_eos_token_id",
    "_all_stop_token_ids",
    "_watermarking_skipped",
    "structured_outputs",
    "logit_bias",
    "allowed_token_ids",
    "extra_args",
    "bad_words",
    "_bad_words_token_ids",
    "skip_reading_prefix_cache",
    "thinking_token_budget",
    "repetition_detection",
    "routed_experts_prompt_start",
    "trace_decode_token_ids",
)

_READY_0_25: Final = (
    "max_model_len",
    "num_gpu_blocks",
    "block_size",
    "dp_stats_address",
    "dtype",
    "vllm_version",
    "world_size",
    "data_parallel_size",
    "kv_cache_size_tokens",
    "kv_cache_max_concurrency",
)
_READY_0_32: Final = (
    "max_model_len",
    "num_gpu_blocks",
    "block_size",
    "dp_stats_address",
    "dtype",
    "vllm_version",
    "world_size",
    "data_parallel_size",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "decode_context_parallel_size",
    "data_parallel_rank",
    "max_num_seqs",
    "max_num_batched_tokens",
    "instance_id",
    "supports_lora",
    "max_loras",
    "mamba_block_size",
    "kv_cache_size_tokens",
    "kv_cache_max_concurrency",
    "kv_events_config",
    "weight_transfer_backend",
    "enable_sleep_mode",
    "supports_draft_weight_updates",
    "effective_attention_block_size",
)
_READY_0_33: Final = (
    *_READY_0_32,
    "coord_store_port",
    "coordinator_input_address",
    "coordinator_output_address",
)

_STATS_0_25: Final = (
    "num_running_reqs",
    "num_waiting_reqs",
    "num_skipped_waiting_reqs",
    "step_counter",
    "current_wave",
    "kv_cache_usage",
    "prefix_cache_stats",
    "connector_prefix_cache_stats",
    "kv_cache_eviction_events",
    "spec_decoding_stats",
    "kv_connector_stats",
    "waiting_lora_adapters",
    "running_lora_adapters",
    "cudagraph_stats",
    "perf_stats",
)
_STATS_0_32: Final = (
    "num_running_reqs",
    "num_waiting_reqs",
    "num_skipped_waiting_reqs",
    "num_kv_fetch_reqs_by_stage",
    "step_counter",
    "current_wave",
    "kv_cache_usage",
    "iteration_details",
    "prefix_cache_stats",
    "connector_prefix_cache_stats",
    "kv_cache_eviction_events",
    "spec_decoding_stats",
    "kv_connector_stats",
    "ec_connector_stats",
    "waiting_lora_adapters",
    "running_lora_adapters",
    "cudagraph_stats",
    "perf_stats",
)
_PREFIX_0_25: Final = (
    "reset",
    "requests",
    "queries",
    "hits",
    "preempted_requests",
    "preempted_queries",
    "preempted_hits",
)
_PREFIX_0_32: Final = (*_PREFIX_0_25, "hits_by_source")
_PREFILL_0_25: Final = (
    "num_prompt_tokens",
    "num_computed_tokens",
    "num_cached_tokens",
    "num_local_cached_tokens",
    "num_external_cached_tokens",
)
_PREFILL_0_32: Final = (*_PREFILL_0_25, "num_cache_creation_tokens")

# Utilities vLLM's own client calls: name -> (min, max) positional arguments.
_UTILITIES_0_32: Final = {
    "get_supported_tasks": (0, 0),
    "profile": (0, 4),
    "reset_mm_cache": (0, 0),
    "reset_prefix_cache": (0, 2),
    "reset_encoder_cache": (0, 0),
    "sleep": (0, 2),
    "wake_up": (0, 1),
    "is_sleeping": (0, 0),
    "release_kv_cache_memory": (0, 0),
    "execute_dummy_batch": (0, 0),
    "add_lora": (1, 1),
    "remove_lora": (1, 1),
    "list_loras": (0, 0),
    "pin_lora": (1, 1),
    "save_sharded_state": (1, 3),
    "collective_rpc": (1, 4),
    "pause_scheduler": (0, 2),
    "resume_scheduler": (0, 0),
    "is_scheduler_paused": (0, 0),
    "set_weight_version": (1, 1),
    "get_weight_version": (0, 0),
    "compute_weight_checksums": (0, 0),
    "reinitialize_distributed": (1, 1),
    "commit_prepared_elastic_ep": (0, 0),
    "handle_fault_tolerance": (1, 1),
    "get_kv_cache_group_metadata": (0, 0),
}
_UTILITIES_0_25: Final = {
    name: arity
    for name, arity in _UTILITIES_0_32.items()
    if name
    not in {
        "release_kv_cache_memory",
        "compute_weight_checksums",
        "set_weight_version",
        "get_weight_version",
        "commit_prepared_elastic_ep",
    }
} | {"profile": (0, 2), "eep_handle_engine_core_notification": (1, 1)}
_UTILITIES_0_33: Final = _UTILITIES_0_32 | {"profile": (0, 5), "pause_generation": (0, 2)}

# Engine-core utility methods a release's engine does not have yet.
_UNAVAILABLE_0_32: Final = frozenset({"pause_generation"})
_UNAVAILABLE_0_25: Final = _UNAVAILABLE_0_32 | {
    "release_kv_cache_memory",
    "compute_weight_checksums",
    "set_weight_version",
    "get_weight_version",
    "commit_prepared_elastic_ep",
}


def _profile(
    version: str,
    *,
    request: tuple[str, ...],
    output: tuple[str, ...],
    outputs: tuple[str, ...],
    lora: tuple[str, ...],
    pooling: tuple[str, ...],
    lp_tensors: tuple[str, ...],
    sampling: tuple[str, ...],
    ready: tuple[str, ...],
    stats: tuple[str, ...],
    prefix: tuple[str, ...],
    prefill: tuple[str, ...],
    reserved: frozenset[int],
    utilities: Mapping[str, tuple[int, int]],
    unavailable: frozenset[str],
    wake_up_reports_awake: bool = True,
    any_rank_requests_wave: bool = False,
) -> ProtocolProfile:
    layouts = {
        "EngineCoreRequest": request,
        "EngineCoreOutput": output,
        "EngineCoreOutputs": outputs,
        "LoRARequest": lora,
        "PoolingParams": pooling,
        "LogprobsTensors": lp_tensors,
        "LogprobsLists": _LP_LISTS,
        "SamplingMaskLists": _SAMPLING_MASK,
        "UtilityOutput": _UTILITY_OUTPUT,
        "LateInteractionParams": _LATE_INTERACTION,
    }
    map_keys = {
        "SamplingParams": sampling,
        "EngineCoreReadyResponse": ready,
        "SchedulerStats": stats,
        "PrefixCacheStats": prefix,
        "PrefillStats": prefill,
    }
    return ProtocolProfile(
        vllm_version=version,
        layouts=MappingProxyType(layouts),
        map_keys=MappingProxyType(map_keys),
        reserved_call_ids=reserved,
        utility_arity=MappingProxyType(dict(utilities)),
        unavailable_utilities=unavailable,
        wake_up_reports_awake=wake_up_reports_awake,
        any_rank_requests_wave=any_rank_requests_wave,
        requested_version=version,
    )


V0_25_1: Final = _profile(
    "0.25.1",
    request=_REQUEST_0_25,
    output=_OUTPUT_0_25,
    outputs=_OUTPUTS_0_25,
    lora=_LORA_0_25,
    pooling=_POOLING_0_25,
    lp_tensors=_LP_TENSORS_0_25,
    sampling=_SAMPLING_0_25,
    ready=_READY_0_25,
    stats=_STATS_0_25,
    prefix=_PREFIX_0_25,
    prefill=_PREFILL_0_25,
    reserved=frozenset({-1}),
    utilities=_UTILITIES_0_25,
    unavailable=_UNAVAILABLE_0_25,
    wake_up_reports_awake=False,
)
V0_32_0: Final = _profile(
    "0.32.0",
    request=_REQUEST_0_32,
    output=_OUTPUT_0_32,
    outputs=_OUTPUTS_0_32,
    lora=_LORA_0_32,
    pooling=_POOLING_0_25,
    lp_tensors=_LP_TENSORS_0_32,
    sampling=_SAMPLING_0_32,
    ready=_READY_0_32,
    stats=_STATS_0_32,
    prefix=_PREFIX_0_32,
    prefill=_PREFILL_0_32,
    reserved=frozenset({-1, -2}),
    utilities=_UTILITIES_0_32,
    unavailable=_UNAVAILABLE_0_32,
)
V0_33_0: Final = _profile(
    "0.33.0",
    request=_REQUEST_0_32,
    output=_OUTPUT_0_33,
    outputs=_OUTPUTS_0_32,
    lora=_LORA_0_32,
    pooling=_POOLING_0_33,
    lp_tensors=_LP_TENSORS_0_32,
    sampling=_SAMPLING_0_32,
    ready=_READY_0_33,
    stats=_STATS_0_32,
    prefix=_PREFIX_0_32,
    prefill=_PREFILL_0_32,
    reserved=frozenset({-1, -2}),
    utilities=_UTILITIES_0_33,
    unavailable=frozenset(),
    any_rank_requests_wave=True,
)

#: Every known profile by its release string, oldest first.
PROFILES: Final[Mapping[str, ProtocolProfile]] = MappingProxyType(
    {p.vllm_version: p for p in (V0_25_1, V0_32_0, V0_33_0)}
)

_VERSION_RE: Final = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.+\-_a-zA-Z0-9]*)\s*$")
_warned: set[str] = set()


def _parse(version: str) -> tuple[int, int, int] | None:
    m = _VERSION_RE.match(version)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def newest_profile() -> ProtocolProfile:
    """The profile of the newest release we know (0.33.0)."""
    return V0_33_0


def profile_for_version(vllm_version: str) -> ProtocolProfile:
    """Pick the profile for an engine's ``vllm_version`` (from its ready response).

    * A known release, or another build of the same ``major.minor`` (``0.32.0+cu128``,
      ``0.33.0rc1``, a patch release), gets that release's profile.
    * A release newer than every known one gets the newest profile, with a
      ``RuntimeWarning`` once per version string: such engines usually only append
      fields, which the decoder tolerates (extra trailing array elements and unknown map
      keys are ignored).
    * Anything else (an older or in-between release whose layout we have not verified,
      or a string that is not a version) raises `ProtocolError`:
      guessing a positional layout silently corrupts every message.
    """
    if not isinstance(vllm_version, str):
        raise ProtocolError(f"vllm_version must be a str, got {type(vllm_version).__name__}")
    parsed = _parse(vllm_version)
    if parsed is None:
        raise ProtocolError(f"cannot read vLLM version {vllm_version!r}: expected e.g. '0.32.0'")
    for profile in PROFILES.values():
        if profile.version_tuple[:2] == parsed[:2]:
            if vllm_version == profile.vllm_version:
                return profile
            return _variant(profile, vllm_version, fallback=False)
    newest = newest_profile()
    if parsed > newest.version_tuple:
        if vllm_version not in _warned:
            _warned.add(vllm_version)
            warnings.warn(
                f"vLLM {vllm_version} is newer than every release trio-vllm knows; using the "
                f"{newest.vllm_version} wire layout. Check it with `trio-vllm wire check` "
                "on vectors captured from that release.",
                RuntimeWarning,
                stacklevel=2,
            )
        return _variant(newest, vllm_version, fallback=True)
    known = ", ".join(PROFILES)
    raise ProtocolError(
        f"vLLM {vllm_version} is not supported: its wire layout is unknown (known releases: "
        f"{known}; newer releases fall back to {newest.vllm_version})"
    )


def _variant(profile: ProtocolProfile, requested: str, *, fallback: bool) -> ProtocolProfile:
    return dataclasses.replace(profile, requested_version=requested, fallback=fallback)
