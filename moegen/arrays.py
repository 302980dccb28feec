"""Arrays at the boundary: reading any DLPack / CUDA Array Interface array, and exporting ours.

No framework is imported: inputs are read through cuda.core's StridedMemoryView (DLPack or the
CUDA Array Interface), NumPy arrays directly, and the layer's own output buffer is exported
through a small DLPack producer so that torch.from_dlpack / cupy.from_dlpack take it as is.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST = 1, 2, 3
_DTYPE_CODES = {(4, 16): "bfloat16", (2, 32): "float32", (2, 16): "float16", (0, 32): "int32", (2, 64): "float64",
                (0, 64): "int64", (1, 8): "uint8", (1, 16): "uint16"}


class ArrayError(ValueError):
    """An argument is not the array the layer expects; the message names it."""


@dataclass(frozen=True)
class View:
    """What the layer needs to know of an array argument."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None  # in elements; None: C-contiguous
    dtype: str
    on_device: bool
    device_id: int


def _dtype_name(dt: Any) -> str:
    try:
        return np.dtype(dt).name
    except TypeError:
        return str(dt)


def view(obj: Any, name: str) -> View:
    """Describe `obj` (DLPack or CUDA Array Interface object, or NumPy array) without copying."""
    if isinstance(obj, np.ndarray):
        st = tuple(s // obj.itemsize for s in obj.strides)
        return View(obj.ctypes.data, obj.shape, st, obj.dtype.name, False, -1)
    if not (hasattr(obj, "__dlpack__") or hasattr(obj, "__cuda_array_interface__")):
        raise ArrayError(f"{name}: a {type(obj).__name__} is not an array (expected DLPack or CUDA Array Interface)")
    from cuda.core.utils import StridedMemoryView

    try:
        v = StridedMemoryView(obj, stream_ptr=-1)
    except Exception as exc:  # noqa: BLE001 - any producer refusal (dtype, device, ...) is the caller's error
        raise ArrayError(f"{name}: cannot read this array: {exc}") from None
    strides = tuple(v.strides) if v.strides is not None else None
    return View(int(v.ptr), tuple(v.shape), strides, _dtype_name(v.dtype), bool(v.is_device_accessible),
                int(v.device_id))


def check(v: View, name: str, shape: tuple[int, ...], dtype: str, device_id: int) -> None:
    """Raise ArrayError naming `name` unless v is a C-contiguous `dtype` array of `shape` on the device."""
    if v.dtype != dtype:
        raise ArrayError(f"{name}: dtype {v.dtype}, expected {dtype}")
    if v.shape != shape:
        raise ArrayError(f"{name}: shape {list(v.shape)}, expected {list(shape)}")
    if not v.on_device or v.device_id != device_id:
        where = "host memory" if not v.on_device else f"device {v.device_id}"
        raise ArrayError(f"{name}: in {where}, expected CUDA device {device_id}")
    contiguous = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    if v.strides is not None and any(s != c for s, c, d in zip(v.strides, contiguous, shape) if d > 1):
        raise ArrayError(f"{name}: strides {list(v.strides)} (elements), expected contiguous {list(contiguous)}")
    if v.ptr % 16:
        raise ArrayError(f"{name}: data pointer {v.ptr:#x} is not 16-byte aligned")


# ---- DLPack export of the layer's own buffers ----
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_CAPSULE_NAME = ctypes.c_char_p(b"dltensor")


class DeviceArray:
    """A bf16 [N, H] view of memory the layer owns (its output buffer), exported through DLPack.

    The memory is the layer's: the next call overwrites it. The consumer's tensor must not
    outlive the layer. Use torch.from_dlpack(arr) or cupy.from_dlpack(arr) to read it.
    """

    def __init__(self, ptr: int, shape: tuple[int, ...], device_id: int, owner: Any) -> None:
        self.ptr, self.shape, self.device_id, self.dtype = ptr, tuple(shape), device_id, "bfloat16"
        self._owner = owner  # keeps the memory alive as long as this view
        self._shape_c = (ctypes.c_int64 * len(shape))(*shape)
        self._managed = _DLManagedTensor()
        t = self._managed.dl_tensor
        t.data, t.device, t.ndim = ptr, _DLDevice(_KDL_CUDA, device_id), len(shape)
        t.dtype = _DLDataType(4, 16, 1)
        t.shape, t.strides, t.byte_offset = self._shape_c, None, 0
        self._managed.deleter = _DELETER()  # null: the layer owns the memory

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_KDL_CUDA, self.device_id)

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:
        # Work is ordered on the stream the caller passed to the layer; the consumer reads it there.
        return _capsule_new(ctypes.addressof(self._managed), _CAPSULE_NAME, None)

    def __repr__(self) -> str:
        return f"DeviceArray(bfloat16, shape={list(self.shape)}, device={self.device_id}, ptr={self.ptr:#x})"
