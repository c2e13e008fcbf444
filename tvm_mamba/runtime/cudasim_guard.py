"""The CUDA harness's guarded arguments: each tensor argument of a simulated kernel is copied between two
PROT_NONE guard pages with 0xFF canaries around it and handed to the kernel as a CUDA DLTensor, so an
out-of-bounds access faults (or leaves a canary changed) and names the argument (runtime/cudasim.py's
``call``). ctypes only: no torch."""
from __future__ import annotations

import ctypes
import os

import tvm_ffi

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_capi = ctypes.pythonapi
_capi.PyCapsule_GetPointer.restype = ctypes.c_void_p
_capi.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capi.PyCapsule_New.restype = ctypes.py_object
_capi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_PAGE = os.sysconf("SC_PAGESIZE")
_ALIGN = 64  # where TVM's kernels may assume their buffers start (storage_alignment)
_CANARY = 0xFF
_KDLCUDA = 2


class Guarded:
    """One argument's copy between two PROT_NONE guard pages, the bytes around it 0xFF canaries:
    [guard][data][canaries][guard] (``head``) or [guard][canaries][data][< 64 B canaries][guard]. A strided
    argument (a serving pool's slots a page apart, a transposed view) is copied as the whole span its elements
    cover, with its strides; the bytes of the span that are no element (the rest of each page) must come back
    unchanged."""

    def __init__(self, index: int, src: _DLTensor, head: bool = False):
        self.index, self.ndim = index, src.ndim
        self.shape = [src.shape[i] for i in range(src.ndim)]
        itemsize = src.dtype.bits * src.dtype.lanes // 8
        self.strides, self.gaps = _strides(index, src, self.shape), None
        if self.strides is None:
            n = 1
            for d in self.shape:
                n *= d
        else:  # the span from the first element to one past the last
            n = 0 if 0 in self.shape else 1 + sum((d - 1) * st for d, st in zip(self.shape, self.strides))
        self.nbytes = n * itemsize
        self.src_ptr = (src.data or 0) + src.byte_offset
        body = -(-max(self.nbytes, 1) // _PAGE) * _PAGE + _PAGE  # room for the alignment slack
        self.total = body + 2 * _PAGE
        base = _libc.mmap(None, self.total, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
        if base in (None, ctypes.c_void_p(-1).value):
            raise MemoryError("cudasim: mmap failed")
        self.base = base
        _libc.mprotect(base, _PAGE, 0)
        self.tail_guard = base + _PAGE + body
        _libc.mprotect(self.tail_guard, _PAGE, 0)
        # head: flush with the leading guard page (catches x[-1]); else as close to the trailing one as the
        # 64-byte alignment allows (catches x[n]).
        self.data = base + _PAGE if head else (self.tail_guard - self.nbytes) // _ALIGN * _ALIGN
        ctypes.memset(base + _PAGE, _CANARY, body)
        if self.nbytes:
            ctypes.memmove(self.data, self.src_ptr, self.nbytes)
        if self.strides is not None and self.nbytes:
            import numpy as np

            self.gaps = _gap_bytes(self.shape, self.strides, itemsize, self.nbytes)
            self.gap_before = np.frombuffer(ctypes.string_at(self.data, self.nbytes), dtype=np.uint8)
        self.dl = _DLManagedTensor()
        self._shape = (ctypes.c_int64 * max(self.ndim, 1))(*self.shape)
        self._strides = None if self.strides is None else (ctypes.c_int64 * max(self.ndim, 1))(*self.strides)
        t = self.dl.dl_tensor
        t.data, t.device, t.ndim, t.dtype = self.data, _DLDevice(_KDLCUDA, 0), src.ndim, src.dtype
        t.shape, t.strides, t.byte_offset = self._shape, self._strides, 0

    def tensor(self):
        capsule = _capi.PyCapsule_New(ctypes.addressof(self.dl), b"dltensor", None)
        return tvm_ffi.from_dlpack(capsule)

    def where(self, addr: int) -> str | None:
        """Name the place of a faulting address, if it is in this argument's mapping."""
        if not (self.base <= addr < self.base + self.total):
            return None
        if addr < self.data:
            return f"{self.data - addr} bytes before the start of argument #{self.index} {self.describe()}"
        return f"{addr - (self.data + self.nbytes)} bytes past the end of argument #{self.index} {self.describe()}"

    def describe(self) -> str:
        strided = "" if self.strides is None else f", strides {tuple(self.strides)}"
        return f"(shape {tuple(self.shape)}{strided}, {self.nbytes} bytes)"

    def check_canaries(self) -> str | None:
        lo = self.base + _PAGE
        before = ctypes.string_at(lo, self.data - lo)
        after = ctypes.string_at(self.data + self.nbytes, self.tail_guard - self.data - self.nbytes)
        bad = [i for i, b in enumerate(before) if b != _CANARY]
        if bad:
            return f"the kernel wrote {len(before) - bad[0]} bytes before the start of argument #{self.index}"
        bad = [i for i, b in enumerate(after) if b != _CANARY]
        if bad:
            return f"the kernel wrote {bad[-1] + 1} bytes past the end of argument #{self.index} {self.describe()}"
        if self.gaps is not None and self.gaps.size:
            import numpy as np

            now = np.frombuffer(ctypes.string_at(self.data, self.nbytes), dtype=np.uint8)
            bad = np.flatnonzero(now[self.gaps] != self.gap_before[self.gaps])
            if bad.size:
                return (f"the kernel wrote byte {int(self.gaps[bad[0]])} of argument #{self.index} {self.describe()}, "
                        "which lies between its elements")
        return None

    def copy_back(self) -> None:
        if self.nbytes:
            ctypes.memmove(self.src_ptr, self.data, self.nbytes)

    def free(self) -> None:
        _libc.munmap(self.base, self.total)


def _strides(index: int, src: _DLTensor, shape: list[int]) -> list[int] | None:
    """The argument's strides in elements, or None when it is compact (row-major)."""
    if not src.strides:
        return None
    strides = [src.strides[i] for i in range(src.ndim)]
    expect, compact = 1, True
    for i in reversed(range(src.ndim)):
        compact &= shape[i] == 1 or strides[i] == expect
        expect *= shape[i]
    if compact:
        return None
    if any(st < 0 for st in strides):
        raise ValueError(f"cudasim: argument #{index} has a negative stride {tuple(strides)}")
    return strides


def _gap_bytes(shape: list[int], strides: list[int], itemsize: int, nbytes: int):
    """Byte offsets in a strided argument's span that belong to no element."""
    import numpy as np

    offsets = np.zeros(1, dtype=np.int64)
    for d, st in zip(shape, strides):
        offsets = (offsets[:, None] + np.arange(d, dtype=np.int64)[None, :] * st).reshape(-1)
    covered = np.zeros(nbytes, dtype=bool)
    for b in range(itemsize):
        covered[offsets * itemsize + b] = True
    return np.flatnonzero(~covered)


def dltensor_of(obj) -> _DLTensor | None:
    if not hasattr(obj, "__dlpack__"):
        return None
    if getattr(obj, "requires_grad", False):  # inside a custom op's forward / backward: torch refuses to export
        obj = obj.detach()  # a tensor that requires grad; the kernel call path takes it as it is
    capsule = obj.__dlpack__()
    ptr = _capi.PyCapsule_GetPointer(capsule, b"dltensor")
    managed = _DLManagedTensor.from_address(ptr)
    out = _DLTensor()
    ctypes.pointer(out)[0] = managed.dl_tensor
    out._keep = capsule  # the shape / strides arrays live as long as the capsule
    return out
