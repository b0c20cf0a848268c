"""Frames <-> messages, for both ends of the input and output sockets (sans-I/O).

* `ClientCodec` (the frontend): encodes ADD / ABORT / UTILITY / START_DP_WAVE into
  the frames that follow the routing identity, ``[type byte][main][aux...]``, and decodes
  what arrives on the output socket (``[main][aux...]`` or the single
  ``ENGINE_CORE_DEAD`` frame) into `EngineCoreOutputs`.
* `EngineCodec` (an engine, e.g. the reference engine): the mirror image.
* Module functions for the startup messages: the ready response and the handshake's
  HELLO, init metadata and READY.

Both codecs are built for one `ProtocolProfile` and build their msgspec
encoders/decoders once; reuse them. They are not thread-safe (one call at a time), and
never block or await.

Errors: every decoding failure raises `ProtocolError` (or its subclass
`InsecureSerializationError` for a pickle payload that was not allowed),
naming the message and what was wrong; never another exception type. Encoding a request
that would break a stock engine raises ``ValueError`` before any byte is produced (see
`validation`).

Zero copy: frames may be ``bytes``, ``memoryview``, ``bytearray`` or objects exposing
``.buffer`` or the buffer protocol (``zmq.Frame``). Arrays and tensors that arrive in aux
frames are views of those frames, not copies. Encoded aux frames are views of the
arrays/tensors passed in: do not modify those until the frames are sent.
"""

from __future__ import annotations

import operator
import pickle
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeAlias

import msgspec
import numpy as np

from .._exceptions import InsecureSerializationError, ProtocolError
from . import _tensors
from ._tensors import RawTensor, TensorLike, tensor_parts
from .profiles import ProtocolProfile, newest_profile
from .structs import (
    ENGINE_CORE_DEAD,
    AbortRequests,
    EngineCoreDead,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineHandshakeMetadata,
    HandshakeHello,
    HandshakeReady,
    LogprobsTensors,
    LoRARequest,
    PoolingParams,
    PrefillStats,
    PrefixCacheStats,
    RequestType,
    SamplingParams,
    SchedulerStats,
    StartDPWave,
    UtilityCall,
)
from .validation import validate_request

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

__all__ = [
    "DEFAULT_INLINE_THRESHOLD",
    "BufferFrame",
    "ClientCodec",
    "EngineCodec",
    "Frame",
    "InputMessage",
    "OutgoingFrame",
    "decode_handshake_metadata",
    "decode_hello",
    "decode_ready",
    "decode_ready_response",
    "encode_handshake_metadata",
    "encode_hello",
    "encode_ready",
    "encode_ready_response",
]

#: vLLM's ``VLLM_MSGPACK_ZERO_COPY_THRESHOLD``: tensors smaller than this travel inline.
DEFAULT_INLINE_THRESHOLD: Final = 256


class BufferFrame(Protocol):
    """A received frame that shows its bytes as ``.buffer`` (pyzmq's ``zmq.Frame``)."""

    @property
    def buffer(self) -> memoryview: ...


#: A received frame: bytes-like, or an object with ``.buffer`` (``zmq.Frame``). Other
#: objects with the buffer protocol are read too (the type system cannot name them).
Frame: TypeAlias = bytes | bytearray | memoryview | BufferFrame
#: An encoded frame: bytes, or a memoryview of an array/tensor (aux frames).
OutgoingFrame: TypeAlias = bytes | memoryview
#: What `EngineCodec.decode_input` returns.
InputMessage: TypeAlias = EngineCoreRequest | AbortRequests | UtilityCall | StartDPWave

_EXT_PICKLE: Final = 1
_EXT_CLOUDPICKLE: Final = 2
_EXT_RAW_VIEW: Final = 3
_DEAD: Final = EngineCoreDead()
_TYPE_BYTES: Final = {t.value: t for t in RequestType}
# Plain bytes of the request types (Enum.value is a slow property on the hot path).
_ADD: Final = bytes(RequestType.ADD.value)
_ABORT: Final = bytes(RequestType.ABORT.value)
_UTILITY: Final = bytes(RequestType.UTILITY.value)
_START_DP_WAVE: Final = bytes(RequestType.START_DP_WAVE.value)
_NO_AUX: Final[list[memoryview]] = []


_buf: Final = _tensors.as_buffer
_REQUIRED_REQUEST_FIELDS: Final = 9


def _array_length(buf: Any) -> int | None:
    """The length of a msgpack array at the start of ``buf`` (None if not an array)."""
    if len(buf) == 0:
        return None
    head = buf[0]
    if 0x90 <= head <= 0x9F:
        return int(head & 0x0F)
    if head == 0xDC and len(buf) >= 3:
        return int.from_bytes(bytes(buf[1:3]), "big")
    if head == 0xDD and len(buf) >= 5:
        return int.from_bytes(bytes(buf[1:5]), "big")
    return None


def _positional(args: object) -> bool:
    return isinstance(args, (list, tuple))


def _nonempty_str(x: object) -> bool:
    return isinstance(x, str) and bool(x)


# ---- per-profile layout conversion ------------------------------------------------------


def _names(cls: type[msgspec.Struct]) -> tuple[str, ...]:
    return tuple(f.name for f in msgspec.structs.fields(cls))


def _index_map(cls: type[msgspec.Struct], layout: tuple[str, ...]) -> tuple[int, ...] | None:
    """Indices into ``astuple(obj)`` giving ``layout``; None when layout == all fields."""
    names = _names(cls)
    if layout == names:
        return None
    return tuple(names.index(n) for n in layout)


def _is_prefix(cls: type[msgspec.Struct], layout: tuple[str, ...]) -> bool:
    """Whether ``cls`` can decode ``layout`` directly (same leading positions)."""
    return _names(cls)[: len(layout)] == layout


def _wire_class(
    cls: type[msgspec.Struct],
    layout: tuple[str, ...],
    *,
    name: str,
    overrides: dict[str, Any] | None = None,
    array_like: bool = True,
    omit_defaults: bool = False,
) -> type[msgspec.Struct]:
    """A struct class with ``layout``'s fields (types and defaults taken from ``cls``)."""
    info = {f.name: f for f in msgspec.structs.fields(cls)}
    fields: list[tuple[str, Any, Any]] = []
    for fname in layout:
        f = info[fname]
        tp = (overrides or {}).get(fname, f.type)
        if f.default is not msgspec.NODEFAULT:
            fields.append((fname, tp, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((fname, tp, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((fname, tp, msgspec.NODEFAULT))
    # msgspec wants required fields first; positional layouts of vLLM already are.
    spec: list[str | tuple[str, Any] | tuple[str, Any, Any]] = [
        (n, t) if d is msgspec.NODEFAULT else (n, t, d) for n, t, d in fields
    ]
    return msgspec.defstruct(
        name, spec, array_like=array_like, omit_defaults=omit_defaults, gc=False
    )


def _map_class(
    cls: type[msgspec.Struct],
    keys: tuple[str, ...],
    version: str,
    *,
    force: bool = False,
    omit_defaults: bool = False,
) -> type[msgspec.Struct] | None:
    """The wire class of a map-encoded struct in a release whose keys are ``keys``;
    ``None`` when they are the canonical class's own (and not ``force``)."""
    if keys == _names(cls) and not force:
        return None
    return _wire_class(
        cls,
        keys,
        name=f"{cls.__name__}_{version}",
        array_like=False,
        omit_defaults=omit_defaults,
    )


def _array_class(
    cls: type[msgspec.Struct],
    layout: tuple[str, ...],
    version: str,
    *,
    force: bool = False,
    overrides: dict[str, Any] | None = None,
) -> type[msgspec.Struct] | None:
    """The wire class of an array-encoded struct in a release whose positions are
    ``layout``; ``None`` when the canonical class decodes it as it is (a prefix of its
    fields: appended fields only) and not ``force``."""
    if _is_prefix(cls, layout) and not force:
        return None
    return _wire_class(cls, layout, name=f"{cls.__name__}_{version}", overrides=overrides)


def _positions(cls: type[msgspec.Struct]) -> dict[str, int]:
    return {name: i for i, name in enumerate(_names(cls))}


_REQ: Final = _positions(EngineCoreRequest)
_OUT: Final = _positions(EngineCoreOutput)
_OUTS: Final = _positions(EngineCoreOutputs)


class _Layouts:
    """Everything a codec needs to speak one profile's layouts (built once per profile)."""

    def __init__(self, profile: ProtocolProfile) -> None:
        self.profile = profile
        lay = profile.layouts
        self.request_len = len(lay["EngineCoreRequest"])
        self.request_idx = _index_map(EngineCoreRequest, lay["EngineCoreRequest"])
        self.output_idx = _index_map(EngineCoreOutput, lay["EngineCoreOutput"])
        # One C call per plain output for older layouts: a tuple encodes as the same
        # msgpack array as the list built by index (engine-side hot path).
        self.output_get = (
            operator.itemgetter(*self.output_idx)
            if self.output_idx is not None and len(self.output_idx) > 1
            else None
        )
        self.outputs_idx = _index_map(EngineCoreOutputs, lay["EngineCoreOutputs"])
        self.lora_idx = _index_map(LoRARequest, lay["LoRARequest"])
        self.pooling_idx = _index_map(PoolingParams, lay["PoolingParams"])
        self.lp_tensors_idx = _index_map(LogprobsTensors, lay["LogprobsTensors"])
        # Map-encoded structs whose keys differ in this release get a wire class of
        # their own (encoding; the engine side writes older stats records).
        version = profile.vllm_version
        keys = profile.map_keys
        self.sampling_keys = keys["SamplingParams"]
        self.sampling_cls = _map_class(
            SamplingParams, self.sampling_keys, version, omit_defaults=True
        )
        self.prefix_keys = keys["PrefixCacheStats"]
        self.prefix_cls = _map_class(PrefixCacheStats, self.prefix_keys, version)
        self.stats_keys = keys["SchedulerStats"]
        # A stats record holds prefix records: their wire class needs its own.
        self.stats_cls = _map_class(
            SchedulerStats, self.stats_keys, version, force=self.prefix_cls is not None
        )
        self.prefill_keys = keys["PrefillStats"]
        self.prefill_cls = _map_class(PrefillStats, self.prefill_keys, version)

        # Decoding: the canonical classes read every layout that is a prefix of theirs
        # (appended fields only). Otherwise decode into generated wire classes and convert.
        self.lora_wire = _array_class(LoRARequest, lay["LoRARequest"], version)
        self.request_wire = _array_class(
            EngineCoreRequest,
            lay["EngineCoreRequest"],
            version,
            force=self.lora_wire is not None,
            overrides={} if self.lora_wire is None else {"lora_request": self.lora_wire | None},
        )
        self._output_from_wire = _positional_converter(EngineCoreOutput, lay["EngineCoreOutput"])
        self._outputs_names = lay["EngineCoreOutputs"]
        self.output_wire = _array_class(EngineCoreOutput, lay["EngineCoreOutput"], version)
        self.outputs_wire: type[msgspec.Struct] | None = None
        if self.output_wire is not None:
            self.outputs_wire = _array_class(
                EngineCoreOutputs,
                lay["EngineCoreOutputs"],
                version,
                force=True,
                overrides={"outputs": list[self.output_wire]},  # type: ignore[name-defined]
            )

    # -- canonical -> wire (encoding) --

    def lora(self, lora: LoRARequest) -> Any:
        if self.lora_idx is None:
            return lora
        values = msgspec.structs.astuple(lora)
        return [values[i] for i in self.lora_idx]

    def pooling(self, params: PoolingParams) -> Any:
        if self.pooling_idx is None:
            return params
        values = msgspec.structs.astuple(params)
        return [values[i] for i in self.pooling_idx]

    def sampling(self, params: SamplingParams) -> Any:
        if self.sampling_cls is None:
            return params
        return self.sampling_cls(**{k: getattr(params, k) for k in self.sampling_keys})

    def _prefix(self, stats: PrefixCacheStats | None) -> Any:
        if stats is None or self.prefix_cls is None:
            return stats
        return self.prefix_cls(**{k: getattr(stats, k) for k in self.prefix_keys})

    def scheduler_stats(self, stats: SchedulerStats) -> Any:
        if self.stats_cls is None:
            return stats
        values = {k: getattr(stats, k) for k in self.stats_keys}
        for key in ("prefix_cache_stats", "connector_prefix_cache_stats"):
            if key in values:
                values[key] = self._prefix(values[key])
        return self.stats_cls(**values)

    def lp_tensors(self, lp: LogprobsTensors) -> Any:
        lp = _torch_layout_fields(
            lp,
            (
                "logprob_token_ids",
                "logprobs",
                "selected_token_ranks",
                "cu_num_generated_tokens_tensor",
            ),
        )
        if self.lp_tensors_idx is None:
            return lp
        values = msgspec.structs.astuple(lp)
        return [values[i] for i in self.lp_tensors_idx]

    def request(self, req: EngineCoreRequest) -> Any:
        sp, pp, lora, embeds = (
            req.sampling_params,
            req.pooling_params,
            req.lora_request,
            req.prompt_embeds,
        )
        convert = (
            self.request_idx is not None
            or (sp is not None and self.sampling_cls is not None)
            or (pp is not None and self.pooling_idx is not None)
            or (lora is not None and self.lora_idx is not None)
            or (embeds is not None and isinstance(embeds, np.ndarray))
        )
        if not convert:
            return req
        values = list(msgspec.structs.astuple(req))
        if sp is not None:
            values[_REQ["sampling_params"]] = self.sampling(sp)
        if pp is not None:
            values[_REQ["pooling_params"]] = self.pooling(pp)
        if lora is not None:
            values[_REQ["lora_request"]] = self.lora(lora)
        if isinstance(embeds, np.ndarray):
            values[_REQ["prompt_embeds"]] = _as_torch_layout(embeds)
        if self.request_idx is not None:
            return [values[i] for i in self.request_idx]
        return values

    def output(self, out: EngineCoreOutput) -> Any:
        lp = out.new_prompt_logprobs_tensors
        pooled = out.pooling_output
        scored = out.prompt_token_id_logprobs
        prefill = out.prefill_stats
        special = (
            lp is not None
            or isinstance(pooled, np.ndarray)
            or isinstance(scored, np.ndarray)
            or (prefill is not None and self.prefill_cls is not None)
        )
        if not special:
            if self.output_idx is None:
                return out
            if self.output_get is not None:
                return self.output_get(msgspec.structs.astuple(out))
        values = list(msgspec.structs.astuple(out))
        if lp is not None:
            values[_OUT["new_prompt_logprobs_tensors"]] = self.lp_tensors(lp)
        if isinstance(pooled, np.ndarray):
            values[_OUT["pooling_output"]] = _as_torch_layout(pooled)
        if isinstance(scored, np.ndarray):
            values[_OUT["prompt_token_id_logprobs"]] = _as_torch_layout(scored)
        if prefill is not None and self.prefill_cls is not None:
            values[_OUT["prefill_stats"]] = self.prefill_cls(
                **{k: getattr(prefill, k) for k in self.prefill_keys}
            )
        if self.output_idx is None:
            return values
        return [values[i] for i in self.output_idx]

    def outputs(self, outs: EngineCoreOutputs) -> Any:
        converted = [self.output(o) for o in outs.outputs]
        same = all(c is o for c, o in zip(converted, outs.outputs, strict=True))
        stats = outs.scheduler_stats
        convert_stats = stats is not None and self.stats_cls is not None
        if self.outputs_idx is None and same and not convert_stats:
            return outs
        values = list(msgspec.structs.astuple(outs))
        values[_OUTS["outputs"]] = converted
        if stats is not None and convert_stats:
            values[_OUTS["scheduler_stats"]] = self.scheduler_stats(stats)
        if self.outputs_idx is None:
            return values
        return [values[i] for i in self.outputs_idx]

    # -- wire -> canonical (decoding, only for non-prefix layouts) --

    def lora_from_wire(self, wire: Any) -> LoRARequest:
        return LoRARequest(**msgspec.structs.asdict(wire))

    def request_from_wire(self, wire: Any) -> EngineCoreRequest:
        kwargs = msgspec.structs.asdict(wire)
        if kwargs.get("lora_request") is not None and self.lora_wire is not None:
            kwargs["lora_request"] = self.lora_from_wire(kwargs["lora_request"])
        return EngineCoreRequest(**kwargs)

    def outputs_from_wire(self, wire: Any) -> EngineCoreOutputs:
        convert = self._output_from_wire
        if convert is None:
            return self._outputs_from_wire_slow(wire)
        astuple = msgspec.structs.astuple
        outputs = [convert(astuple(o)) for o in wire.outputs]
        return EngineCoreOutputs(
            **{k: getattr(wire, k) for k in self._outputs_names if k != "outputs"},
            outputs=outputs,
        )

    def _outputs_from_wire_slow(self, wire: Any) -> EngineCoreOutputs:
        kwargs = msgspec.structs.asdict(wire)
        kwargs["outputs"] = [
            EngineCoreOutput(**msgspec.structs.asdict(o)) for o in kwargs["outputs"]
        ]
        return EngineCoreOutputs(**kwargs)


def _positional_converter(
    cls: type[msgspec.Struct], layout: tuple[str, ...]
) -> Callable[[tuple[Any, ...]], Any] | None:
    """``astuple(wire) -> cls`` by position, in C where possible (hot path of old releases).

    Canonical fields missing from ``layout`` before its last field must default to None
    (they are filled from an appended None); otherwise returns None (use kwargs).
    """
    names = _names(cls)
    info = {f.name: f for f in msgspec.structs.fields(cls)}
    wire_pos = {n: i for i, n in enumerate(layout)}
    last = max(names.index(n) for n in layout)
    indices: list[int] = []
    for name in names[: last + 1]:
        if name in wire_pos:
            indices.append(wire_pos[name])
        elif info[name].default is None:
            indices.append(len(layout))  # the appended None
        else:
            return None
    getter = operator.itemgetter(*indices)
    pad = (None,)

    def convert(values: tuple[Any, ...]) -> Any:
        return cls(*getter(values + pad))

    return convert


def _as_torch_layout(arr: np.ndarray[Any, Any]) -> RawTensor:
    """An ndarray in a field vLLM declares as ``torch.Tensor``: spell its dtype the torch way."""
    name, shape, data = tensor_parts(arr, torch_layout=True)
    return RawTensor(name, tuple(shape), data)


def _torch_layout_fields(obj: Any, names: Iterable[str]) -> Any:
    changes = {
        n: _as_torch_layout(v) for n in names if isinstance(v := getattr(obj, n), np.ndarray)
    }
    return msgspec.structs.replace(obj, **changes) if changes else obj


_layout_cache: dict[tuple[str, int, int], _Layouts] = {}


def _layouts_for(profile: ProtocolProfile) -> _Layouts:
    key = (profile.vllm_version, id(profile.layouts), id(profile.map_keys))
    layouts = _layout_cache.get(key)
    if layouts is None:
        layouts = _layout_cache[key] = _Layouts(profile)
    return layouts


# ---- shared encoder / decoder machinery -------------------------------------------------


class _CodecBase:
    def __init__(
        self,
        profile: ProtocolProfile | None,
        *,
        allow_insecure_serialization: bool,
        inline_threshold: int,
    ) -> None:
        self.profile = profile if profile is not None else newest_profile()
        self.allow_insecure_serialization = allow_insecure_serialization
        self.inline_threshold = inline_threshold
        self._layouts = _layouts_for(self.profile)
        self._aux_in = _tensors.AuxFrames()
        self._dec_hook = _tensors.make_dec_hook(self._aux_in)
        self._aux_out: list[memoryview] = _NO_AUX
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    # msgspec hooks -------------------------------------------------------------------

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            torch_layout = False
        elif isinstance(obj, (RawTensor, TensorLike)) or _tensors.is_torch_tensor(obj):
            torch_layout = True
        else:
            raise TypeError(f"cannot encode objects of type {type(obj).__name__}")
        name, shape, data = tensor_parts(obj, torch_layout=torch_layout)
        scalar = isinstance(obj, np.ndarray) and obj.ndim == 0
        if data.nbytes < self.inline_threshold or scalar:
            return [name, shape, msgspec.msgpack.Ext(_EXT_RAW_VIEW, data.tobytes())]
        self._aux_out.append(data)
        return [name, shape, len(self._aux_out)]

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == _EXT_RAW_VIEW:
            return data
        if code in (_EXT_PICKLE, _EXT_CLOUDPICKLE):
            if not self.allow_insecure_serialization:
                kind = "pickle" if code == _EXT_PICKLE else "cloudpickle"
                raise InsecureSerializationError(
                    f"refusing a {kind} payload (msgpack extension type {code}); pass "
                    "allow_insecure_serialization=True only for engines you fully trust"
                )
            return pickle.loads(data)
        raise ValueError(f"msgpack extension type {code} is not supported")

    def _decoder(self, tp: Any) -> msgspec.msgpack.Decoder[Any]:
        return msgspec.msgpack.Decoder(tp, dec_hook=self._dec_hook, ext_hook=self._ext_hook)

    def _encode(self, kind: bytes | None, message: Any) -> list[OutgoingFrame]:
        aux: list[memoryview] = []
        self._aux_out = aux
        try:
            main = self._encoder.encode(message)
        finally:
            self._aux_out = _NO_AUX
        if kind is None:
            return [main, *aux] if aux else [main]
        return [kind, main, *aux] if aux else [kind, main]

    def _fail(self, what: str, exc: BaseException) -> ProtocolError:
        if isinstance(exc, ProtocolError):
            return exc
        detail = str(exc) or type(exc).__name__
        return ProtocolError(
            f"cannot decode {what} (vLLM {self.profile.vllm_version} layout): {detail}"
        )


class ClientCodec(_CodecBase):
    """The frontend's codec for one engine protocol profile.

    ``allow_insecure_serialization`` accepts pickle/cloudpickle extension payloads and
    typed utility results (only for engines you fully trust: unpickling runs code).
    ``inline_threshold`` is the size below which tensors are sent inline (vLLM: 256).
    """

    def __init__(
        self,
        profile: ProtocolProfile | None = None,
        *,
        allow_insecure_serialization: bool = False,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
    ) -> None:
        super().__init__(
            profile,
            allow_insecure_serialization=allow_insecure_serialization,
            inline_threshold=inline_threshold,
        )
        layouts = self._layouts
        self._outputs_from_wire: Callable[[Any], EngineCoreOutputs] | None = None
        if layouts.outputs_wire is not None:
            self._outputs_decoder = self._decoder(layouts.outputs_wire)
            self._outputs_from_wire = layouts.outputs_from_wire
        else:
            self._outputs_decoder = self._decoder(EngineCoreOutputs)

    # ---- encoding (client -> engine) ----------------------------------------------------

    def encode_add(
        self, request: EngineCoreRequest, *, validate: bool = True
    ) -> list[OutgoingFrame]:
        """``[ADD][EngineCoreRequest][aux...]`` for ``request``.

        Validates first (``ValueError`` for anything that would wedge or kill a stock
        engine, docs/protocol.md §3.7/§10; see `validate_request`). Uniqueness of
        ``request_id`` among live requests is the caller's to guarantee.
        """
        if not isinstance(request, EngineCoreRequest):
            raise TypeError(f"expected an EngineCoreRequest, got {type(request).__name__}")
        if validate:
            validate_request(request, profile=self.profile)
        try:
            return self._encode(_ADD, self._layouts.request(request))
        except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
            raise ValueError(f"request {request.request_id!r} cannot be encoded: {exc}") from exc

    def encode_abort(self, request_ids: Sequence[str]) -> list[OutgoingFrame]:
        """``[ABORT][[id, ...]]``. Aborting produces no output; finish the requests locally."""
        if isinstance(request_ids, str):
            raise TypeError("request_ids must be a sequence of str, not a str")
        ids = list(request_ids)
        for rid in ids:
            if not isinstance(rid, str):
                raise TypeError(f"request ids must be str, got {type(rid).__name__}")
        return self._encode(_ABORT, ids)

    def encode_utility(
        self,
        client_index: int,
        call_id: int,
        method: str,
        args: Sequence[object] = (),
        *,
        check_arity: bool = False,
    ) -> list[OutgoingFrame]:
        """``[UTILITY][[client_index, call_id, method, args]]``.

        ``call_id`` must be an int other than the reserved engine notification ids
        (-1, -2) and fit int64/uint64. Struct arguments (``LoRARequest``, ...) are written
        in this profile's layout. With ``check_arity``, the argument count of the utilities
        the release's own client calls is checked against that release (a 4-argument
        ``profile`` fails on 0.25.1). ``ValueError`` for bad arguments; nothing checks
        that the engine has ``method`` (an unknown one fails the call, not the engine).
        """
        if type(client_index) is not int or client_index < 0:
            raise ValueError(f"client_index must be a non-negative int, got {client_index!r}")
        if type(call_id) is not int or not -(1 << 63) <= call_id < (1 << 64):
            raise ValueError(f"call_id must be an int in [-2**63, 2**64), got {call_id!r}")
        if call_id in self.profile.reserved_call_ids:
            raise ValueError(f"call_id {call_id} is reserved for engine notifications")
        if not _nonempty_str(method):
            raise ValueError(f"method must be a non-empty str, got {method!r}")
        if not _positional(args):
            raise ValueError("args must be a sequence of positional arguments")
        arity = self.profile.utility_arity.get(method) if check_arity else None
        if arity is not None and not arity[0] <= len(args) <= arity[1]:
            low, high = arity
            raise ValueError(
                f"{method} takes {low}..{high} positional arguments on vLLM "
                f"{self.profile.vllm_version}, got {len(args)}"
            )
        wire_args = [self._utility_arg(a) for a in args]
        try:
            return self._encode(_UTILITY, [client_index, call_id, method, wire_args])
        except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
            raise ValueError(f"utility {method!r} arguments cannot be encoded: {exc}") from exc

    def _utility_arg(self, arg: Any) -> Any:
        if isinstance(arg, LoRARequest):
            return self._layouts.lora(arg)
        if isinstance(arg, PoolingParams):
            return self._layouts.pooling(arg)
        if isinstance(arg, SamplingParams):
            return self._layouts.sampling(arg)
        return arg

    def encode_start_dp_wave(
        self, wave: int, exclude_engine_index: int | None = None
    ) -> list[OutgoingFrame]:
        """``[START_DP_WAVE][[wave, exclude_engine_index]]`` (MoE DP without coordinator)."""
        if type(wave) is not int or wave < 0:
            raise ValueError(f"wave must be a non-negative int, got {wave!r}")
        if exclude_engine_index is not None and type(exclude_engine_index) is not int:
            raise ValueError("exclude_engine_index must be an int or None")
        return self._encode(_START_DP_WAVE, [wave, exclude_engine_index])

    # ---- decoding (engine -> client) ----------------------------------------------------

    def decode_outputs(self, frames: Sequence[Frame]) -> EngineCoreOutputs | EngineCoreDead:
        """Decode one output-socket message: ``[main][aux...]``.

        Returns `EngineCoreOutputs`, or the `EngineCoreDead` singleton for
        the single ``ENGINE_CORE_DEAD`` frame. Raises `ProtocolError`
        for anything else (and `InsecureSerializationError` for pickle
        payloads or typed utility results that were not allowed).
        """
        try:
            count = len(frames)
            if count == 1:
                main = frames[0]
                if type(main) is not bytes:
                    main = _buf(main)
                if len(main) == 16 and main == ENGINE_CORE_DEAD:
                    return _DEAD
                out = self._outputs_decoder.decode(main)
            elif count == 0:
                raise ProtocolError("received an empty message (no frames) on the output socket")
            else:
                # The hook resolves aux indices into ``frames`` itself (no copy).
                self._aux_in.frames = frames
                main = frames[0]
                if type(main) is not bytes:
                    main = _buf(main)
                out = self._outputs_decoder.decode(main)
            if self._outputs_from_wire is not None:
                out = self._outputs_from_wire(out)
        except Exception as exc:
            raise self._fail("EngineCoreOutputs", exc) from None
        finally:
            self._aux_in.frames = None
        utility = out.utility_output
        if utility is not None and utility.result is not None:
            self._check_utility_result(utility.result)
        return out  # type: ignore[no-any-return]

    def _check_utility_result(self, result: Any) -> None:
        if result.type_info is None:
            return
        if not self.allow_insecure_serialization:
            raise InsecureSerializationError(
                "utility result carries type information (the engine runs with "
                "VLLM_ALLOW_INSECURE_SERIALIZATION); pass allow_insecure_serialization=True "
                "to accept it"
            )
        try:
            result.result = _convert_typed_result(result.type_info, result.result)
        except Exception as exc:
            raise ProtocolError(f"cannot apply utility result type information: {exc}") from None


def _convert_typed_result(type_info: Any, value: Any) -> Any:
    """Apply vLLM's utility-result type hints for builtin containers (insecure mode only)."""
    if type_info is None:
        return value
    if isinstance(type_info, list) and type_info and isinstance(type_info[0], list):
        if not isinstance(value, list) or len(value) != len(type_info):
            raise ValueError("type information does not match the value")
        return [_convert_typed_result(t, v) for t, v in zip(type_info, value, strict=True)]
    if isinstance(type_info, dict):
        if not isinstance(value, dict):
            raise ValueError("type information does not match the value")
        return {k: _convert_typed_result(type_info.get(k), v) for k, v in value.items()}
    if isinstance(type_info, list) and len(type_info) == 2:
        module, name = type_info
        if module == "builtins":
            if name == "tuple":
                return tuple(value)
            if name == "set":
                return set(value)
            if name == "frozenset":
                return frozenset(value)
        return value
    raise ValueError(f"unrecognised type information {type_info!r}")


class EngineCodec(_CodecBase):
    """An engine's codec for one profile: decodes client->engine input, encodes outputs.

    Decoding accepts what a stock engine of that release accepts (extra trailing array
    elements are ignored); every failure is a `ProtocolError`.
    """

    def __init__(
        self,
        profile: ProtocolProfile | None = None,
        *,
        allow_insecure_serialization: bool = False,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
    ) -> None:
        super().__init__(
            profile,
            allow_insecure_serialization=allow_insecure_serialization,
            inline_threshold=inline_threshold,
        )
        layouts = self._layouts
        self._request_from_wire: Callable[[Any], EngineCoreRequest] | None = None
        if layouts.request_wire is not None:
            self._request_decoder = self._decoder(layouts.request_wire)
            self._request_from_wire = layouts.request_from_wire
        else:
            self._request_decoder = self._decoder(EngineCoreRequest)
        self._abort_decoder = self._decoder(list[str])
        self._utility_decoder = self._decoder(UtilityCall)
        self._wave_decoder = self._decoder(StartDPWave)
        self._lora_decoder_type: Any = layouts.lora_wire or LoRARequest

    def decode_input(self, frames: Sequence[Frame]) -> InputMessage:
        """Decode ``[type][main][aux...]`` (the DEALER side, identity already stripped)."""
        what = "input message"
        try:
            if len(frames) < 2:
                raise ProtocolError(
                    f"input message has {len(frames)} frame(s); expected [type][payload][aux...]"
                )
            head = bytes(_buf(frames[0]))
            kind = _TYPE_BYTES.get(head)
            if kind is None or kind in (RequestType.EXECUTOR_FAILED, RequestType.WAKEUP):
                raise ProtocolError(
                    f"unknown or internal request type byte {head.hex() or '(empty)'}"
                )
            what = kind.name
            aux = self._aux_in.frames = [_buf(f) for f in frames[1:]]
            main = aux[0]
            if kind is RequestType.ADD:
                what = "ADD (EngineCoreRequest)"
                count = _array_length(main)
                if count is not None and count < _REQUIRED_REQUEST_FIELDS:
                    # vLLM declares the first 9 positions without defaults.
                    raise ProtocolError(
                        f"ADD: EngineCoreRequest has {count} fields, at least "
                        f"{_REQUIRED_REQUEST_FIELDS} are required"
                    )
                req = self._request_decoder.decode(main)
                if self._request_from_wire is not None:
                    req = self._request_from_wire(req)
                return req  # type: ignore[no-any-return]
            if kind is RequestType.ABORT:
                return AbortRequests(self._abort_decoder.decode(main))
            if kind is RequestType.UTILITY:
                return self._utility_decoder.decode(main)  # type: ignore[no-any-return]
            return self._wave_decoder.decode(main)  # type: ignore[no-any-return]
        except Exception as exc:
            raise self._fail(what, exc) from None
        finally:
            self._aux_in.frames = None

    def convert_lora_request(self, value: object) -> LoRARequest:
        """A decoded ``add_lora`` argument (a plain array) as a `LoRARequest`."""
        try:
            wire = msgspec.convert(value, self._lora_decoder_type)
            if self._layouts.lora_wire is not None:
                return self._layouts.lora_from_wire(wire)
            return wire  # type: ignore[no-any-return]
        except Exception as exc:
            raise self._fail("LoRARequest argument", exc) from None

    def encode_outputs(self, outputs: EngineCoreOutputs) -> list[OutgoingFrame]:
        """``[EngineCoreOutputs][aux...]`` in this profile's layout.

        Fields the release does not have are dropped. ``TypeError`` for a value msgpack
        cannot carry (a stock engine's output thread dies on those, §6.5).
        """
        return self._encode(None, self._layouts.outputs(outputs))

    def encode_dead(self) -> list[OutgoingFrame]:
        """The single ``ENGINE_CORE_DEAD`` frame."""
        return [ENGINE_CORE_DEAD]

    def encode_ready_response(self, response: EngineCoreReadyResponse) -> bytes:
        """The ready response as this profile's map (every key of the release, in order)."""
        return encode_ready_response(response, self.profile)


# ---- startup messages -------------------------------------------------------------------

_ready_decoder: Final = msgspec.msgpack.Decoder(EngineCoreReadyResponse)
_hello_decoder: Final = msgspec.msgpack.Decoder(HandshakeHello)
_ready_msg_decoder: Final = msgspec.msgpack.Decoder(HandshakeReady)
_metadata_decoder: Final = msgspec.msgpack.Decoder(EngineHandshakeMetadata)
_plain_encoder: Final = msgspec.msgpack.Encoder()


def decode_ready_response(frame: Frame) -> EngineCoreReadyResponse:
    """Decode the engine's first input-socket message (§2.1); an empty frame means
    "ready, no metadata" (every field ``None``). Unknown keys are ignored."""
    try:
        buf = _buf(frame)
        if len(buf) == 0:
            return EngineCoreReadyResponse()
        return _ready_decoder.decode(buf)
    except Exception as exc:
        raise ProtocolError(f"cannot decode EngineCoreReadyResponse: {exc}") from None


def encode_ready_response(
    response: EngineCoreReadyResponse, profile: ProtocolProfile | None = None
) -> bytes:
    """Encode a ready response with the keys of ``profile``'s release, in vLLM's order.

    Every key of the release is written (``None`` for unset fields); a 0.32.0+ frontend
    of vLLM itself requires the parallel sizes, ``data_parallel_rank``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``instance_id``, ``supports_lora`` and ``max_loras``.
    """
    keys = (profile or newest_profile()).map_keys["EngineCoreReadyResponse"]
    return _plain_encoder.encode({k: getattr(response, k) for k in keys})


def decode_hello(frame: Frame) -> HandshakeHello:
    """Decode HELLO (``ProtocolError`` if it is not a HELLO map)."""
    msg = _decode_startup(_hello_decoder, frame, "HELLO")
    if msg.status != "HELLO":
        raise ProtocolError(f"expected a HELLO message, got status {msg.status!r}")
    return msg  # type: ignore[no-any-return]


def encode_hello(*, local: bool, headless: bool) -> bytes:
    """HELLO, as an engine sends it."""
    return _plain_encoder.encode({"status": "HELLO", "local": local, "headless": headless})


def decode_ready(frame: Frame) -> HandshakeReady:
    """Decode READY from the handshake socket."""
    msg = _decode_startup(_ready_msg_decoder, frame, "READY")
    if msg.status != "READY":
        raise ProtocolError(f"expected a READY message, got status {msg.status!r}")
    return msg  # type: ignore[no-any-return]


def encode_ready(message: HandshakeReady) -> bytes:
    """READY, as an engine sends it (optional keys only when set)."""
    body: dict[str, Any] = {
        "status": "READY",
        "local": message.local,
        "headless": message.headless,
    }
    for key in (
        "parallel_config_hash",
        "coord_store_port",
        "elastic_ep_max_dp_size",
        "num_redundant_experts",
    ):
        value = getattr(message, key)
        if value is not None:
            body[key] = value
    return _plain_encoder.encode(body)


def decode_handshake_metadata(frame: Frame) -> EngineHandshakeMetadata:
    """Decode the init metadata (engine side); strict like vLLM's."""
    return _decode_startup(_metadata_decoder, frame, "EngineHandshakeMetadata")  # type: ignore[no-any-return]


def encode_handshake_metadata(metadata: EngineHandshakeMetadata) -> bytes:
    """Encode the init metadata (the client's reply to HELLO), byte-identical to vLLM's."""
    addresses = metadata.addresses
    if not addresses.inputs or len(addresses.inputs) != len(addresses.outputs):
        raise ValueError("addresses.inputs and .outputs must be non-empty and of equal length")
    return _plain_encoder.encode(metadata)


def _decode_startup(decoder: msgspec.msgpack.Decoder[Any], frame: Frame, what: str) -> Any:
    try:
        return decoder.decode(_buf(frame))
    except Exception as exc:
        raise ProtocolError(f"cannot decode {what}: {exc}") from None
