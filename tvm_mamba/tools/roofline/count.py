"""Count a CUDA kernel's global-memory traffic and arithmetic by running it through the CUDA execution harness.

A *separate counting build* (never the source build-check / sim-check compile): the kernel key is scheduled
and lowered exactly as ``cudasim.build`` does (TVM's pipeline up to code generation), then every device
PrimFunc is instrumented before CUDA codegen. Each statement that evaluates expressions (a store, a ``Bind``,
an ``if`` condition, an ``Evaluate``) is preceded by one call

    tvm_mamba_count(kernel, load_bytes, store_bytes, flops, exps, sfu, mma_flops)

whose amounts are the statement's static counts:

* load_bytes / store_bytes: every ``TensorLoad`` / ``BufferStore`` of a ``global``-scope buffer, dtype bytes
  x lanes (a float4 load is 16 bytes), a load repeated within one statement once. Shared / local traffic is
  not counted. These are the bytes the threads
  *request*; on a GPU, L1/L2 hits serve part of a repeated request, so DRAM traffic can be lower;
* flops: float ``+ - * /`` and min / max, x lanes (an fma written ``a*b + c`` is two); integer index
  arithmetic is not counted;
* exps: exp-family calls (``expf``, ``__expf``, ``exp2f``, ``expm1f``, ...); sfu: the other transcendental
  calls (``logf``, ``log1pf``, ``tanhf``, ``sqrtf``, ``rsqrtf``, ``sinf``, ...);
* mma_flops: the tensor cores' multiply-adds (x2): 2 x 16^3 per wmma ``mma_sync`` of a warp, a 32nd counted
  by each of its threads.

Both arms of a select / ``if_then_else`` expression are counted (the guarded loads of a boundary tile count
as if taken); a statement under an ``if`` counts only when the branch runs. The header below provides the
counters: blocks run one after another in the harness, so plain increments are exact.
"""
from __future__ import annotations

import ctypes
import dataclasses
import tempfile

import tvm
import tvm_ffi
from tvm.tirx import stmt as S

from ...runtime import cudasim

COUNTER = "tvm_mamba_count"
KINDS = ("load_bytes", "store_bytes", "flops", "exps", "sfu", "mma_flops")
SLOTS = len(KINDS) + 2  # + the launch's block count and threads per block, recorded by the counter call
MAX_KERNELS = 64
MAX_BUFFERS = 64
BUFFER_COUNTER = "tvm_mamba_count_buffer"
_EXP = {"exp", "exp2", "exp10", "expm1"}
_SFU = {"log", "log2", "log10", "log1p", "tanh", "sqrt", "rsqrt", "sin", "cos", "tan", "pow", "erf", "sigmoid"}
_FLOAT_BINOPS = {"Add", "Sub", "Mul", "Div", "Min", "Max"}
MMA_FLOPS = 2 * 16 * 16 * 16  # one wmma m16n16k16 mma_sync of a warp
TENSOR_CORE_MARKERS = ("wmma::", "mma.sync", "ldmatrix", "wgmma", "mma_sync", "__hmma")

HEADER = f"""
// ---- tvm_mamba roofline: per-kernel counters of the counting build (tvm_mamba/tools/roofline/count.py) ----
extern "C" __attribute__((visibility("default"))) unsigned long long tvm_mamba_counts[{MAX_KERNELS}][{SLOTS}];
unsigned long long tvm_mamba_counts[{MAX_KERNELS}][{SLOTS}];
static inline int {COUNTER}(int k, long long ld, long long st, long long fl, long long ex, long long sf,
                            long long mm) {{
  unsigned long long* c = tvm_mamba_counts[k];
  c[0] += ld; c[1] += st; c[2] += fl; c[3] += ex; c[4] += sf; c[5] += mm;
  unsigned long long blocks = 1ull * gridDim.x * gridDim.y * gridDim.z, threads = 1ull * blockDim.x * blockDim.y * blockDim.z;
  if (blocks > c[6]) c[6] = blocks;  // the largest launch of this kernel in the call
  if (threads > c[7]) c[7] = threads;
  return 0;
}}
extern "C" __attribute__((visibility("default"))) unsigned long long tvm_mamba_buffer_counts[{MAX_KERNELS}][{MAX_BUFFERS}][2];
unsigned long long tvm_mamba_buffer_counts[{MAX_KERNELS}][{MAX_BUFFERS}][2];
static inline int {BUFFER_COUNTER}(int k, int b, long long ld, long long st) {{
  tvm_mamba_buffer_counts[k][b][0] += ld; tvm_mamba_buffer_counts[k][b][1] += st;
  return 0;
}}
"""


@dataclasses.dataclass
class Counts:
    """Totals of one kernel (or one call: the sum over its launches)."""

    load_bytes: int = 0
    store_bytes: int = 0
    flops: int = 0
    exps: int = 0
    sfu: int = 0
    mma_flops: int = 0  # tensor-core multiply-adds (x2)

    def as_tuple(self) -> tuple[int, ...]:
        return tuple(getattr(self, k) for k in KINDS)

    def __add__(self, other: "Counts") -> "Counts":
        return Counts(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple())))

    @property
    def bytes(self) -> int:
        return self.load_bytes + self.store_bytes


def _lanes_bytes(dtype) -> tuple[int, int]:
    d = tvm_ffi.dtype(str(dtype))
    return d.lanes, d.lanes * d.bits // 8


def _is_float(dtype) -> bool:
    s = str(dtype)
    return s.startswith("float") or s.startswith("bfloat")


def _base_name(name: str) -> str:
    """``__expf`` / ``expf`` / ``tirx.exp`` / ``hexp2`` -> ``exp`` / ``exp2`` (the math function's family)."""
    name = name.split(".")[-1].lstrip("_")
    if name.startswith("h") and name[1:] in _EXP | _SFU:
        name = name[1:]
    return name[:-1] if name.endswith("f") and name[:-1] in _EXP | _SFU else name


def expr_counts(expr, per_buffer: dict | None = None) -> Counts:
    """Static counts of one expression: global loads (bytes), float ops, exp-family and other SFU calls;
    ``per_buffer`` (if given) gets each global buffer's load bytes added to ``[name][0]``. A load written
    twice in the expression (the same buffer and index: silu(z) = z sigmoid(z) names z twice) is one request:
    an expression stores nothing, and the compiler keeps the value (nvcc merges such loads of __restrict__
    pointers)."""
    c = Counts()
    seen: dict[int, list] = {}

    def first(load) -> bool:
        same = seen.setdefault(tvm_ffi.structural_hash(load), [])
        if any(tvm_ffi.structural_equal(load, other) for other in same):
            return False
        same.append(load)
        return True

    def visit(v):
        kind = type(v).__name__
        if kind == "TensorLoad":
            if v.source.scope() == "global" and first(v):
                nbytes = _lanes_bytes(v.ty.dtype)[1]
                c.load_bytes += nbytes
                if per_buffer is not None:
                    per_buffer.setdefault(str(v.source.name), [0, 0])[0] += nbytes
        elif kind in _FLOAT_BINOPS:
            if _is_float(v.ty.dtype):
                c.flops += _lanes_bytes(v.ty.dtype)[0]
        elif kind == "Call" and str(v.op.name) == "tirx.tvm_mma_sync":
            c.mma_flops += MMA_FLOPS // 32  # the warp's 32 threads each run the call
        elif kind == "Call":
            op = str(v.op.name)
            if op in ("tirx.call_pure_extern", "tirx.call_extern") and v.args:
                op = str(v.args[0].value)
            dtype = getattr(v.ty, "dtype", None)  # (tvm_access_ptr and other handles: a PointerType)
            base, lanes = _base_name(op), _lanes_bytes(dtype)[0] if dtype is not None and _is_float(dtype) else 0
            if base == "fma":
                c.flops += 2 * lanes
            elif base in _EXP:
                c.exps += lanes
            elif base in _SFU:
                c.sfu += lanes

    tvm_ffi.structural_walk(expr, visit, order="post")
    return c


def _stmt_counts(v, per_buffer: dict) -> Counts | None:
    kind = type(v).__name__
    if kind == "BufferStore":
        c = expr_counts(v.value, per_buffer)
        for i in v.indices:
            c = c + expr_counts(i, per_buffer)
        if v.buffer.scope() == "global":
            nbytes = _lanes_bytes(v.value.ty.dtype)[1]
            c.store_bytes += nbytes
            per_buffer.setdefault(str(v.buffer.name), [0, 0])[1] += nbytes
        return c
    if kind == "Bind":
        return expr_counts(v.value, per_buffer)
    if kind == "IfThenElse":
        return expr_counts(v.condition, per_buffer)
    if kind == "Evaluate":
        call = v.value
        if type(call).__name__ == "Call" and call.args and \
                str(getattr(call.args[0], "value", "")) in (COUNTER, BUFFER_COUNTER):
            return None
        return expr_counts(call, per_buffer)
    return None


def instrument(func, kernel_id: int, buffers: dict[str, int] | None = None):
    """``func`` (a device PrimFunc) with a counter call before every statement that loads, stores or
    computes (see the module docstring), and one per global buffer it touches; ``buffers`` maps buffer names
    to counter slots (new names are added)."""
    buffers = {} if buffers is None else buffers

    def visit(v):
        per_buffer: dict = {}
        c = _stmt_counts(v, per_buffer) if isinstance(v, S.Stmt) else None
        if c is None or not any(c.as_tuple()):
            return v
        calls = [tvm.tirx.call_extern("int32", COUNTER, kernel_id, *c.as_tuple())]
        for name, (ld, st) in sorted(per_buffer.items()):
            if name not in buffers:
                if len(buffers) >= MAX_BUFFERS:
                    raise ValueError(f"roofline: more than {MAX_BUFFERS} global buffers")
                buffers[name] = len(buffers)
            calls.append(tvm.tirx.call_extern("int32", BUFFER_COUNTER, kernel_id, buffers[name], ld, st))
        return S.SeqStmt([S.Evaluate(call) for call in calls] + [v])

    return func.with_body(tvm_ffi.structural_map(func.body, visit, order="post"))


@dataclasses.dataclass
class CountingBuild:
    """A counting build: the harness library with instrumented kernels; ``names[i]`` is kernel id i;
    ``buffers``: global buffer name -> its per-buffer counter slot."""

    path: str
    names: tuple
    source: str
    buffers: dict
    tmp: tempfile.TemporaryDirectory

    @property
    def tensor_cores(self) -> bool:
        return any(m in self.source for m in TENSOR_CORE_MARKERS)


def build(mod: tvm.IRModule, target, label: str = "") -> CountingBuild:
    """Lower ``mod`` (scheduled for the CUDA ``target``) like ``cudasim.build``, instrument the device
    functions, generate CUDA source with the counter header in front, and link the harness library."""
    from tvm.tirx.build import codegen_build

    with target:
        host_mod, device_mod, target_host = cudasim.lower(mod, target)
        names = tuple(str(gv.name_hint) for gv in device_mod.functions)
        if len(names) > MAX_KERNELS:
            raise ValueError(f"roofline: {label}: {len(names)} kernels, the counters hold {MAX_KERNELS}")
        buffers: dict[str, int] = {}
        for i, (gv, f) in enumerate(list(device_mod.functions.items())):
            device_mod[gv] = instrument(f, i, buffers)
        source = HEADER + codegen_build(device_mod, target).inspect_source("cuda")
        host = codegen_build(host_mod, target_host)
    kernels = tuple((str(gv.name_hint), tuple(str(t) for t in f.attrs["tirx.kernel_launch_params"]))
                    for gv, f in device_mod.functions.items())
    tmp = tempfile.TemporaryDirectory(prefix="tvm_mamba_roofline_")
    path = f"{tmp.name}/counted.so"
    cudasim.link(cudasim.SimBuild(host, source, kernels, str(target.attrs["arch"]), label), path)
    return CountingBuild(path, names, source, buffers, tmp)


@dataclasses.dataclass
class Launch:
    """What one device kernel did in one call: its totals, per global buffer (load bytes, store bytes), and
    the block count of its largest launch and threads per block (0 when it counted nothing)."""

    counts: Counts
    per_buffer: dict
    blocks: int
    threads: int


def run(b: CountingBuild, fn_name: str, args, label: str = "") -> dict[str, Launch]:
    """Run host function ``fn_name`` of the counting build once on ``args`` (DLPack tensors and scalars, in
    guarded copies as cudasim.call does, forward thread order) and return {kernel name: Launch}."""
    module = cudasim.load(b.path)
    lib = ctypes.CDLL(b.path)  # the same mapping the module uses: dlopen returns the loaded library
    table = (ctypes.c_ulonglong * (MAX_KERNELS * SLOTS)).in_dll(lib, "tvm_mamba_counts")
    per_buf = (ctypes.c_ulonglong * (MAX_KERNELS * MAX_BUFFERS * 2)).in_dll(lib, "tvm_mamba_buffer_counts")
    ctypes.memset(table, 0, ctypes.sizeof(table))
    ctypes.memset(per_buf, 0, ctypes.sizeof(per_buf))
    tensors = [(i, cudasim._dltensor_of(a)) for i, a in enumerate(args)]
    with cudasim._call_lock:
        guarded = cudasim._run_once(module, module[fn_name], args, tensors, False, 0, cudasim.ORDERS["forward"],
                                    label or fn_name)
        for g in guarded:
            g.free()
    n, out = len(KINDS), {}
    for i, name in enumerate(b.names):
        bufs = {buf: (per_buf[(i * MAX_BUFFERS + j) * 2], per_buf[(i * MAX_BUFFERS + j) * 2 + 1])
                for buf, j in b.buffers.items()}
        out[name] = Launch(Counts(*table[i * SLOTS:i * SLOTS + n]), {k: v for k, v in bufs.items() if any(v)},
                           table[i * SLOTS + n], table[i * SLOTS + n + 1])
    return out
