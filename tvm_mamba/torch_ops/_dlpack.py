"""All tensor/stream glue between torch and the TVM kernels, in one place.

Tensors are passed to kernels as torch tensors: tvm_ffi converts them through DLPack with zero copy and,
for CUDA tensors, runs the kernel on torch's current stream (tvm_ffi asks torch for it per call).
Kernels assume compact, 64-byte aligned buffers (unaligned data segfaults vectorized CPU code; field
guide §6), so every input goes through :func:`prepare` first.
"""
from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np
import torch

from ..runtime import KernelKey, build_and_load, shape_bucket
from ..runtime.dispatch import collect_into
from ..runtime.target import device_target_key

ALIGN = 64
TORCH_TO_TVM = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                torch.int8: "int8", torch.int32: "int32", torch.int64: "int64", torch.float64: "float64"}
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def tvm_dtype(t: torch.Tensor) -> str:
    return TORCH_TO_TVM[t.dtype]


def prepare(t: torch.Tensor) -> torch.Tensor:
    """Compact (contiguous) and 64-byte aligned; copies only when needed. A copy made while a fast path
    watches the call (``_capture.copies``) is noted with its original: torch_ops/_fastpath.py makes it again
    on later calls instead of running the whole op."""
    original = t
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() and t.data_ptr() % ALIGN:
        t = t.clone()  # torch's allocator returns aligned storage
    if t is not original and _capture.copies is not None:
        _capture.copies.append((t, original))
    return t


def prepare_pool(t: torch.Tensor, compact_slots: bool) -> torch.Tensor:
    """A state pool a kernel updates in place, kept as it is (no copy of the whole pool) when its slots (dim 0)
    do not overlap, each slot is compact (``compact_slots``) or merely has no two elements in one place, and
    its base is aligned: the kernel takes the pool's strides (a server's pool: slots a page apart; vLLM's conv
    state stored (state_len, dim) and passed transposed). Else a compact copy, which the caller writes back
    (not noted as an input's copy: a fast path must not replay it without the write-back)."""
    inner = t[0] if t.dim() and t.shape[0] else None
    inner_ok = inner is None or (inner.is_contiguous() if compact_slots else _disjoint(inner))
    slots_apart = t.shape[0] <= 1 or t.stride(0) >= (extent(inner) if inner is not None else 0)
    if inner_ok and slots_apart and t.stride(0) >= 0 and not (t.numel() and t.data_ptr() % ALIGN):
        return t
    copy = t.contiguous() if not t.is_contiguous() else t
    return copy.clone() if copy is t or (copy.numel() and copy.data_ptr() % ALIGN) else copy


def extent(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to one past its last (strides >= 0): the span a strided view covers."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0


def _disjoint(t: torch.Tensor) -> bool:
    """No two elements of ``t`` share memory (strides >= 0): sorted by stride, each dim steps past the
    extent of the finer ones."""
    span = 1
    for n, s in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n > 1), key=lambda d: d[1]):
        if s < span:
            return False
        span = s * (n - 1) + span
    return all(s >= 0 for s in t.stride())


_dummies: dict[tuple, torch.Tensor] = {}  # (device, dtype, ndim) -> placeholder


def dummy(device, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    """A (1,)*ndim placeholder for an absent optional input or output (its static flag tells the kernel to
    ignore it; kernels never write one). Cached: a fresh 4-byte tensor allocated per call after a large
    output sat on top of glibc's heap and made every next large allocation page-fault (conv1d forward at
    (4, 768, 2048): 245-980 faults per call, +0.1-0.2 ms)."""
    key = (torch.device(device), dtype, ndim)
    t = _dummies.get(key)
    if t is None:
        t = _dummies.setdefault(key, torch.zeros((1,) * ndim, device=key[0], dtype=dtype))
    return t


def is_dummy(t: torch.Tensor) -> bool:
    """``t`` is one of :func:`dummy`'s cached placeholders."""
    return t.numel() == 1 and _dummies.get((t.device, t.dtype, t.dim())) is t


def kernel_for(op: str, direction: str, device, dims, static: dict | None = None, **dynamic: int):
    """Build or load the kernel for a call on ``device``. ``dims``: the op's typed static dims (a
    ``compute._common.Dims``, which holds the dtypes too); for an op without typed dims, its dtypes map,
    then ``static``, the static dims map. ``dynamic`` dims only choose the bucket."""
    target = device_target_key(device)
    bucket = shape_bucket(**dynamic)
    typed = static is None
    try:
        parts = (dims,) if typed else (tuple(dims.items()), tuple(static.items()))
        memo = (op, direction, target, *parts, tuple(bucket.items()))
        key = _keys.get(memo)
    except TypeError:  # an unhashable static value: no memo (KernelKey.make validates it)
        memo, key = None, None
    if key is None:
        key = (KernelKey.of(op, direction, dims, target, bucket) if typed
               else KernelKey.make(op, direction, dims, static, target, bucket))
        if memo is not None and len(_keys) < 65536:
            _keys[memo] = key
    kern = build_and_load(key)
    launches = getattr(_capture, "launches", None)
    return kern if launches is None else _Recording(kern, launches)


def kernel_device_type(device) -> str:
    """"cuda" when calls on ``device`` run CUDA kernels (a CUDA device, or CPU tensors inside
    ``tvm_mamba.simulate_cuda()``), else "cpu": for ops whose host-side choices depend on the kernel family."""
    return "cpu" if device_target_key(device).startswith("llvm-") else "cuda"


_keys: dict[tuple, KernelKey] = {}  # call signature -> its KernelKey (building one costs ~5 us per call)
class _Capture(threading.local):
    launches = None  # per thread; a class default, not a missing attribute (see runtime.dispatch._Recording)
    copies = None  # (copy, original) pairs made by prepare() while a fast path watches a call


_capture = _Capture()


class Launch(NamedTuple):
    """One kernel run: ``kernel(*args)`` runs it again on the same tensors."""
    kernel: object
    args: tuple


class _Recording:
    """A kernel handed out inside :class:`capture_launches`: runs it, then records the launch."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __call__(self, *args):
        out = self.kernel(*args)
        self.launches.append(Launch(self.kernel, args))
        return out


def recording() -> list | None:
    """The launch list of the innermost :class:`capture_launches` block on this thread, or None."""
    return _capture.launches


class capture_launches(collect_into):
    """``with capture_launches() as launches: op(...)`` runs the ops as usual and appends a :class:`Launch`
    (kernel, argument tuple) for every kernel they run, in order: what a decode plan replays without the
    ops' validation and allocation (modules/_decode.py; the CPU counterpart of upstream's CUDA-graph capture).
    A replay is only valid while every recorded tensor is still the memory the caller means to use: the
    caller checks that no argument is a copy the op made (see modules/_decode.py)."""

    def __init__(self):
        super().__init__(_capture, "launches")


def modes_allow_direct() -> bool:
    """Not compiling, and no dispatch or function mode active: what :func:`eager_direct` asks of the process
    before it looks at the tensors."""
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
                or torch._C._is_torch_function_mode_enabled())


# torch.Tensor, and nn.Parameter (a model's weights and biases, passed as they are by servers such as vLLM:
# it disables __torch_function__, so it behaves as a plain tensor); other subclasses go through the dispatcher
PLAIN = (torch.Tensor, torch.nn.Parameter)


def eager_direct(*tensors) -> bool:
    """True when an op call may run its implementation directly instead of through the torch dispatcher:
    eager mode (not compiling, no dispatch or function modes), plain tensors (``PLAIN``: no subclasses such as
    FakeTensor, no functorch wrappers) and no gradient needed. The dispatcher and custom-op wrapper cost
    0.1-0.2 ms per call for large tensors here (conv1d forward at (4, 768, 2048): 1.30 vs 1.15 ms), more than
    the whole dispatch of a small call; everything else (autograd, torch.compile, opcheck, fake tensors) goes
    through the registered op. Used by :func:`run_op` for every public function's forward call."""
    if not modes_allow_direct():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) not in PLAIN or (grad and t.requires_grad) or \
                torch._C._functorch.is_functorch_wrapped_tensor(t):
            return False
    return True


def run_op(op, *args):
    """Call the custom op ``op`` (a ``torch.library.custom_op`` definition): its implementation directly when
    :func:`eager_direct` allows it for the tensor arguments, else through the torch dispatcher."""
    impl = getattr(op, "_init_fn", None)
    if impl is not None and eager_direct(*(a for a in args if a is None or isinstance(a, torch.Tensor))):
        return impl(*args)
    return op(*args)


def check_tensor(name: str, t, *, ndim: int | None = None, dtypes=None, device=None) -> None:
    """TypeError/ValueError naming the argument for a wrong type, dtype, rank or device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: dtype must be one of ({names}), got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (where x is), got {t.device}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: tvm_mamba runs on cpu and cuda tensors, got {t.device}")
    check_size(name, t.numel())


MAX_ELEMENTS = 2**31 - 1  # the kernels' index arithmetic is int32 (TVM's default index type)


def check_size(name: str, numel: int) -> None:
    """ValueError for a tensor (input or output) of more elements than 32-bit indices reach, before anything
    is allocated or run."""
    if numel > MAX_ELEMENTS:
        raise ValueError(f"{name}: {numel} elements; tvm_mamba's kernels index with 32-bit integers, so a tensor "
                         f"may have at most 2**31 - 1 = {MAX_ELEMENTS} elements")


def kernel_may_write(t: torch.Tensor, others) -> bool:
    """Whether a kernel may write its result into the caller's ``t`` directly (vLLM's ``out``, or x itself):
    eager mode, ``t`` compact and 64-byte aligned (a kernel argument as is), sharing no storage with the
    call's other tensors ``others`` (a kernel writing one must not read another). Else the caller computes
    into a fresh tensor and copies."""
    others = [o for o in others if isinstance(o, torch.Tensor)]
    ptr = t.untyped_storage().data_ptr()
    return eager_direct(t, *others) and t.is_contiguous() and not t.data_ptr() % ALIGN and \
        all(o.untyped_storage().data_ptr() != ptr for o in others)


def check_no_overlap(name: str, t: torch.Tensor) -> None:
    """ValueError for a tensor updated in place whose elements share memory (a stride-0 / expanded view):
    checked before any kernel runs, so a refused call leaves it untouched."""
    if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
        raise ValueError(f"{name}: it is updated in place, but it is an expanded (stride-0) view whose elements "
                         f"share memory (strides {t.stride()}); pass a tensor of its own (e.g. .clone())")


def slot_stats(idx: torch.Tensor) -> tuple[int, bool]:
    """(largest entry, whether two non-negative entries are equal) of a 1-D slot index tensor (non-empty): what
    the in-place pool ops check before their kernel runs. A CPU tensor of up to 128 entries (a decode batch)
    is read as a Python list (~1.5 us for 8 entries, where numpy's masking costs ~7 and torch's max/unique
    ~20), a longer one through numpy."""
    if idx.device.type == "cpu":
        if idx.dim() == 1 and idx.numel() <= 128:
            values = idx.tolist()
            used = [v for v in values if v >= 0]
            return max(values), len(set(used)) != len(used)
        a = idx.numpy()
        used = a[a >= 0]
        return int(a.max()), np.unique(used).size != used.size
    used = idx[idx >= 0]
    hi, dup = torch.stack([idx.max().to(torch.int64),
                           torch.tensor(used.numel(), device=idx.device) - used.unique().numel()]).tolist()
    return hi, bool(dup)


def check_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
