"""Tensor and ndarray payloads: the ``[dtype, shape, data]`` triple of docs/protocol.md §4.6.

torch is imported lazily, the first time a torch-layout tensor is decoded or encoded, so
``import trio_vllm`` and every message without tensors work where torch is missing. That
first import can take seconds; call `torch_available` at startup to pay for it
outside the receive path.

Decoding never copies an aux frame: numpy arrays are read-only views of the frame and
torch tensors share its memory (treat them as read-only; ``.clone()`` before writing).
"""

from __future__ import annotations

import abc
import math
import sys
import warnings
from typing import TYPE_CHECKING, Any, Final

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["AuxFrames", "RawTensor", "TensorLike", "torch_available"]

_torch: Any = None
_torch_checked = False


def _get_torch() -> Any:
    """Return the torch module, or ``None`` when it cannot be imported (checked once)."""
    global _torch, _torch_checked
    if not _torch_checked:
        _torch_checked = True
        try:
            import torch
        except Exception:  # torch missing or broken: use the numpy fallback
            _torch = None
        else:
            _torch = torch
            TensorLike.register(torch.Tensor)
    return _torch


def is_torch_tensor(obj: object) -> bool:
    """Whether ``obj`` is a torch tensor, without importing torch if nobody else has."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    return _get_torch() is not None and isinstance(obj, torch.Tensor)


def torch_available() -> bool:
    """Whether torch can be imported here (imports it on first call)."""
    return _get_torch() is not None


class TensorLike(abc.ABC):  # noqa: B024 - a marker ABC without methods on purpose
    """Marker type of tensor-valued fields.

    A decoded tensor is a ``torch.Tensor`` when torch is importable, else a read-only
    ``numpy.ndarray`` when numpy has the dtype, else a `RawTensor` (bfloat16 and
    float8 without torch). ``torch.Tensor`` (registered lazily), ``numpy.ndarray`` and
    `RawTensor` are virtual subclasses.
    """


class RawTensor:
    """Bytes of a tensor whose dtype has no numpy equivalent (or any tensor, if you like).

    ``dtype`` is the torch dtype name (``"bfloat16"``), ``shape`` the dimensions, ``data``
    the C-contiguous little-endian bytes. Encoding accepts it like a tensor; decoding
    returns it only without torch for dtypes numpy lacks.
    """

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, dtype: str, shape: tuple[int, ...], data: bytes | memoryview) -> None:
        self.dtype = dtype
        self.shape = tuple(shape)
        self.data = data

    def __repr__(self) -> str:
        return f"RawTensor(dtype={self.dtype!r}, shape={self.shape!r}, nbytes={len(self.data)})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RawTensor):
            return NotImplemented
        return (self.dtype, self.shape, bytes(self.data)) == (
            other.dtype,
            other.shape,
            bytes(other.data),
        )

    __hash__ = None  # type: ignore[assignment]

    def to_numpy(self) -> np.ndarray[tuple[int, ...], np.dtype[np.generic]]:
        """The values as an ndarray (copies); bfloat16 is widened to float32."""
        if self.dtype == "bfloat16":
            bits = np.frombuffer(self.data, dtype="<u2").astype(np.uint32) << 16
            return bits.view(np.float32).reshape(self.shape)
        if self.dtype not in _TORCH_TO_NUMPY:
            raise TypeError(f"{self.dtype} has no numpy equivalent")
        arr = np.frombuffer(self.data, dtype=_TORCH_TO_NUMPY[self.dtype])
        return arr.reshape(self.shape).copy()

    def to_torch(self) -> TensorLike:
        """Convert to a ``torch.Tensor`` (copies; needs torch). Typed as `TensorLike`,
        of which a tensor is a virtual subclass: torch is optional here."""
        torch = _get_torch()
        if torch is None:
            raise RuntimeError("torch is not importable")
        tensor: TensorLike = _torch_from_buffer(
            torch, self.dtype, self.shape, memoryview(bytes(self.data))
        )
        return tensor


TensorLike.register(RawTensor)
TensorLike.register(np.ndarray)

# torch dtype name <-> numpy dtype, for dtypes both have (native little-endian).
_TORCH_TO_NUMPY: Final[dict[str, str]] = {
    "float64": "<f8",
    "double": "<f8",
    "float32": "<f4",
    "float": "<f4",
    "float16": "<f2",
    "half": "<f2",
    "int64": "<i8",
    "long": "<i8",
    "int32": "<i4",
    "int": "<i4",
    "int16": "<i2",
    "short": "<i2",
    "int8": "|i1",
    "uint8": "|u1",
    "uint16": "<u2",
    "uint32": "<u4",
    "uint64": "<u8",
    "bool": "|b1",
    "complex64": "<c8",
    "complex128": "<c16",
}
_NUMPY_TO_TORCH: Final[dict[str, str]] = {
    "<f8": "float64",
    "<f4": "float32",
    "<f2": "float16",
    "<i8": "int64",
    "<i4": "int32",
    "<i2": "int16",
    "|i1": "int8",
    "|u1": "uint8",
    "<u2": "uint16",
    "<u4": "uint32",
    "<u8": "uint64",
    "|b1": "bool",
    "<c8": "complex64",
    "<c16": "complex128",
}
# Item sizes of torch dtypes numpy lacks.
_TORCH_ONLY_ITEMSIZE: Final[dict[str, int]] = {
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "complex32": 4,
    "chalf": 4,
}
_ALLOWED_NUMPY_KINDS: Final = frozenset("biufc")
# torch tensors over read-only buffers smaller than this are copied instead of shared.
_TORCH_COPY_BELOW: Final = 64 * 1024


def _check_triple(obj: Any) -> tuple[str, tuple[int, ...], Any]:
    if not isinstance(obj, (list, tuple)) or len(obj) != 3:
        raise ValueError("a tensor must be a [dtype, shape, data] array")
    dtype, shape, data = obj
    if not isinstance(dtype, str):
        raise ValueError(f"tensor dtype must be a str, got {type(dtype).__name__}")
    if not isinstance(shape, (list, tuple)) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"tensor shape must be an array of non-negative ints, got {shape!r}")
    if len(shape) > 64:
        raise ValueError(f"tensor has {len(shape)} dimensions (at most 64 are supported)")
    return dtype, tuple(shape), data


def as_buffer(frame: Any) -> Any:
    """A buffer numpy/msgspec can read for a received frame, without copying.

    Accepts bytes, bytearray, memoryview, objects with a ``.buffer`` memoryview
    (``zmq.Frame``) and anything else supporting the buffer protocol.
    """
    t = type(frame)
    if t is bytes or t is memoryview or t is bytearray:
        return frame
    inner = getattr(frame, "buffer", None)
    if isinstance(inner, memoryview):
        return inner
    return memoryview(frame)


class AuxFrames:
    """The frames of the message being decoded (index 0 = main buffer), or ``None``
    between messages: set by a codec around each decode, read by its `make_dec_hook`."""

    __slots__ = ("frames",)

    def __init__(self) -> None:
        self.frames: Sequence[Any] | None = None


def make_dec_hook(aux: AuxFrames) -> Callable[[type, Any], Any]:
    """The msgspec ``dec_hook`` of a codec: builds ndarrays and tensors.

    ``aux.frames`` is the current message's frame sequence. The ndarray fast path is
    inlined because sample logprobs arrive with every step; anything unusual takes the
    careful path, which names the problem.
    """
    cache = _NUMPY_DTYPE_CACHE
    frombuffer = np.frombuffer
    ndarray = np.ndarray

    def dec_hook(tp: type, obj: Any) -> Any:
        if tp is ndarray:
            try:
                dtype, shape, data = obj
                dt = cache[dtype]
                # No frames (None) raises here too, and the slow path names it.
                frames: Any = aux.frames
                buf = frames[data] if type(data) is int and data > 0 else data
                # numpy checks the sizes (frombuffer: whole items; reshape: exact count,
                # no negative dimension except a single -1, which we refuse here).
                if type(shape) is list and -1 not in shape:
                    return frombuffer(buf, dtype=dt).reshape(shape)
            except Exception:  # the slow path names the problem
                pass
            return _decode_ndarray_slow(obj, aux.frames)
        if tp is TensorLike:
            return decode_tensor(obj, aux.frames)
        raise NotImplementedError(f"no decoder for {tp!r}")

    return dec_hook


def resolve_buffer(data: Any, aux: Sequence[Any] | None) -> memoryview:
    """The bytes a tensor's ``data`` item points at: inline ext 3 or an aux frame index."""
    if isinstance(data, memoryview):
        return data
    if isinstance(data, bytes):
        return memoryview(data)
    if type(data) is int:
        if aux is None or not 1 <= data < len(aux):
            count = 0 if aux is None else len(aux) - 1
            raise ValueError(
                f"tensor data refers to aux frame {data}, but the message has {count} aux frame(s)"
            )
        return memoryview(as_buffer(aux[data])).cast("B")
    if isinstance(data, dict):
        raise ValueError("shared-memory tensor handles (mm_tensor_ipc) cannot cross the wire")
    raise ValueError(
        f"tensor data must be ext type 3 or an aux frame index, got {type(data).__name__}"
    )


def _numpy_dtype(name: str) -> np.dtype[Any]:
    mapped = _TORCH_TO_NUMPY.get(name, name)
    try:
        dt = np.dtype(mapped)
    except Exception:
        raise ValueError(f"unknown array dtype {name!r}") from None
    if dt.kind not in _ALLOWED_NUMPY_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise ValueError(f"array dtype {name!r} is not a plain numeric dtype")
    return dt


def _check_size(shape: tuple[int, ...], itemsize: int, nbytes: int, dtype: str) -> None:
    expected = math.prod(shape) * itemsize
    if expected != nbytes:
        raise ValueError(
            f"{dtype} tensor of shape {list(shape)} needs {expected} bytes, data has {nbytes}"
        )


_NUMPY_DTYPE_CACHE: dict[str, np.dtype[Any]] = {}


def decode_ndarray(obj: Any, aux: Sequence[Any] | None) -> np.ndarray[Any, Any]:
    """Decode a numpy-layout triple into a read-only ndarray viewing the buffer."""
    # Hot path (sample logprobs arrive with every step): a few cheap checks, numpy's own
    # reshape validation, and the careful slow path for anything unusual or wrong.
    try:
        dtype, shape, data = obj
        dt = _NUMPY_DTYPE_CACHE[dtype]
        buf = aux[data] if type(data) is int and data > 0 else data  # type: ignore[index]
        nbytes = buf.nbytes if type(buf) is memoryview else len(buf)
        if type(shape) is list and math.prod(shape) * dt.itemsize == nbytes:
            return np.frombuffer(buf, dtype=dt).reshape(shape)
    except Exception:  # the slow path below names the problem
        pass
    return _decode_ndarray_slow(obj, aux)


def _decode_ndarray_slow(obj: Any, aux: Sequence[Any] | None) -> np.ndarray[Any, Any]:
    dtype, shape, data = _check_triple(obj)
    buf = resolve_buffer(data, aux)
    dt = _numpy_dtype(dtype)
    _check_size(shape, dt.itemsize, buf.nbytes, dtype)
    if len(_NUMPY_DTYPE_CACHE) < 256:
        _NUMPY_DTYPE_CACHE[dtype] = dt
    return np.frombuffer(buf, dtype=dt).reshape(shape)


def _torch_from_buffer(torch: Any, dtype: str, shape: tuple[int, ...], buf: memoryview) -> Any:
    if not dtype.isidentifier() or dtype.startswith("_"):
        raise ValueError(f"unknown tensor dtype {dtype!r}")
    tdt = getattr(torch, dtype, None)
    if not isinstance(tdt, torch.dtype):
        raise ValueError(f"unknown tensor dtype {dtype!r}")
    itemsize = tdt.itemsize
    _check_size(shape, itemsize, buf.nbytes, dtype)
    if buf.nbytes == 0:
        return torch.empty(shape, dtype=tdt)
    if not buf.readonly:
        flat = torch.frombuffer(buf, dtype=torch.uint8)
    elif buf.nbytes < _TORCH_COPY_BELOW:
        # Small (e.g. inline) data: a copy is cheaper than silencing torch's warning.
        flat = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    else:
        with warnings.catch_warnings():
            # Large frames are shared, not copied; torch warns that they are read-only.
            warnings.simplefilter("ignore")
            flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(tdt).view(shape)


def decode_tensor(obj: Any, aux: Sequence[Any] | None) -> Any:
    """Decode a torch-layout triple: torch tensor, else ndarray, else `RawTensor`."""
    dtype, shape, data = _check_triple(obj)
    buf = resolve_buffer(data, aux)
    # Be lenient on receipt: a peer may label a tensor field with a numpy dtype string.
    dtype = _NUMPY_TO_TORCH.get(dtype, dtype)
    torch = _get_torch()
    if torch is not None:
        return _torch_from_buffer(torch, dtype, shape, buf)
    if dtype in _TORCH_ONLY_ITEMSIZE:
        _check_size(shape, _TORCH_ONLY_ITEMSIZE[dtype], buf.nbytes, dtype)
        return RawTensor(dtype, shape, buf)
    if dtype not in _TORCH_TO_NUMPY:
        raise ValueError(f"unknown tensor dtype {dtype!r}")
    dt = np.dtype(_TORCH_TO_NUMPY[dtype])
    _check_size(shape, dt.itemsize, buf.nbytes, dtype)
    return np.frombuffer(buf, dtype=dt).reshape(shape)


def tensor_parts(obj: Any, *, torch_layout: bool) -> tuple[str, list[int], memoryview]:
    """(dtype name, shape, C-contiguous bytes) of a torch tensor, ndarray or RawTensor.

    ``torch_layout`` picks the dtype spelling: torch names (``"float32"``) for fields
    vLLM declares as ``torch.Tensor``, numpy ``dtype.str`` (``"<f4"``) for ndarray
    fields. Raises ``TypeError`` for anything else.
    """
    if isinstance(obj, RawTensor):
        data = memoryview(obj.data).cast("B")
        if torch_layout:
            return obj.dtype, list(obj.shape), data
        return _torch_to_numpy_name(obj.dtype), list(obj.shape), data
    if isinstance(obj, np.ndarray):
        arr = obj
        if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not _LITTLE):
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        arr = np.ascontiguousarray(arr)
        if arr.dtype.kind not in _ALLOWED_NUMPY_KINDS:
            raise TypeError(f"cannot send an ndarray of dtype {arr.dtype}")
        name = arr.dtype.str
        if torch_layout:
            if name not in _NUMPY_TO_TORCH:
                raise TypeError(f"ndarray dtype {name} has no torch equivalent")
            name = _NUMPY_TO_TORCH[name]
        return name, list(arr.shape), arr.reshape(-1).view(np.uint8).data
    torch = _get_torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        name = str(t.dtype).removeprefix("torch.")
        shape = list(t.shape)
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        if not torch_layout:
            name = _torch_to_numpy_name(name)
        return name, shape, data
    raise TypeError(f"cannot encode an object of type {type(obj).__name__} as a tensor")


def _torch_to_numpy_name(name: str) -> str:
    if name in _TORCH_TO_NUMPY:
        return _TORCH_TO_NUMPY[name]
    raise TypeError(f"tensor dtype {name} has no numpy equivalent")


_LITTLE: Final = np.little_endian


def describe(obj: Any) -> dict[str, Any]:
    """``{dtype, shape, values}`` of a decoded tensor/array (for wire checks and tests)."""
    if isinstance(obj, RawTensor):
        try:
            values = obj.to_numpy().reshape(-1).tolist()
        except TypeError:
            values = None
        return {"dtype": obj.dtype, "shape": list(obj.shape), "values": values}
    if isinstance(obj, np.ndarray):
        values = obj.reshape(-1).tolist()
        return {"dtype": obj.dtype.str, "shape": list(obj.shape), "values": values}
    torch = _get_torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        flat = obj.reshape(-1)
        if flat.dtype.is_floating_point and flat.dtype not in (torch.float32, torch.float64):
            flat = flat.float()
        return {
            "dtype": str(obj.dtype).removeprefix("torch."),
            "shape": list(obj.shape),
            "values": flat.tolist(),
        }
    raise TypeError(f"not a tensor: {type(obj).__name__}")
