"""Count a CUDA kernel's global-memory traffic and arithmetic by running it through the CUDA execution harness.

A *separate counting build* (never the source build-check / sim-check compile): the kernel key is scheduled
and lowered exactly as ``cudasim.build`` does (TVM's pipeline up to code generation), then every device
PrimFunc is instrumented before CUDA codegen. Each statement that evaluates expressions (a store, a ``Bind``,
an ``if`` condition, an ``Evaluate``) is preceded by one call

    tvm_mamba_count(kernel, load_bytes, store_bytes, flops, exps, sfu)

whose amounts are the statement's static counts:

* load_bytes / store_bytes: every ``TensorLoad`` / ``BufferStore`` of a ``global``-scope buffer, dtype bytes
  x lanes (a float4 load is 16 bytes). Shared / local traffic is not counted. These are the bytes the threads
  *request*; on a GPU, L1/L2 hits serve part of a repeated request, so DRAM traffic can be lower;
* flops: float ``+ - * /`` and min / max, x lanes (an fma written ``a*b + c`` is two); integer index
  arithmetic is not counted;
* exps: exp-family calls (``expf``, ``__expf``, ``exp2f``, ``expm1f``, ...); sfu: the other transcendental
  calls (``logf``, ``log1pf``, ``tanhf``, ``sqrtf``, ``rsqrtf``, ``sinf``, ...).

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

from ..runtime import cudasim

COUNTER = "tvm_mamba_count"
KINDS = ("load_bytes", "store_bytes", "flops", "exps", "sfu")
SLOTS = len(KINDS) + 2  # + the launch's block count and threads per block, recorded by the counter call
MAX_KERNELS = 64
_EXP = {"exp", "exp2", "exp10", "expm1"}
_SFU = {"log", "log2", "log10", "log1p", "tanh", "sqrt", "rsqrt", "sin", "cos", "tan", "pow", "erf", "sigmoid"}
_FLOAT_BINOPS = {"Add", "Sub", "Mul", "Div", "Min", "Max"}
TENSOR_CORE_MARKERS = ("wmma::", "mma.sync", "ldmatrix", "wgmma", "mma_sync", "__hmma")

HEADER = f"""
// ---- tvm_mamba roofline: per-kernel counters of the counting build (tvm_mamba/roofline/count.py) ----
extern "C" __attribute__((visibility("default"))) unsigned long long tvm_mamba_counts[{MAX_KERNELS}][{SLOTS}];
unsigned long long tvm_mamba_counts[{MAX_KERNELS}][{SLOTS}];
static inline int {COUNTER}(int k, long long ld, long long st, long long fl, long long ex, long long sf) {{
  unsigned long long* c = tvm_mamba_counts[k];
  c[0] += ld; c[1] += st; c[2] += fl; c[3] += ex; c[4] += sf;
  unsigned long long blocks = 1ull * gridDim.x * gridDim.y * gridDim.z, threads = 1ull * blockDim.x * blockDim.y * blockDim.z;
  if (blocks > c[5]) c[5] = blocks;  // the largest launch of this kernel in the call
  if (threads > c[6]) c[6] = threads;
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


def expr_counts(expr) -> Counts:
    """Static counts of one expression: global loads (bytes), float ops, exp-family and other SFU calls."""
    c = Counts()

    def visit(v):
        kind = type(v).__name__
        if kind == "TensorLoad":
            if v.source.scope() == "global":
                c.load_bytes += _lanes_bytes(v.ty.dtype)[1]
        elif kind in _FLOAT_BINOPS:
            if _is_float(v.ty.dtype):
                c.flops += _lanes_bytes(v.ty.dtype)[0]
        elif kind == "Call":
            op = str(v.op.name)
            if op in ("tirx.call_pure_extern", "tirx.call_extern") and v.args:
                op = str(v.args[0].value)
            base, lanes = _base_name(op), _lanes_bytes(v.ty.dtype)[0] if _is_float(v.ty.dtype) else 0
            if base == "fma":
                c.flops += 2 * lanes
            elif base in _EXP:
                c.exps += lanes
            elif base in _SFU:
                c.sfu += lanes

    tvm_ffi.structural_walk(expr, visit, order="post")
    return c


def _stmt_counts(v) -> Counts | None:
    kind = type(v).__name__
    if kind == "BufferStore":
        c = expr_counts(v.value)
        for i in v.indices:
            c = c + expr_counts(i)
        if v.buffer.scope() == "global":
            c.store_bytes += _lanes_bytes(v.value.ty.dtype)[1]
        return c
    if kind == "Bind":
        return expr_counts(v.value)
    if kind == "IfThenElse":
        return expr_counts(v.condition)
    if kind == "Evaluate":
        call = v.value
        if type(call).__name__ == "Call" and call.args and str(getattr(call.args[0], "value", "")) == COUNTER:
            return None
        return expr_counts(call)
    return None


def instrument(func, kernel_id: int):
    """``func`` (a device PrimFunc) with a counter call before every statement that loads, stores or
    computes (see the module docstring)."""
    def visit(v):
        c = _stmt_counts(v) if isinstance(v, S.Stmt) else None
        if c is None or not any(c.as_tuple()):
            return v
        call = tvm.tirx.call_extern("int32", COUNTER, kernel_id, *c.as_tuple())
        return S.SeqStmt([S.Evaluate(call), v])

    return func.with_body(tvm_ffi.structural_map(func.body, visit, order="post"))


@dataclasses.dataclass
class CountingBuild:
    """A counting build: the harness library with instrumented kernels; ``names[i]`` is kernel id i."""

    path: str
    names: tuple
    source: str
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
        for i, (gv, f) in enumerate(list(device_mod.functions.items())):
            device_mod[gv] = instrument(f, i)
        source = HEADER + codegen_build(device_mod, target).inspect_source("cuda")
        host = codegen_build(host_mod, target_host)
    kernels = tuple((str(gv.name_hint), tuple(str(t) for t in f.attrs["tirx.kernel_launch_params"]))
                    for gv, f in device_mod.functions.items())
    tmp = tempfile.TemporaryDirectory(prefix="tvm_mamba_roofline_")
    path = f"{tmp.name}/counted.so"
    cudasim.link(cudasim.SimBuild(host, source, kernels, str(target.attrs["arch"]), label), path)
    return CountingBuild(path, names, source, tmp)


def run(b: CountingBuild, fn_name: str, args, label: str = "") -> dict[str, tuple[Counts, int, int]]:
    """Run host function ``fn_name`` of the counting build once on ``args`` (DLPack tensors and scalars, in
    guarded copies as cudasim.call does, forward thread order) and return {kernel name: (Counts, blocks,
    threads per block)} (blocks: of its largest launch; 0 when the kernel counted nothing)."""
    module = cudasim.load(b.path)
    lib = ctypes.CDLL(b.path)  # the same mapping the module uses: dlopen returns the loaded library
    table = (ctypes.c_ulonglong * (MAX_KERNELS * SLOTS)).in_dll(lib, "tvm_mamba_counts")
    ctypes.memset(table, 0, ctypes.sizeof(table))
    tensors = [(i, cudasim._dltensor_of(a)) for i, a in enumerate(args)]
    with cudasim._call_lock:
        guarded = cudasim._run_once(module, module[fn_name], args, tensors, False, 0, cudasim.ORDERS["forward"],
                                    label or fn_name)
        for g in guarded:
            g.free()
    n = len(KINDS)
    return {name: (Counts(*table[i * SLOTS:i * SLOTS + n]), table[i * SLOTS + n], table[i * SLOTS + n + 1])
            for i, name in enumerate(b.names)}
