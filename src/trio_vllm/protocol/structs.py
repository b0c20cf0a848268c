"""The engine-core messages as msgspec structs, mirroring vLLM's (docs/protocol.md §2-6).

Field names, order and defaults are vLLM's. Each class holds the *union* of the fields
of the supported releases, laid out as the newest release (0.33.0) does; a field that
only an older release has (``LoRARequest.tensorizer_config_dict``, 0.25.1) is appended
at the end. What a given release actually puts on the wire (array lengths, positions,
map keys) is described by its `ProtocolProfile`;
the codec converts, so code above the codec only ever sees these classes.

Every field except ``request_id`` has a default, so requests read naturally::

    EngineCoreRequest("r1", prompt_token_ids=[1, 2, 3],
                      sampling_params=SamplingParams(max_tokens=8, temperature=0))

Constructing a struct never validates; `validate_request`
(run by the codec before encoding an ADD) does.

Tensor fields hold a ``torch.Tensor``, a ``numpy.ndarray`` or a
`RawTensor`; see ``_tensors.py`` for what decoding returns.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any, ClassVar, Final

import msgspec
import numpy as np

from ._tensors import RawTensor, TensorLike

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy.typing as npt

    # For type checkers a tensor field is "anything tensor-like" (torch is optional).
    Tensor: TypeAlias = Any
    NDArray: TypeAlias = npt.NDArray[Any]
else:
    # At run time msgspec reads these annotations: the codec's dec_hook builds the values.
    Tensor = TensorLike
    NDArray = np.ndarray

__all__ = [
    "ENGINE_CORE_DEAD",
    "AbortRequests",
    "CUDAGraphStat",
    "EngineCoreDead",
    "EngineCoreEvent",
    "EngineCoreEventType",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreReadyResponse",
    "EngineCoreRequest",
    "EngineHandshakeMetadata",
    "EngineZmqAddresses",
    "FinishReason",
    "HandshakeHello",
    "HandshakeReady",
    "IterationDetails",
    "KVCacheEvictionEvent",
    "LateChunkingParams",
    "LateInteractionParams",
    "LoRARequest",
    "LogprobsLists",
    "LogprobsTensors",
    "PerfStats",
    "PoolingParams",
    "PrefillStats",
    "PrefixCacheStats",
    "RawTensor",
    "RepetitionDetectionParams",
    "RequestError",
    "RequestOutputKind",
    "RequestType",
    "SamplingMaskLists",
    "SamplingParams",
    "SchedulerStats",
    "SpecDecodingStats",
    "StartDPWave",
    "StructuredOutputsParams",
    "TensorLike",
    "UtilityCall",
    "UtilityOutput",
    "UtilityResult",
]

#: The single frame an engine sends on every output socket when it dies (§5.1).
ENGINE_CORE_DEAD: Final = b"ENGINE_CORE_DEAD"


class EngineCoreDead:
    """What decoding the ``ENGINE_CORE_DEAD`` frame returns (a singleton: test with ``is``
    or ``isinstance``). The engine is gone; fail everything that waits on it."""

    __slots__ = ()
    _instance: ClassVar[EngineCoreDead | None] = None

    def __new__(cls) -> EngineCoreDead:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "EngineCoreDead()"


class RequestType(bytes, enum.Enum):
    """First frame of every client->engine message on the input socket (§3.2)."""

    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"
    # Internal sentinels of the engine: never send these (they kill or confuse it).
    EXECUTOR_FAILED = b"\x04"
    WAKEUP = b"\x05"


class FinishReason(enum.IntEnum):
    """Why a request finished; ``str()`` gives vLLM's lowercase name (``"stop"``)."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreEventType(enum.IntEnum):
    """Per-request scheduling events (only sent when the engine logs stats)."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class RequestOutputKind(enum.IntEnum):
    """Frontend-only output mode carried in the sampling/pooling params."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# --------------------------------------------------------------------------------------
# Request side (client -> engine)
# --------------------------------------------------------------------------------------


class StructuredOutputsParams(msgspec.Struct):
    """Structured-output constraint (a map with every key). Exactly one of ``json``,
    ``regex``, ``choice``, ``grammar``, ``json_object``, ``structural_tag`` must be set,
    and ``_backend`` must name the engine's backend (§4.4)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    _backend: str | None = None
    _backend_was_auto: bool = False


class RepetitionDetectionParams(msgspec.Struct):
    """Stop a request that repeats a token pattern (finish reason REPETITION)."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


_SAMPLING_EPS: Final = 1e-5
_MIN_TEMPERATURE: Final = 1e-2


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """Generation parameters: a map that omits default values, keys in declaration order.

    Like vLLM's, construction (and decoding) normalizes: ``stop``, ``stop_token_ids`` and
    ``bad_words`` become lists, ``stop_token_ids`` are added to ``_all_stop_token_ids``,
    ``skip_reading_prefix_cache`` becomes a bool, ``seed=-1`` means no seed, greedy
    sampling (``temperature < 1e-5``) resets ``top_p``/``top_k``/``min_p`` (those in
    range: a bad value stays for validation to refuse, as vLLM refuses it), and tiny
    positive temperatures are raised to 0.01. Send ``max_tokens`` and ``temperature``
    explicitly, and ``_eos_token_id`` unless ``ignore_eos`` (docs/protocol.md §10).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    watermarking: bool | None = None
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprob_token_ids: NDArray | None = None
    prompt_logprob_start: int | None = None
    logprob_token_ids: list[int] | None = None
    flat_logprobs: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stream_interval: int | None = None
    skip_clone: bool = False
    output_text_buffer_length: int = 0
    _eos_token_id: int | None = None
    _all_stop_token_ids: set[int] = msgspec.field(default_factory=set)
    _watermarking_skipped: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    bad_words: list[str] | None = None
    _bad_words_token_ids: list[list[int]] | None = None
    skip_reading_prefix_cache: bool | None = None
    thinking_token_budget: int | None = None
    repetition_detection: RepetitionDetectionParams | None = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        # Mirrors vLLM's SamplingParams.__post_init__ so the same inputs give the same
        # bytes (the engine runs the same normalization again on decode).
        # msgspec omits a default by identity, so a value equal to the default (0.0 read
        # from JSON, an int 1) is replaced by the default object itself.
        for name, default in _FLOAT_DEFAULTS:
            value = getattr(self, name)
            if type(value) is int:
                value = float(value)
                setattr(self, name, value)
            if value == default and type(value) is float:
                setattr(self, name, default)
        if type(self.output_kind) is int and 0 <= self.output_kind <= 2:
            self.output_kind = RequestOutputKind(self.output_kind)
        if 0 < self.temperature < _MIN_TEMPERATURE:
            self.temperature = _MIN_TEMPERATURE
        if self.seed == -1:
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.bad_words is None:
            self.bad_words = []
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None
        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1
        if self.temperature < _SAMPLING_EPS:
            # vLLM checks these before greedy sampling resets them: a value out of range
            # stays, for validation to refuse as vLLM does (trio_vllm.protocol.rules).
            top_p, top_k, min_p = self.top_p, self.top_k, self.min_p
            if type(top_p) is float and 0.0 < top_p <= 1.0:
                self.top_p = _DEFAULT_TOP_P
            if type(top_k) is int and top_k >= -1:
                self.top_k = 0
            if type(min_p) is float and 0.0 <= min_p <= 1.0:
                self.min_p = _DEFAULT_MIN_P
        if self.stop_token_ids:
            self._all_stop_token_ids.update(self.stop_token_ids)
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None

    @property
    def greedy(self) -> bool:
        """Whether this is greedy sampling (temperature below 1e-5)."""
        return self.temperature < _SAMPLING_EPS


_FLOAT_DEFAULTS: Final = tuple(
    (f.name, f.default)
    for f in msgspec.structs.fields(SamplingParams)
    if f.name
    in (
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "temperature",
        "top_p",
        "min_p",
    )
)
_DEFAULT_TOP_P: Final = dict(_FLOAT_DEFAULTS)["top_p"]
_DEFAULT_MIN_P: Final = dict(_FLOAT_DEFAULTS)["min_p"]


class LateInteractionParams(msgspec.Struct, array_like=True):
    """Late-interaction (ColBERT-style) pooling options: ``[mode, query_key, query_uses]``."""

    mode: str = ""
    query_key: str | None = None
    query_uses: int | None = None


class LateChunkingParams(msgspec.Struct, array_like=True):
    """Late-chunking pooling options (0.33.0): ``[chunk_size]``."""

    chunk_size: int | None = None


class PoolingParams(msgspec.Struct, array_like=True):
    """Pooling parameters (array). ``task`` must be set to a task the model supports
    (nil or unsupported kills a stock engine, §10)."""

    use_activation: bool | None = None
    dimensions: int | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None
    task: str | None = None
    requires_token_ids: bool = False
    skip_reading_prefix_cache: bool | None = None
    late_interaction_params: LateInteractionParams | None = None
    extra_kwargs: dict[str, Any] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    late_chunking_params: LateChunkingParams | None = None  # 0.33.0+


class LoRARequest(msgspec.Struct, array_like=True):
    """A LoRA adapter for a request (array). ``lora_int_id >= 1``, ``lora_path`` non-empty.

    ``tensorizer_config_dict`` exists only in 0.25.1 (at index 4 there); it is last here
    so the 0.32.0/0.33.0 layout is a prefix of this class.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False
    is_3d_lora_weight: bool = False
    tensorizer_config_dict: dict[str, Any] | None = None  # 0.25.1 only


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """An ADD request (array, 22 positions in 0.32.0; §3.3).

    Exactly one of ``sampling_params`` (generation) and ``pooling_params`` (pooling)
    must be set. ``arrival_time`` defaults to ``time.time()`` at construction.
    ``request_id`` must be unique among the engine's live requests: the client keeps
    that promise (a duplicate kills a stock engine).
    """

    request_id: str
    prompt_token_ids: list[int] | None = None
    mm_features: list[Any] | None = None
    sampling_params: SamplingParams | None = None
    pooling_params: PoolingParams | None = None
    arrival_time: float = msgspec.field(default_factory=time.time)
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None
    data_parallel_rank: int | None = None
    prompt_embeds: Tensor | None = None
    prompt_is_token_ids: list[bool] | None = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: dict[str, str] | None = None
    resumable: bool = False
    external_req_id: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    abort_immediately: bool = False
    session_id: str | None = None  # 0.32.0+
    kv_hints: dict[str, Any] | None = None  # 0.32.0+


class AbortRequests(msgspec.Struct, gc=False):
    """A decoded ABORT (engine side): the ids to abort; unknown ids are ignored."""

    request_ids: list[str]


class UtilityCall(msgspec.Struct, array_like=True, gc=False):
    """A decoded UTILITY (engine side): ``[client_index, call_id, method, args]``."""

    client_index: int
    call_id: int
    method: str
    args: list[Any] = msgspec.field(default_factory=list)


class StartDPWave(msgspec.Struct, array_like=True, gc=False):
    """A decoded START_DP_WAVE (engine side): ``[wave, exclude_engine_index]``."""

    wave: int
    exclude_engine_index: int | None = None


# --------------------------------------------------------------------------------------
# Output side (engine -> client)
# --------------------------------------------------------------------------------------


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Sample logprobs (numpy arrays). Row r is the r-th new token: column 0 the sampled
    token, columns 1..k the top-k (§5.5)."""

    logprob_token_ids: NDArray
    logprobs: NDArray
    sampled_token_ranks: NDArray
    cu_num_generated_tokens: list[int] | None = None


class LogprobsTensors(msgspec.Struct, array_like=True, gc=False):
    """Prompt logprobs (tensors); ``cu_num_generated_tokens_tensor`` is 0.32.0+."""

    logprob_token_ids: Tensor
    logprobs: Tensor
    selected_token_ranks: Tensor
    cu_num_generated_tokens: list[int] | None = None
    cu_num_generated_tokens_tensor: Tensor | None = None  # 0.32.0+


class SamplingMaskLists(msgspec.Struct, array_like=True, gc=False):
    """Sampling mask of a step (0.32.0+): ``[token_ids, offsets, cu_num_generated_tokens]``."""

    token_ids: NDArray
    offsets: NDArray | None = None
    cu_num_generated_tokens: list[int] | None = None


class EngineCoreEvent(msgspec.Struct, gc=False):
    """A queue event of a request, stamped with the engine's monotonic clock."""

    type: EngineCoreEventType
    timestamp: float


class PrefillStats(msgspec.Struct, gc=False):
    """Prompt-token accounting of a request's first output (a map)."""

    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_local_cached_tokens: int = 0
    num_external_cached_tokens: int = 0
    num_cache_creation_tokens: int = 0  # 0.32.0+


class RequestError(msgspec.Struct, gc=False):
    """Structured error of a failed request (0.33.0): e.g. ``code="engine_paused"``."""

    code: str = ""
    message: str = ""
    retryable: bool = False


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's result of one engine step (array; 18 positions in 0.32.0, §5.3)."""

    request_id: str
    new_token_ids: list[int] = msgspec.field(default_factory=list)
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs_tensors: LogprobsTensors | None = None
    pooling_output: Tensor | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[EngineCoreEvent] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None  # 0.32.0+ (inserted at 9)
    trace_headers: dict[str, str] | None = None
    prefill_stats: PrefillStats | None = None
    routed_experts: NDArray | None = None
    num_nans_in_logits: int = 0
    mm_cache_miss_hashes: list[str] | None = None  # 0.32.0+
    new_sampling_mask: SamplingMaskLists | None = None  # 0.32.0+
    spec_decode_metrics: dict[str, Any] | None = None  # 0.32.0+
    prompt_token_id_logprobs: Tensor | None = None  # 0.32.0+
    error: RequestError | None = None  # 0.33.0+

    @property
    def finished(self) -> bool:
        """Whether this is the request's last output (``finish_reason`` is set)."""
        return self.finish_reason is not None


class UtilityResult(msgspec.Struct, array_like=True, gc=False):
    """A utility's return value as sent: ``[type_info, value]`` (§4.8).

    ``type_info`` is nil unless the engine runs with insecure serialization; the codec
    refuses non-nil type hints unless the caller allows insecure serialization.
    """

    type_info: Any = None
    result: Any = None


class UtilityOutput(msgspec.Struct, array_like=True, gc=False):
    """Reply to a utility call: ``[call_id, failure_message, result]``."""

    call_id: int
    failure_message: str | None = None
    result: UtilityResult | None = None


class PrefixCacheStats(msgspec.Struct, gc=False):
    """Prefix-cache counters of a step."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    hits_by_source: dict[str, int] = msgspec.field(default_factory=dict)  # 0.32.0+


class KVCacheEvictionEvent(msgspec.Struct, gc=False):
    """Lifetime of an evicted KV block."""

    lifetime_seconds: float = 0.0
    idle_seconds: float = 0.0
    reuse_gaps_seconds: Any = None


class SpecDecodingStats(msgspec.Struct, gc=False):
    """Speculative-decoding counters of a step."""

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)
    num_draft_tokens_per_pos: list[int] = msgspec.field(default_factory=list)


class CUDAGraphStat(msgspec.Struct, gc=False):
    """CUDA-graph padding statistics of a step."""

    num_unpadded_tokens: int = 0
    num_padded_tokens: int = 0
    num_paddings: int = 0
    runtime_mode: Any = None


class PerfStats(msgspec.Struct, gc=False):
    """Estimated FLOPs and memory traffic of a step."""

    num_flops_per_gpu: float = 0
    num_read_bytes_per_gpu: float = 0
    num_write_bytes_per_gpu: float = 0
    debug_stats: Any = None


class IterationDetails(msgspec.Struct, gc=False):
    """Per-iteration detail record (0.32.0+)."""

    iteration_index: int = 0
    num_ctx_requests: int = 0
    num_ctx_tokens: int = 0
    num_generation_requests: int = 0
    num_generation_tokens: int = 0
    elapsed_ms: float = 0.0
    num_encoder_inputs: int = 0
    num_encoder_output_tokens: int = 0
    is_dummy: bool = False


class SchedulerStats(msgspec.Struct, gc=False):
    """Scheduler snapshot/deltas of one step (a map; every key optional on decode)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_skipped_waiting_reqs: int = 0
    num_kv_fetch_reqs_by_stage: dict[str, int] = msgspec.field(default_factory=dict)
    step_counter: int = 0
    current_wave: int = 0
    kv_cache_usage: float = 0.0
    iteration_details: IterationDetails | None = None
    prefix_cache_stats: PrefixCacheStats = msgspec.field(default_factory=PrefixCacheStats)
    connector_prefix_cache_stats: PrefixCacheStats | None = None
    kv_cache_eviction_events: list[KVCacheEvictionEvent] = msgspec.field(default_factory=list)
    spec_decoding_stats: SpecDecodingStats | None = None
    kv_connector_stats: dict[str, Any] | None = None
    ec_connector_stats: dict[str, Any] | None = None
    waiting_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)
    running_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)
    cudagraph_stats: CUDAGraphStat | None = None
    perf_stats: PerfStats | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One message on the output socket (array, 9 positions in 0.32.0, §5.2)."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = msgspec.field(default_factory=time.monotonic)
    utility_output: UtilityOutput | None = None
    finished_requests: set[str] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None
    weight_version: str | None = None  # 0.32.0+


# --------------------------------------------------------------------------------------
# Startup (handshake socket and the first message on the input socket)
# --------------------------------------------------------------------------------------


class EngineCoreReadyResponse(msgspec.Struct):
    """The engine's first message on the input socket (a map; every key optional).

    ``vllm_version`` picks the protocol profile. Unknown keys are ignored. 0.25.1 sends
    10 keys, 0.32.0 25, 0.33.0 28; missing ones are ``None``.
    """

    max_model_len: int | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    dp_stats_address: str | None = None
    dtype: str | None = None
    vllm_version: str | None = None
    world_size: int | None = None
    data_parallel_size: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    decode_context_parallel_size: int | None = None
    data_parallel_rank: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    instance_id: str | None = None
    supports_lora: bool | None = None
    max_loras: int | None = None
    mamba_block_size: int | None = None
    kv_cache_size_tokens: int | None = None
    kv_cache_max_concurrency: float | None = None
    kv_events_config: dict[str, Any] | None = None
    weight_transfer_backend: str | None = None
    enable_sleep_mode: bool | None = None
    supports_draft_weight_updates: bool | None = None
    effective_attention_block_size: int | None = None
    coord_store_port: int | None = None
    coordinator_input_address: str | None = None
    coordinator_output_address: str | None = None


class HandshakeHello(msgspec.Struct):
    """``{"status": "HELLO", "local": bool, "headless": bool}`` (engine -> client)."""

    local: bool
    headless: bool
    status: str = "HELLO"


class HandshakeReady(msgspec.Struct):
    """``{"status": "READY", "local", "headless"}`` plus ``parallel_config_hash`` when
    the engine's DP size is > 1, and in 0.33.0 optional elastic-EP keys."""

    local: bool
    headless: bool
    status: str = "READY"
    parallel_config_hash: str | None = None
    coord_store_port: int | None = None
    elastic_ep_max_dp_size: int | None = None
    num_redundant_experts: int | None = None


class EngineZmqAddresses(msgspec.Struct):
    """Where an engine connects: ``inputs[i]``/``outputs[i]`` per frontend ``i``."""

    inputs: list[str]
    outputs: list[str]
    coordinator_input: str | None = None
    coordinator_output: str | None = None
    frontend_stats_publish_address: str | None = None


class EngineHandshakeMetadata(msgspec.Struct):
    """The client's reply to HELLO (§2.1)."""

    addresses: EngineZmqAddresses
    parallel_config: dict[str, Any] = msgspec.field(default_factory=dict)
