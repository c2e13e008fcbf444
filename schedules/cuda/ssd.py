"""CUDA rule for the SSD kernels, and the CUDA strategy (compute/ssd/strategy.py) it lays templates out with.

Kernels with one template for every target (chunk_cumsum(_bwd), state_passing(_bwd), head_sum, chunk_state,
chunk_scan_bwd: the templates in tvm_mamba/compute/ssd/) are laid out by ``Gpu``: blockIdx.x x threadIdx.x of
``threads``, a thread per task and per lane (dstate element), scratch in registers, CUDA-native exp / log1p
(chunk_scan_bwd: a launch per piece, a thread per output element). The other chunk-matmul
kernels still have CUDA templates of their own (here, _ssd_scan.py, _ssd_varlen.py; same parameter lists as
the compute builders): one thread per output element, several launches inside one PrimFunc where a later one
reads what an earlier one wrote (launches run in order on the stream: the backward's cross-position sums
without atomics). C_l.B_s comes from ssd_bmm_chunk (once per group); no shared-memory staging and no tensor
cores yet, so they compile cleanly (0 spills) but are far from upstream's Triton speed (docs/ssd.md).
Selected by capability (``"gpu" in target.keys``). Knob: ``threads`` per block (64 / 128 / 256, default 128).
"""
from __future__ import annotations

from tvm.script import tirx as T

from ...compute.ssd import DIMS
from ...compute.ssd.chunk_state import chunk_state_template
from ...compute.ssd.dt import cumsum_bwd_template, cumsum_template
from ...compute.ssd.passing import head_sum_template, passing_bwd_template, passing_template
from ...compute.ssd.scan_bwd import chunk_scan_bwd_template
from ...compute.ssd.strategy import Strategy
from ..rule import Decisions, kernel_attrs, schedule_of
from ._ssd_common import F32, I32, _Ctx


class Gpu(Strategy):
    """blockIdx.x x threadIdx.x of ``threads``, a task per lane, scratch in registers, native math."""

    name = "gpu"
    scope = "local"

    def __init__(self, threads: int = 128):
        super().__init__(native_math=True)
        self.threads = threads

    def outer(self, extent):
        return T.thread_binding(self.blocks(extent), thread="blockIdx.x")

    def inner(self):
        return T.thread_binding(self.threads, thread="threadIdx.x")


def _bmm_chunk(s, TH):
    k = _Ctx(s)
    G, N, Q, bcd = s["ngroups"], s["dstate"], s["chunk_size"], s["bc_dtype"]

    @T.prim_func
    def func(b_h: T.handle, c_h: T.handle, cb_h: T.handle):
        Bt = T.int32()
        L = T.int32()
        NC = T.int32()
        Bm = T.match_buffer(b_h, (Bt, L, G, N), bcd)
        Cm = T.match_buffer(c_h, (Bt, L, G, N), bcd)
        cb = T.match_buffer(cb_h, (Bt, NC, G, Q, Q), F32)
        for bx in k.loop(T.ceildiv(Bt * NC * G * Q * Q, TH), "blockIdx.x"):
            for tx in k.loop(TH, "threadIdx.x"):
                acc = T.alloc_buffer((1,), F32, scope=k.scope)
                i = T.meta_var(bx * TH + tx)
                b = T.meta_var(i // (NC * G * Q * Q))
                c = T.meta_var(i // (G * Q * Q) % NC)
                g = T.meta_var(i // (Q * Q) % G)
                l = T.meta_var(i // Q % Q)
                sp = T.meta_var(i % Q)
                if i < Bt * NC * G * Q * Q:
                    acc[0] = T.float32(0)
                    for n in range(N):
                        acc[0] = acc[0] + k.ld(Cm, (b, T.min(c * Q + l, L - 1), g, n), L, c * Q + l) * k.ld(
                            Bm, (b, T.min(c * Q + sp, L - 1), g, n), L, c * Q + sp)
                    cb[b, c, g, l, sp] = acc[0]

    return func


# the chunk-scan templates (forward, dstates, backward) are in _ssd_scan.py, varlen states in _ssd_varlen.py
from ._ssd_scan import _chunk_scan, _chunk_scan_bwd_dstates  # noqa: E402
from ._ssd_varlen import _chunk_state_varlen  # noqa: E402

# one template for every target (compute/ssd/), laid out by the strategy
SHARED = {"ssd_chunk_cumsum": cumsum_template, "ssd_chunk_cumsum_bwd": cumsum_bwd_template,
          "ssd_state_passing": passing_template, "ssd_state_passing_bwd": passing_bwd_template,
          "ssd_head_sum": head_sum_template, "ssd_chunk_state": chunk_state_template,
          "ssd_chunk_scan_bwd": chunk_scan_bwd_template}
# CUDA-only templates of the chunk-matmul kernels (static dict, threads)
TEMPLATES = {"ssd_bmm_chunk": _bmm_chunk, "ssd_chunk_scan": _chunk_scan,
             "ssd_chunk_scan_bwd_dstates": _chunk_scan_bwd_dstates,
             "ssd_chunk_state_varlen": _chunk_state_varlen}


def template(name: str, static: dict, threads: int = 128, serial: bool = False):
    """The CUDA layout of kernel ``name`` (serial=True: thread loops made serial, CUDA's math: for CPU tests)."""
    if name in SHARED:
        dims = DIMS[name[len("ssd_"):]](**static)
        return SHARED[name](dims, Strategy(native_math=True) if serial else Gpu(threads))
    return TEMPLATES[name](dict(static, _serial=serial), threads)


def apply(func, target, decisions: Decisions):
    """The CUDA layout of an SSD kernel (same parameters as the compute builder), or None."""
    name, static = kernel_attrs(func)
    if "gpu" not in target.keys or (name not in TEMPLATES and name not in SHARED):
        return None
    threads = decisions.pick("threads", (64, 128, 256), 128)
    prim = template(name, static, threads).with_attrs({"global_symbol": name, "tirx.noalias": True,
                                                        "tvm_mamba.kernel": name})
    return schedule_of(prim, name=name)
