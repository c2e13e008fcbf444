"""mamba_chunk_scan_combined: mamba_ssm 2.3.x's Mamba-2 SSD API on TVM kernels, as torch custom ops.

Ops (namespace ``tvm_mamba``): ``ssd_fwd`` and ``ssd_bwd``, each with a fake (meta) implementation; the
forward has autograd registered.

Forward: ssd_chunk_cumsum -> ssd_chunk_state -> ssd_state_passing -> ssd_chunk_scan (compute/ssd/).
Backward: ssd_chunk_scan_bwd_dstates -> ssd_state_passing_bwd -> ssd_chunk_scan_bwd -> ssd_chunk_cumsum_bwd,
then fixed-order sums of the partials: dB / dC per part of each group's heads (summed in the kernel over the
part's heads; ssd_head_sum over the parts when there is more than one, compute/ssd/dims.head_parts) and
per-(batch, chunk) dD / dA / ddt_bias (torch sums). Deterministic: no atomics anywhere.

What backward keeps (two memory modes, ``keep_chunk_states``):
* default (False, lean): inputs + dt_out and dA_cumsum (2 * batch*nheads*seqlen fp32) + y_pre (the
  pre-gate output, only with z, x's dtype). The per-chunk states are recomputed in backward
  (chunk_state + state_passing: about a quarter of the forward's work).
* True: additionally the states entering every chunk, batch*nchunks*nheads*headdim*dstate fp32
  (e.g. 8*16*64*64*4 B = 2 MiB per sequence of 1024 at chunk 128), saving that recompute.
Both give bit-identical gradients (same kernels, same order).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..compute.ssd.dims import (BmmDims, DstatesDims, DtDims, HeadSumDims, PassingBwdDims, PassingDims, ScanBwdDims,
                                 ScanDims, StateDims, VarlenDims, head_parts)
from ._dlpack import FLOATS, TORCH_TO_TVM, check_shape, check_tensor, dummy, kernel_for, prepare, run_op, tvm_dtype

OP = "ssd"
F32 = torch.float32
NO_LIMIT = (0.0, math.inf)


def _f32(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else prepare(t.to(F32))


def _opt(t: Optional[Tensor], like: Tensor, dtype, ndim: int) -> Tensor:
    return prepare(t) if t is not None else dummy(like.device, dtype, ndim)


def _empty(like: Tensor) -> Tensor:
    return like.new_empty((0,))


class _Call:
    """Static dims, dtypes and the per-call normalized tensors shared by forward and backward."""

    def __init__(self, x, dt, A, B, C, chunk_size, D, z, dt_bias, seq_idx, dt_softplus, dt_limit):
        self.batch, self.seqlen, self.nheads, self.headdim = x.shape
        self.ngroups, self.dstate = B.shape[2], B.shape[3]
        self.Q = int(chunk_size)
        self.nchunks = -(-self.seqlen // self.Q)
        self.dev = x.device
        self.x, self.B, self.C = prepare(x), prepare(B), prepare(C)  # same dtype (_validate)
        self.z = prepare(z.to(x.dtype)) if z is not None else None
        self.dt, self.A, self.dt_bias = _f32(dt), _f32(A), _f32(dt_bias)
        self.D = _f32(D)
        self.seq_idx = prepare(seq_idx) if seq_idx is not None else None
        self.has_limit = tuple(float(v) for v in dt_limit) != NO_LIMIT
        self.limit = (torch.tensor([float(v) for v in dt_limit], dtype=F32, device=x.device) if self.has_limit
                      else dummy(x.device, F32, 1))
        self.has_seq = seq_idx is not None
        self.dt_dims = DtDims.cached(self.nheads, self.Q, dt_bias is not None, bool(dt_softplus), self.has_limit)
        # the model dims, seq_idx and dtypes of every kernel over x, B, C; the passing kernels take part of them
        self.chunk = dict(nheads=self.nheads, ngroups=self.ngroups, headdim=self.headdim, dstate=self.dstate,
                          chunk_size=self.Q, has_seq_idx=self.has_seq, x_dtype=tvm_dtype(self.x),
                          bc_dtype=tvm_dtype(self.B))
        self.passing = dict(nheads=self.nheads, headdim=self.headdim, dstate=self.dstate, chunk_size=self.Q,
                            has_seq_idx=self.has_seq)

    def kernel(self, direction, dims):
        """The compiled kernel of ``direction`` for the typed ``dims`` (compute/ssd/dims.py)."""
        return kernel_for(OP, direction, self.dev, dims, batch=self.batch, seqlen=self.seqlen)

    def on_chunks(self, cls, **flags):
        """``cls`` (StateDims or a subclass) for this call: its model dims and dtypes, plus ``flags``."""
        return cls.cached(**self.chunk, **flags)

    def chunk_shape(self):
        return (self.batch, self.nheads, self.nchunks, self.Q)

    def state_shape(self):
        return (self.batch, self.nchunks, self.nheads, self.headdim, self.dstate)

    def new(self, shape, dtype=F32):
        return torch.empty(shape, device=self.dev, dtype=dtype)

    @property
    def seq(self):
        return _opt(self.seq_idx, self.x, torch.int32, 2)

    @property
    def Dk(self):
        return self.D if self.D is not None else dummy(self.dev, F32, 1)

    def cumsum(self):
        dt_out, dA_cs = self.new(self.chunk_shape()), self.new(self.chunk_shape())
        self.kernel("chunk_cumsum", self.dt_dims)(
            self.dt, _opt(self.dt_bias, self.x, F32, 1), self.A, self.limit, dt_out, dA_cs)
        return dt_out, dA_cs

    def cb(self):
        """C.B^T per (batch, chunk, group): (batch, nchunks, ngroups, chunk, chunk) f32, shared by the heads."""
        cb = self.new((self.batch, self.nchunks, self.ngroups, self.Q, self.Q))
        self.kernel("bmm_chunk", BmmDims.cached(self.ngroups, self.dstate, self.Q, self.chunk["bc_dtype"]))(
            self.B, self.C, cb)
        return cb

    def states(self, dt_out, dA_cs, init, state_dtype=F32):
        """-> states_in (the state entering each chunk, stored in state_dtype), final_states (f32)."""
        states = self.new(self.state_shape())
        self.kernel("chunk_state", self.on_chunks(StateDims))(
            self.x, self.B, dt_out, dA_cs, self.seq, states)
        states_in = self.new(self.state_shape(), state_dtype)
        final = self.new((self.batch, self.nheads, self.headdim, self.dstate))
        passing = PassingDims.cached(**self.passing, has_init=init is not None, state_dtype=TORCH_TO_TVM[state_dtype])
        self.kernel("state_passing", passing)(states, dA_cs, _opt(init, self.x, F32, 4), self.seq, states_in, final)
        return states_in, final

    def varlen_states(self, dt_out, dA_cs, states_in, cu_seqlens, out_dtype):
        """The final state of every sequence packed into the batch-1 row: (num_seqs, nheads, headdim, dstate)
        in out_dtype (ssd_chunk_state_varlen)."""
        out = self.new((cu_seqlens.shape[0] - 1, self.nheads, self.headdim, self.dstate), out_dtype)
        seq = self.seq_idx[0] if self.seq_idx is not None else dummy(self.dev, torch.int32, 1)
        dims = self.on_chunks(VarlenDims, state_dtype=TORCH_TO_TVM[states_in.dtype], out_dtype=tvm_dtype(out))
        self.kernel("chunk_state_varlen", dims)(
            self.x[0], self.B[0], dt_out[0], dA_cs[0], states_in[0], cu_seqlens, seq, out)
        return out


def _call(x, dt, A, B, C, chunk_size, D, z, dt_bias, seq_idx, dt_softplus, dt_limit):
    return _Call(x, dt, A, B, C, chunk_size, D, z, dt_bias, seq_idx, dt_softplus, dt_limit)


@torch.library.custom_op("tvm_mamba::ssd_fwd", mutates_args=())
def ssd_fwd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Optional[Tensor],
            z: Optional[Tensor], dt_bias: Optional[Tensor], initial_states: Optional[Tensor],
            seq_idx: Optional[Tensor], dt_softplus: bool, dt_limit: Sequence[float],
            keep_chunk_states: bool, cu_seqlens: Optional[Tensor] = None,
            state_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x: (batch, seqlen, nheads, headdim) ... -> y (x's dtype), final_states (batch, nheads, headdim, dstate)
    f32, and for backward: dt_out, dA_cumsum (batch, nheads, nchunks, chunk_size) f32, states_in
    (batch, nchunks, nheads, headdim, dstate) f32 or (0,), y_pre (x's shape and dtype, or (0,) without z);
    last, varlen_states (num_seqs, nheads, headdim, dstate) in state_dtype (default C's dtype, as upstream)
    when cu_seqlens (int32, validated, batch 1) is given, else (0,). The chunk states are stored in
    state_dtype (default float32); they are kept for backward only when float32."""
    k = _call(x, dt, A, B, C, chunk_size, D, z, dt_bias, seq_idx, dt_softplus, dt_limit)
    sdt = F32 if state_dtype is None else state_dtype
    dt_out, dA_cs = k.cumsum()
    states_in, final = k.states(dt_out, dA_cs, _f32(initial_states), sdt)
    varlen = (k.varlen_states(dt_out, dA_cs, states_in, prepare(cu_seqlens), state_dtype or C.dtype)
              if cu_seqlens is not None else _empty(final))
    y = torch.empty_like(k.x)
    y_pre = torch.empty_like(k.x) if z is not None else _empty(k.x)
    scan = k.on_chunks(ScanDims, has_D=D is not None, D_has_hdim=D is not None and D.dim() == 2, has_z=z is not None,
                       state_dtype=TORCH_TO_TVM[sdt], has_init=initial_states is not None)
    k.kernel("chunk_scan", scan)(
        k.x, _opt(k.z, k.x, k.x.dtype, 4), k.cb(), k.C, dt_out, dA_cs, states_in, k.Dk, k.seq, y,
        y_pre if z is not None else dummy(k.dev, k.x.dtype, 4))
    keep = keep_chunk_states and sdt == F32  # other state dtypes: backward recomputes float32 states
    return y, final, dt_out, dA_cs, states_in if keep else _empty(final), y_pre, varlen


@ssd_fwd.register_fake
def _(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit, keep_chunk_states,
      cu_seqlens=None, state_dtype=None):
    batch, seqlen, nheads, headdim = x.shape
    dstate = B.shape[3]
    nchunks = -(-seqlen // chunk_size)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    final = x.new_empty((batch, nheads, headdim, dstate), dtype=F32)
    dt_out = x.new_empty((batch, nheads, nchunks, chunk_size), dtype=F32)
    keep = keep_chunk_states and state_dtype in (None, F32)
    states = (x.new_empty((batch, nchunks, nheads, headdim, dstate), dtype=F32) if keep
              else x.new_empty((0,), dtype=F32))
    y_pre = torch.empty_like(y) if z is not None else x.new_empty((0,))
    varlen = (x.new_empty((cu_seqlens.shape[0] - 1, nheads, headdim, dstate), dtype=state_dtype or C.dtype)
              if cu_seqlens is not None else x.new_empty((0,), dtype=F32))
    return y, final, dt_out, torch.empty_like(dt_out), states, y_pre, varlen


@torch.library.custom_op("tvm_mamba::ssd_bwd", mutates_args=())
def ssd_bwd(dy: Tensor, dfinal: Optional[Tensor], x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
            chunk_size: int, D: Optional[Tensor], z: Optional[Tensor], dt_bias: Optional[Tensor],
            initial_states: Optional[Tensor], seq_idx: Optional[Tensor], dt_softplus: bool,
            dt_limit: Sequence[float], dt_out: Tensor, dA_cs: Tensor, states_in: Optional[Tensor],
            y_pre: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dx, ddt, dA, dB, dC, dD or (0,), dz or (0,), ddt_bias or (0,), dinitial_states or (0,)) of
    ssd_fwd; states_in None means recompute the chunk states."""
    k = _call(x, dt, A, B, C, chunk_size, D, z, dt_bias, seq_idx, dt_softplus, dt_limit)
    init = _f32(initial_states)
    if states_in is None:
        states_in, _ = k.states(dt_out, dA_cs, init)
    dy = prepare(dy.to(k.x.dtype))
    has_z = z is not None
    xdt = k.x.dtype
    # 1. dstates from the carried-state term of every chunk (and dz)
    dsl = k.new(k.state_shape())
    dz = torch.empty_like(k.x) if has_z else _empty(k.x)
    k.kernel("chunk_scan_bwd_dstates", k.on_chunks(DstatesDims, has_z=has_z))(
        dy, _opt(k.z, k.x, xdt, 4), _opt(prepare(y_pre) if has_z else None, k.x, xdt, 4), k.C, dA_cs, k.seq,
        dsl, dz if has_z else dummy(k.dev, xdt, 4))
    # 2. reverse state passing
    dso = k.new(k.state_shape())
    dinit = k.new((k.batch, k.nheads, k.headdim, k.dstate)) if init is not None else _empty(dso)
    ddecay = k.new((k.batch, k.nheads, k.nchunks))
    k.kernel("state_passing_bwd", PassingBwdDims.cached(**k.passing, has_init=init is not None,
                                                        has_dfinal=dfinal is not None))(
        states_in, dsl, dA_cs, _f32(dfinal) if dfinal is not None else dummy(k.dev, F32, 4), k.seq, dso,
        dinit if init is not None else dummy(k.dev, F32, 4), ddecay)
    # 3. every per-chunk gradient
    dx = torch.empty_like(k.x)
    gparts = k.ngroups * head_parts(k.batch, k.nchunks, k.nheads, k.ngroups)
    dBp = k.new((k.batch, k.seqlen, gparts, k.dstate))  # per (group, part of its heads); = dB, dC at 1 part
    dCp = k.new((k.batch, k.seqlen, gparts, k.dstate))
    ddt_out, ddA = k.new(k.chunk_shape()), k.new(k.chunk_shape())
    has_D = D is not None
    dD_part = k.new((k.batch, k.nchunks, k.nheads, k.headdim)) if has_D else dummy(k.dev, F32, 4)
    k.kernel("chunk_scan_bwd", k.on_chunks(ScanBwdDims, has_D=has_D, D_has_hdim=has_D and D.dim() == 2, has_z=has_z))(
        k.x, _opt(k.z, k.x, xdt, 4), dy, k.B, k.C, k.cb(), dt_out, dA_cs, states_in, dso, k.Dk, k.seq, dx, dBp,
        dCp, ddt_out, ddA, dD_part, k.new((k.batch, k.nchunks, gparts, k.Q, k.Q)))  # workspace: (g x^T) K dt
    # 4. through the chunk cumsum, softplus and clamp
    ddt = k.new((k.batch, k.seqlen, k.nheads))
    dA_part, dbias_part = k.new((k.batch, k.nheads)), k.new((k.batch, k.nheads))
    k.kernel("chunk_cumsum_bwd", k.dt_dims)(
        k.dt, _opt(k.dt_bias, k.x, F32, 1), k.A, k.limit, dt_out, ddt_out, ddA, ddecay, ddt, dA_part, dbias_part)
    # fixed-order reductions of the partials (parts of a group's heads, batch, chunks)
    if gparts == k.ngroups and k.B.dtype == F32:
        dB, dC = dBp, dCp
    else:  # the parts' sum, in part order, in B's dtype (C is cast to it)
        head_sum = k.kernel("head_sum", HeadSumDims.cached(gparts, k.ngroups, k.dstate, tvm_dtype(k.B)))
        dB, dC = (k.new((k.batch, k.seqlen, k.ngroups, k.dstate), k.B.dtype) for _ in range(2))
        head_sum(dBp, dB)
        head_sum(dCp, dC)
    dD = _empty(dx)
    if has_D:
        dD = dD_part.sum((0, 1))
        dD = (dD if D.dim() == 2 else dD.sum(-1)).to(D.dtype)
    ddt_bias = dbias_part.sum(0).to(dt_bias.dtype) if dt_bias is not None else _empty(dx)
    dinit = dinit.to(initial_states.dtype) if initial_states is not None else dinit
    return (dx, ddt.to(dt.dtype), dA_part.sum(0).to(A.dtype), dB, dC.to(C.dtype), dD, dz, ddt_bias,
            dinit)


@ssd_bwd.register_fake
def _(dy, dfinal, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit,
      dt_out, dA_cs, states_in, y_pre):
    e = x.new_empty((0,))
    cf = torch.contiguous_format
    return (torch.empty_like(x, memory_format=cf), torch.empty_like(dt, memory_format=cf), torch.empty_like(A),
            torch.empty_like(B, memory_format=cf), torch.empty_like(C, memory_format=cf),
            torch.empty_like(D) if D is not None else e,
            torch.empty_like(x, memory_format=cf) if z is not None else e,
            torch.empty_like(dt_bias) if dt_bias is not None else e,
            torch.empty_like(initial_states, memory_format=cf) if initial_states is not None else e.float())


def _setup_context(ctx, inputs, output):
    (x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit,
     keep_chunk_states, _cu_seqlens, _state_dtype) = inputs
    _, _, dt_out, dA_cs, states_in, y_pre, _varlen = output
    keep_chunk_states = states_in.numel() > 0  # kept only for float32 chunk states (ssd_fwd)
    # the aux outputs carry no gradient; unused gradients stay None (no zero-filled (batch, seqlen, ...)
    # tensors from the autograd engine: y_pre alone is x's size)
    ctx.mark_non_differentiable(dt_out, dA_cs, states_in, y_pre)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, dt_out, dA_cs,
                          states_in if keep_chunk_states else None, y_pre if z is not None else None)
    ctx.args = (chunk_size, dt_softplus, tuple(dt_limit))


def _backward(ctx, dy, dfinal, *aux):
    if aux[-1] is not None:  # mamba_ssm: "return_varlen_states is not supported in backward"
        raise NotImplementedError(
            "mamba_chunk_scan_combined: no gradient flows through varlen_states (return_varlen_states=True); as "
            "in mamba_ssm, varlen states are for inference (y and final_states do have gradients)")
    x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, dt_out, dA_cs, states_in, y_pre = ctx.saved_tensors
    chunk_size, dt_softplus, dt_limit = ctx.args
    if dy is None and dfinal is None:
        return (None,) * 16
    if dy is None:
        dy = torch.zeros_like(x)
    grads = torch.ops.tvm_mamba.ssd_bwd(dy, dfinal, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states,
                                        seq_idx, dt_softplus, list(dt_limit), dt_out, dA_cs, states_in, y_pre)
    dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinit = grads
    return (dx, ddt, dA, dB, dC, None, dD if D is not None else None, dz if z is not None else None,
            ddt_bias if dt_bias is not None else None, dinit if initial_states is not None else None,
            None, None, None, None, None, None)


ssd_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------
# Public API (mamba_ssm 2.3.x mamba_chunk_scan_combined name, argument order and semantics)
# ----------------------------------------------------------------------------------------------------
def _validate(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_limit):
    check_tensor("x", x, ndim=4, dtypes=FLOATS)
    batch, seqlen, nheads, headdim = x.shape
    dev = x.device
    if batch < 1 or seqlen < 1 or nheads < 1:
        raise ValueError(f"x: batch, seqlen and nheads must be >= 1, got shape {tuple(x.shape)}")
    if not 1 <= headdim <= 256:
        raise ValueError(f"x: headdim must be in 1..256, got {headdim}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size: expected an int, got {type(chunk_size).__name__}")
    if not 1 <= chunk_size <= 256:
        raise ValueError(f"chunk_size: must be in 1..256, got {chunk_size}")
    check_tensor("dt", dt, ndim=3, dtypes=FLOATS, device=dev)
    check_shape("dt", dt, (batch, seqlen, nheads))
    check_tensor("A", A, ndim=1, dtypes=FLOATS, device=dev)
    check_shape("A", A, (nheads,))
    check_tensor("B", B, ndim=4, dtypes=FLOATS, device=dev)
    ngroups, dstate = B.shape[2], B.shape[3]
    if B.shape[:2] != (batch, seqlen) or ngroups < 1:
        raise ValueError(f"B: expected (batch={batch}, seqlen={seqlen}, ngroups, dstate), got {tuple(B.shape)}")
    if nheads % ngroups:
        raise ValueError(f"B: ngroups={ngroups} must divide nheads={nheads}")
    if not 1 <= dstate <= 256:
        raise ValueError(f"B: dstate must be in 1..256, got {dstate}")
    check_tensor("C", C, ndim=4, dtypes=FLOATS, device=dev)
    check_shape("C", C, tuple(B.shape))
    if C.dtype != B.dtype:  # the kernels take one B / C dtype; a silent cast lost C's precision (issue #16)
        raise TypeError(f"C: dtype {C.dtype} differs from B's {B.dtype}; pass B and C in one dtype "
                        f"(e.g. C.to(B.dtype), or both in float32)")
    if D is not None:
        check_tensor("D", D, dtypes=FLOATS, device=dev)
        if tuple(D.shape) not in ((nheads,), (nheads, headdim)):
            raise ValueError(f"D: expected shape ({nheads},) or ({nheads}, {headdim}), got {tuple(D.shape)}")
    if z is not None:
        check_tensor("z", z, ndim=4, dtypes=FLOATS, device=dev)
        check_shape("z", z, tuple(x.shape))
    if dt_bias is not None:
        check_tensor("dt_bias", dt_bias, ndim=1, dtypes=FLOATS, device=dev)
        check_shape("dt_bias", dt_bias, (nheads,))
    if initial_states is not None:
        check_tensor("initial_states", initial_states, ndim=4, dtypes=FLOATS, device=dev)
        check_shape("initial_states", initial_states, (batch, nheads, headdim, dstate))
    if seq_idx is not None:
        check_seq_idx(seq_idx, batch, seqlen, dev, padding=True)
    return dt_limit_pair(dt_limit)


def check_seq_idx(seq_idx: Tensor, batch: int, seqlen: int, dev, padding: bool = False) -> None:
    """seq_idx: (batch, seqlen) int32 on ``dev``, nondecreasing along seqlen (also mamba_split's check). With
    ``padding`` (the SSD and mamba_split; not Mamba-3, whose kernels take no padding) a row may end in padding
    marked by negative ids, causal-conv1d's padding marker: from its first negative id on, every id is negative
    (and nondecreasing), so each id still holds one contiguous run of positions."""
    check_tensor("seq_idx", seq_idx, ndim=2, dtypes=(torch.int32,), device=dev)
    check_shape("seq_idx", seq_idx, (batch, seqlen))
    # upstream documents nondecreasing ids; a decrease (e.g. 0 1 0) gave chunk_size-dependent answers, since
    # the kernels compare a position's id with its chunk's last id and the previous chunk's last id only (equal
    # or not: a trailing run of -1 is a sequence of its own, as in upstream's kernels).
    # A data-dependent check: skipped while torch.compile traces (fake tensors have no values)
    if seqlen > 1 and not torch.compiler.is_compiling():
        ids = seq_idx.long()
        if padding:  # negative ids order after every sequence id: a trailing run of them is in order
            ids = torch.where(ids < 0, ids + 2 ** 32, ids)
        down = ids[:, 1:] < ids[:, :-1]
        if bool(down.any()):
            row = int(down.any(1).nonzero()[0, 0])
            rule = " (negative ids: only as padding to the row's end)" if padding else ""
            raise ValueError(f"seq_idx: must be nondecreasing along seqlen{rule}, row {row} decreases")


def dt_limit_pair(dt_limit) -> tuple[float, float]:
    """dt_limit as (low, high) floats: TypeError for anything but a pair of numbers, ValueError unless low <= high."""
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise TypeError(f"dt_limit: expected a pair of floats (low, high), got {dt_limit!r}") from None
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(f"dt_limit: expected low <= high, got {dt_limit!r}")
    return lo, hi


def validate_cu_seqlens(cu_seqlens, seq_idx, x, padding: bool = False):
    """cu_seqlens: (num_seqs + 1,) int32 / int64 on x's device, batch 1, 0 = cu[0] <= ... <= cu[-1] = seqlen
    (<= seqlen with ``padding``: the positions from cu[-1] on are padding, belonging to no sequence, as in
    mamba_ssm's test_generation_varlen_with_padding), and where seq_idx is given too, seq_idx changes exactly
    at the starts of the (non-empty) sequences before cu[-1] (the padding's ids are seq_idx's own business).
    -> cu_seqlens as int32. The value checks are skipped while torch.compile traces (fake tensors)."""
    if cu_seqlens is None:
        raise ValueError("cu_seqlens: required when return_varlen_states=True (the packed sequences' boundaries)")
    batch, seqlen = x.shape[:2]
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32, torch.int64), device=x.device)
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected (num_sequences + 1,) with at least one sequence, got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if batch != 1:
        raise ValueError(f"cu_seqlens: packed sequences need batch 1 (as mamba_ssm), x has batch {batch}")
    if not torch.compiler.is_compiling():
        cu = cu_seqlens.cpu().long()
        end = int(cu[-1])
        if int(cu[0]) != 0:
            raise ValueError(f"cu_seqlens: must start at 0, got {int(cu[0])}")
        if bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens: must be non-decreasing, got {cu.tolist()}")
        if end > seqlen or (end < seqlen and not padding):
            rule = " or before it (the positions after its last entry are padding)" if padding else ""
            raise ValueError(f"cu_seqlens: must end at seqlen={seqlen}{rule}, got {end}")
        if seq_idx is not None and end > 1:
            _check_seq_starts(cu, seq_idx[0, :end].cpu())
    return cu_seqlens.to(torch.int32)


def _check_seq_starts(cu: Tensor, ids: Tensor) -> None:
    """ValueError unless ids (the seq_idx of positions 0 .. cu[-1]-1) change exactly where a non-empty
    sequence of cu starts."""
    end = ids.shape[0]
    starts = torch.zeros(end, dtype=torch.bool)
    starts[cu[(cu > 0) & (cu < end)]] = True
    changes = ids[1:] != ids[:-1]
    if not torch.equal(changes, starts[1:]):
        t = int((changes != starts[1:]).nonzero()[0, 0]) + 1
        raise ValueError(f"cu_seqlens: inconsistent with seq_idx at position {t} (seq_idx must change "
                         f"exactly where a packed sequence starts)")


def seq_idx_of(cu_seqlens: Tensor, seqlen: int) -> Tensor:
    """(1, seqlen) int32 sequence index of each position of packed sequences (validated cu_seqlens): the
    number of sequences ending at or before it, so an empty sequence takes an index no position has, and
    padding after cu_seqlens[-1] takes num_seqs (a sequence of its own)."""
    t = torch.arange(seqlen, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), t, right=True).to(torch.int32)[None]


def _check_state_dtype(state_dtype):
    if state_dtype is not None and state_dtype not in FLOATS:
        raise TypeError(f"state_dtype: expected None or one of {FLOATS}, got {state_dtype!r}")


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False, state_dtype=None, *,
                              keep_chunk_states=False):
    """Mamba-2 SSD scan.

    x, z: (batch, seqlen, nheads, headdim); dt: (batch, seqlen, nheads); A: (nheads,); B, C:
    (batch, seqlen, ngroups, dstate) of one dtype, ngroups | nheads; D: (nheads,) or (nheads, headdim); dt_bias:
    (nheads,); initial_states: (batch, nheads, headdim, dstate); seq_idx: (batch, seqlen) int32,
    nondecreasing per row, or ending in negative ids (padding); cu_seqlens: (num_sequences + 1,) int32/int64,
    batch 1, 0 = cu[0] <= ... <= cu[-1] <= seqlen, only used with return_varlen_states (as upstream): the
    positions from cu[-1] on are padding (no varlen state; y there follows seq_idx, as upstream's, which
    ignores cu_seqlens for y); chunk_size in 1..256 (any seqlen).
    Returns y: (batch, seqlen, nheads, headdim) in x's dtype; then final_states (batch, nheads, headdim,
    dstate) float32 when return_final_states; then varlen_states (num_sequences, nheads, headdim, dstate),
    the state after each packed sequence's last position, in state_dtype (default C's dtype, as upstream),
    when return_varlen_states.

    dt <- clamp(softplus(dt + dt_bias)) (softplus if dt_softplus, clamp if dt_limit != (0, inf));
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T; y_t = h_t C_t + D x_t; y *= silu(z); h restarts from 0
    where seq_idx changes (initial_states continue the sequence with id 0).
    state_dtype: the dtype the states entering each chunk are stored in (y reads them; default float32,
    upstream's default is C's dtype); final_states stay float32. Backward always uses float32 states.
    keep_chunk_states (extension): keep the per-chunk states from the forward for backward instead of
    recomputing them (faster backward, batch*nchunks*nheads*headdim*dstate fp32 more memory; float32
    chunk states only).
    """
    lo, hi = _validate(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_limit)
    _check_state_dtype(state_dtype)
    cu = validate_cu_seqlens(cu_seqlens, seq_idx, x, padding=True) if return_varlen_states else None
    y, final, *_, varlen = run_op(ssd_fwd, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                                  bool(dt_softplus), [lo, hi], bool(keep_chunk_states), cu, state_dtype)
    out = (y, final) if return_final_states else (y,)
    if return_varlen_states:
        out = out + (varlen,)
    return out if len(out) > 1 else y
