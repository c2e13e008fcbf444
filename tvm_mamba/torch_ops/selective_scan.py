"""selective_scan_fn / selective_state_update: mamba_ssm 2.3.x's Mamba-1 scan API on TVM kernels (complex A:
_selective_scan_complex.py).

Ops (namespace ``tvm_mamba``): ``selective_scan_fwd`` (autograd registered), ``selective_scan_bwd``,
``selective_state_update`` (state updated in place); each has a fake (meta) implementation.

Forward algorithm: the sequential scan, or on CPU the chunked parallel-in-time scan when lanes cannot keep
the cores busy (``fwd_direction``; both produce the same checkpoints, so the backward is shared).

Backward memory: autograd keeps the forward's inputs and no state at all (mamba_ssm keeps one state per
2048 steps, 8 dim dstate bytes each). The backward op first reruns the forward kernel (the same kernel on the
same inputs: bitwise the same states) to rebuild the chunk-boundary states ``checkpoints`` (batch, dim,
ceil(seqlen/chunk), dstate) fp32, chunk = ``chunk_for(dstate)`` (48 at dstate 16), held only while the
backward runs (its out goes into the du buffer, which the backward kernel overwrites next); then the
backward kernel recomputes the states of one chunk at a time from them and runs the reverse scan.
Cost: one forward kernel per backward (docs/selective_scan.md has the figures).
Workspace (fp32, one allocation: ``bwd_workspace``): per-(batch, channel) partials of dA / D / delta_bias /
time-invariant dB, dC (batch, dim, dstate); for time-varying B/C, per-(batch, channel block) partials (batch,
dim/block, seqlen, dstate), summed in a fixed order in a second stage (deterministic, no atomics).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..compute.selective_scan.dims import (WEBGPU_BLOCK, WEBGPU_PRIVATE_FLOATS, ScanBwdDims, ScanDims, UpdateDims, block_size,
                                           chunk_size)
from ..runtime.target import device_target_key
from ..compute.selective_scan.dims import bwd_workspace
from ._selective_scan_complex import complex_scan
from ._dlpack import (FLOATS, check_no_overlap, check_shape, check_tensor, dummy, kernel_device_type, kernel_for,
                      kernel_may_write, prepare, prepare_pool, run_op, slot_stats, tvm_dtype)
from ._fastpath import FastPath
from ._selective_scan_kernel import OP, acc_of, new_states, opt, scan_dims, scan_forward


def chunk_for(dstate: int, device=None) -> int:
    """Checkpoint interval: the backward keeps (chunk+1) x dstate states per lane on the stack (<= 17 KiB);
    checkpoint memory is 1/chunk of storing every state. On WebGPU (``tvm_mamba.webgpu()``) a lane's private
    memory is 8 KB: a shorter chunk (``chunk_size``'s ``private_floats``). ``device``: the tensors' (None: the
    interval of every other target)."""
    webgpu = device is not None and device_target_key(device) == "webgpu"
    return chunk_size(dstate, WEBGPU_PRIVATE_FLOATS if webgpu else None)


# Algorithm choice for the forward: the chunked (parallel-in-time) scan runs the recurrence twice (local
# scans, then the fix-up) in the dstate layout, spread over lanes x chunks. Measured here on one thread
# (fp32, dstate 16, seqlen 4096): against the dstate-layout sequential scan (dim 4) 0.296 vs 0.200 ms,
# against the channels layout (dim 16, 16 channels per lane) 1.25 vs 0.50 ms — the core-time factors below.
# It pays only when the sequential scan's lanes cannot fill the cores: never on this 2-core machine, on a
# 64-core host below ~25 channel-lanes. (The tuning issue is to learn these per machine.)
CHUNKED_COST = {"channels": 2.5, "dstate": 1.5}
CHANNELS_PER_LANE = 16


def _cores() -> int:
    from ..runtime.target import num_cores

    return num_cores()


def fwd_direction(batch: int, dim: int, seqlen: int, chunk: int, device_type: str, cores: int | None = None) -> str:
    """"fwd" (sequential scan) or "fwd_chunked" (local scans, carry, fix-up) for this shape (CPU only)."""
    if device_type != "cpu" or seqlen < 4 * chunk:
        return "fwd"
    cores = cores or _cores()
    layout = "channels" if dim % CHANNELS_PER_LANE == 0 else "dstate"
    seq_lanes = batch * dim // CHANNELS_PER_LANE if layout == "channels" else batch * dim
    chunked_speed = min(cores, batch * dim * (-(-seqlen // chunk))) / CHUNKED_COST[layout]
    return "fwd_chunked" if chunked_speed > 1.2 * min(cores, seq_lanes) else "fwd"


def _bc_kernel(M: Tensor) -> tuple[Tensor, int]:
    """B/C in the kernel layout: (dim, dstate) stays; (batch, dstate, L) / (batch, g, dstate, L) become
    (batch, g, L, dstate) contiguous. Returns (tensor, groups) with groups 0 for time-invariant."""
    if M.dim() == 2:
        return prepare(M), 0
    if M.dim() == 3:
        M = M.unsqueeze(1)
    return prepare(M.transpose(-1, -2)), M.shape[1]


def _bc_user(dM: Tensor, like: Tensor) -> Tensor:
    """Inverse of :func:`_bc_kernel` for gradients."""
    if like.dim() == 2:
        return dM
    dM = dM.transpose(-1, -2)
    return (dM.squeeze(1) if like.dim() == 3 else dM).contiguous()


def _dims(cls, u, A, Bk, bg, Ck, cg, D, z, delta_bias, delta_softplus, initial_state, **extra):
    """``scan_dims`` with the real scan's checkpoint chunk."""
    return scan_dims(cls, u, A, Bk, bg, Ck, cg, D, z, delta_bias, delta_softplus, initial_state,
                     chunk_for(A.shape[1], u.device), **extra)


def _scan_forward(u: Tensor, delta: Tensor, A: Tensor, Bk: Tensor, bg: int, Ck: Tensor, cg: int,
                  D: Optional[Tensor], z: Optional[Tensor], delta_bias: Optional[Tensor],
                  initial_state: Optional[Tensor], delta_softplus: bool, out: Optional[Tensor] = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """The forward kernel on kernel-layout B/C (``_bc_kernel``) -> (out, last_state, checkpoints). Called by
    the forward op and again by the backward op to rebuild the checkpoints: the same kernel (``fwd_direction``
    depends on the shape only) on the same inputs, so the rebuilt checkpoints are bitwise the forward's.
    out: a (batch, dim, seqlen) buffer in u's dtype to write out into (``scan_forward``)."""
    batch, dim, seqlen = u.shape
    dims = _dims(ScanDims, u, A, Bk, bg, Ck, cg, D, z, delta_bias, delta_softplus, initial_state)
    direction = fwd_direction(batch, dim, seqlen, dims.chunk, kernel_device_type(u.device))
    return scan_forward(direction, dims, u, delta, A, Bk, Ck, D, z, delta_bias, initial_state, out)


@torch.library.custom_op("tvm_mamba::selective_scan_fwd", mutates_args=())
def selective_scan_fwd(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                       z: Optional[Tensor], delta_bias: Optional[Tensor], initial_state: Optional[Tensor],
                       delta_softplus: bool) -> tuple[Tensor, Tensor, Tensor]:
    """u: (batch, dim, seqlen) -> out: (batch, dim, seqlen), last_state: (batch, dim, dstate),
    checkpoints: (batch, dim, ceil(seqlen/chunk), dstate) (the state before each chunk; autograd does not
    keep them: the backward op rebuilds them)."""
    Bk, bg = _bc_kernel(B)
    Ck, cg = _bc_kernel(C)
    return _scan_forward(u, delta, A, Bk, bg, Ck, cg, D, z, delta_bias, initial_state, delta_softplus)


@selective_scan_fwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus):
    return (torch.empty_like(u, memory_format=torch.contiguous_format),
            *new_states(u, A, chunk_for(A.shape[1], u.device)))


def _empty0(like: Tensor) -> Tensor:
    return like.new_empty((0,))


@torch.library.custom_op("tvm_mamba::selective_scan_bwd", mutates_args=())
def selective_scan_bwd(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                       z: Optional[Tensor], delta_bias: Optional[Tensor], initial_state: Optional[Tensor],
                       checkpoints: Optional[Tensor], dout: Tensor, dlast: Optional[Tensor], delta_softplus: bool
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state) of selective_scan_fwd;
    absent optional inputs get (0,) gradients. dlast: gradient flowing in through last_state. checkpoints:
    the forward's, or None (what autograd passes): rebuilt here by one run of the forward kernel, held only
    while this op runs."""
    batch, dim, seqlen = u.shape
    dstate, acc = A.shape[1], acc_of(u)
    Bk, bg = _bc_kernel(B)
    Ck, cg = _bc_kernel(C)
    blk = block_size(dim, bg, cg, WEBGPU_BLOCK if device_target_key(u.device) == "webgpu" else 16)
    dims = _dims(ScanBwdDims, u, A, Bk, bg, Ck, cg, D, z, delta_bias, delta_softplus, initial_state, block=blk)
    u, delta = prepare(u), prepare(delta)
    dout = prepare(dout.to(u.dtype))
    dlast = prepare(dlast.to(acc)) if dlast is not None else u.new_zeros((batch, dim, dstate), dtype=acc)
    du, ddelta = torch.empty_like(u), torch.empty_like(u)
    dA = torch.empty_like(prepare(A))
    dBk, dCk = torch.empty_like(Bk), torch.empty_like(Ck)
    dD = torch.empty_like(D) if D is not None else dummy(u.device, acc, 1)
    dz = torch.empty_like(u) if z is not None else dummy(u.device, u.dtype, 3)
    ddb = torch.empty_like(delta_bias) if delta_bias is not None else dummy(u.device, acc, 1)
    dinit = (u.new_empty((batch, dim, dstate), dtype=acc) if initial_state is not None
             else dummy(u.device, acc, 3))  # cached placeholder: a fresh small tensor after big ones page-faults
    if batch * dim == 0:  # an empty scan: every gradient is zero (dinit passes dlast through)
        for t in (du, ddelta, dA, dBk, dCk, dD, ddb, dz):
            t.zero_()
        if initial_state is not None:
            dinit.copy_(dlast)
        return (du, ddelta, dA, _bc_user(dBk, B), _bc_user(dCk, C),
                dD if D is not None else _empty0(dD), dz if z is not None else _empty0(u),
                ddb if delta_bias is not None else _empty0(ddb), dinit if initial_state is not None else _empty0(dinit))
    if checkpoints is None and seqlen <= dims.chunk:  # one chunk: its checkpoint is the initial state
        checkpoints = (prepare(initial_state.to(acc)).unsqueeze(2) if initial_state is not None
                       else u.new_zeros((batch, dim, 1, dstate), dtype=acc))
    if checkpoints is None:
        checkpoints = _scan_forward(u, delta, A, Bk, bg, Ck, cg, D, z, delta_bias, initial_state, delta_softplus,
                                    out=du)[2]
    ws = u.new_empty((bwd_workspace(dims, batch, seqlen)[1],), dtype=acc)  # the partials of every region
    kern = kernel_for(OP, "bwd", u.device, dims, seqlen=seqlen)
    kern(u, delta, prepare(A), Bk, Ck, opt(D, u, acc, 1), opt(z, u, u.dtype, 3), opt(delta_bias, u, acc, 1),
         opt(initial_state, u, acc, 3), prepare(checkpoints), dout, dlast,
         du, ddelta, dA, dBk, dCk, dD, ddb, dz, dinit, ws)
    return (du, ddelta, dA, _bc_user(dBk, B), _bc_user(dCk, C),
            dD if D is not None else _empty0(dD), dz if z is not None else _empty0(u),
            ddb if delta_bias is not None else _empty0(ddb), dinit if initial_state is not None else _empty0(dinit))


@selective_scan_bwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, initial_state, checkpoints, dout, dlast, delta_softplus):
    acc = acc_of(u)
    like = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    return (like(u), like(u), like(A), like(B), like(C),
            like(D) if D is not None else u.new_empty((0,), dtype=acc),
            like(u) if z is not None else u.new_empty((0,)),
            like(delta_bias) if delta_bias is not None else u.new_empty((0,), dtype=acc),
            u.new_empty(tuple(u.shape[:2]) + (A.shape[1],), dtype=acc) if initial_state is not None
            else u.new_empty((0,), dtype=acc))


def _setup_context(ctx, inputs, output):
    u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus = inputs
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state)  # no checkpoints: see the docstring
    ctx.delta_softplus = delta_softplus


def _backward(ctx, dout, dlast, _dck):
    u, delta, A, B, C, D, z, delta_bias, initial_state = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(u)
    grads = torch.ops.tvm_mamba.selective_scan_bwd(u, delta, A, B, C, D, z, delta_bias, initial_state, None,
                                                   dout, dlast, ctx.delta_softplus)
    du, ddelta, dA, dB, dC, dD, dz, ddb, dinit = grads
    return (du, ddelta, dA, dB, dC, dD if D is not None else None, dz if z is not None else None,
            ddb if delta_bias is not None else None, dinit if initial_state is not None else None, None)


selective_scan_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check_slots(idx: Tensor, nstate: int) -> None:
    """ValueError unless every state_batch_indices entry is a padding row (< 0) or a distinct slot < nstate:
    run inside the op (also under torch.compile), before the kernel, so a refused call writes nothing."""
    if idx.numel() == 0:
        return
    hi, dup = slot_stats(idx)
    if hi >= nstate:
        raise ValueError(f"state_batch_indices: index {hi} is out of range for a state pool of {nstate} slots "
                         f"(state.shape[0]); valid: 0..{nstate - 1}, or negative for a padding row")
    if dup:
        raise ValueError("state_batch_indices: two rows name the same state slot (each row updates its slot in "
                         "place; a shared slot would be a race)")


def _update_dims(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                 z: Optional[Tensor], dt_bias: Optional[Tensor], dt_softplus: bool,
                 idx: Optional[Tensor]) -> UpdateDims:
    """The decode step's typed dims: the state, dt and z dtypes and the index dtype stay None where they are
    the defaults (accumulation dtype; x's dtype; no indices), and ``tie_hdim`` False for the untied kernel,
    so those kernels keep their keys (and tuning records)."""
    m1 = x.dim() == 2  # Mamba-1's own layout: nheads = dim, headdim 1, one group
    nheads, headdim, dstate = (state.shape[1], 1, state.shape[2]) if m1 else state.shape[1:]
    other = lambda t, default: tvm_dtype(t) if t is not None and t.dtype != default else None  # noqa: E731
    return UpdateDims.cached(
        nheads=nheads, headdim=headdim, dstate=dstate, ngroups=1 if m1 else B.shape[1], has_D=D is not None,
        has_z=z is not None, has_dt_bias=dt_bias is not None, dt_softplus=bool(dt_softplus), x_dtype=tvm_dtype(x),
        B_dtype=tvm_dtype(B), C_dtype=tvm_dtype(C), state_dtype=other(state, acc_of(x)), dt_dtype=other(dt, x.dtype),
        z_dtype=other(z, x.dtype), idx_dtype=tvm_dtype(idx) if idx is not None else None, tie_hdim=A.dim() == 1,
        mamba1_layout=m1)


@torch.library.custom_op("tvm_mamba::selective_state_update", mutates_args=("state",))
def selective_state_update_op(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                              D: Optional[Tensor], z: Optional[Tensor], dt_bias: Optional[Tensor],
                              dt_softplus: bool, state_batch_indices: Optional[Tensor]) -> Tensor:
    """Head layout: state (nstate, nheads, headdim, dstate) updated in place; x, dt, z: (batch, nheads, headdim);
    A: (nheads, headdim, dstate); B, C: (batch, ngroups, dstate); D, dt_bias: (nheads, headdim);
    state_batch_indices: (batch,) int32/int64 slots of state (None: nstate = batch) -> out.
    Tied per-head form (mamba_ssm's TIE_HDIM, the kernel's ``tie_hdim``), chosen by a 1-D A: A (nheads,),
    dt (batch, nheads), D, dt_bias (nheads,). Mamba-1 form (the kernel's ``mamba1_layout``), chosen by a 2-D
    x: state (nstate, dim, dstate); x, dt, z: (batch, dim); A: (dim, dstate); B, C: (batch, dstate);
    D, dt_bias: (dim,)."""
    if state_batch_indices is not None:
        _check_slots(state_batch_indices, state.shape[0])
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    launch_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, out)
    return out


def launch_update(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                  z: Optional[Tensor], dt_bias: Optional[Tensor], dt_softplus: bool,
                  state_batch_indices: Optional[Tensor], out: Tensor) -> None:
    """The decode-step kernel on :func:`selective_state_update_op`'s tensors (slots checked by the caller),
    writing ``out`` (x's shape and dtype, compact, 64-byte aligned): the op's body, and what a caller that owns
    ``out`` (vLLM's form) runs in eager mode instead of the op and a copy."""
    m1, tie, acc = x.dim() == 2, A.dim() == 1, acc_of(x)
    if x.numel() == 0:
        return
    xk, st = prepare(x), prepare_pool(state, True)  # the pool itself when its slots are compact
    Bk, Ck = prepare(B), prepare(C)
    dims = _update_dims(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices)
    kern = kernel_for(OP, "update", x.device, dims)
    vec = 1 if tie or m1 else 2  # D / dt_bias rank
    absent = 1 if m1 else 2  # an absent D / dt_bias: the kernel's placeholder of that rank
    dtk, Ak = prepare(dt), prepare(A)
    Dk, dtbk = (opt(v, x, acc, vec if v is not None else absent) for v in (D, dt_bias))
    if tie:  # the kernel reads the expanded views mamba_ssm passes, as they come (no view of a new dt per call)
        P, N = x.shape[2], st.shape[3]
        dtk = dtk.as_strided((*dtk.shape, P), (*dtk.stride(), 0))  # as_strided: a third of index + expand's cost
        Ak = Ak.as_strided((Ak.shape[0], P, N), (Ak.stride(0), 0, 0))
        Dk, dtbk = (v if v.dim() == 2 else v.as_strided((v.shape[0], P), (v.stride(0), 0)) for v in (Dk, dtbk))
    kern(st, xk, dtk, Ak, Bk, Ck, Dk, opt(z, x, x.dtype, x.dim()), dtbk, opt(state_batch_indices, x, torch.int32, 1),
         out)
    if st.data_ptr() != state.data_ptr():  # prepare() had to copy: write the new state back
        state.copy_(st)


@selective_state_update_op.register_fake
def _(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------------------------------
# Public API (mamba_ssm 2.3.x names, argument order and semantics)
# ----------------------------------------------------------------------------------------------------
def _io_dtypes(u: Tensor):
    return (torch.float64,) if u.dtype == torch.float64 else FLOATS


def _check_A(A, ndim, dtypes, device):
    if isinstance(A, Tensor) and A.is_complex():
        raise ValueError("A: complex A is not supported here (real A only)")
    check_tensor("A", A, ndim=ndim, dtypes=dtypes, device=device)


def _check_bc(name, M, batch, dim, dstate, seqlen, u):
    check_tensor(name, M, dtypes=_io_dtypes(u), device=u.device)
    if M.is_complex():
        raise ValueError(f"{name}: complex B/C are not supported")
    if M.dim() == 2:
        check_shape(name, M, (dim, dstate))
    elif M.dim() == 3:
        check_shape(name, M, (batch, dstate, seqlen))
    elif M.dim() == 4:
        groups = M.shape[1]
        if groups < 1 or dim % groups:
            raise ValueError(f"{name}: groups={groups} must divide dim={dim}")
        check_shape(name, M, (batch, groups, dstate, seqlen))
    else:
        raise ValueError(f"{name}: expected (dim, dstate), (batch, dstate, seqlen) or "
                         f"(batch, groups, dstate, seqlen), got shape {tuple(M.shape)}")


def _check_complex(u, A, B, C, D, z, delta_bias, initial_state):
    """Inputs of the complex-A path (mamba_ssm's complex kernels): A complex64 (complex128 with float64 u);
    time-invariant B/C complex (or real: its real part), varying B/C real with (re, im) interleaved in time."""
    batch, dim, seqlen = u.shape
    acc = acc_of(u)
    cdt = torch.complex128 if acc == torch.float64 else torch.complex64
    check_tensor("A", A, ndim=2, dtypes=(cdt,), device=u.device)
    if A.shape[0] != dim or A.shape[1] < 1:
        raise ValueError(f"A: expected (dim={dim}, dstate >= 1), got {tuple(A.shape)}")
    dstate = A.shape[1]
    for name, M in (("B", B), ("C", C)):
        if isinstance(M, Tensor) and M.dim() == 2:
            check_tensor(name, M, dtypes=(cdt, acc), device=u.device)
            check_shape(name, M, (dim, dstate))
            continue
        if isinstance(M, Tensor) and M.is_complex():
            raise ValueError(f"{name}: with a complex A a time-varying {name} is real, (re, im) interleaved in "
                             f"time: (batch, [groups,] dstate, 2 * seqlen) (mamba_ssm's layout), got complex")
        _check_bc(name, M, batch, dim, dstate, 2 * seqlen, u)
    _check_extras(u, D, z, delta_bias, initial_state, acc, cdt, dstate)


def _check_extras(u, D, z, delta_bias, initial_state, acc, state_dtype, dstate):
    """D, delta_bias: (dim,) in acc; z: like u; initial_state: (batch, dim, dstate) in state_dtype."""
    batch, dim, _ = u.shape
    for name, v in (("D", D), ("delta_bias", delta_bias)):
        if v is not None:
            check_tensor(name, v, ndim=1, dtypes=(acc,), device=u.device)
            check_shape(name, v, (dim,))
    if z is not None:
        check_tensor("z", z, ndim=3, dtypes=(u.dtype,), device=u.device)
        check_shape("z", z, u.shape)
    if initial_state is not None:
        check_tensor("initial_state", initial_state, ndim=3, dtypes=(state_dtype,), device=u.device)
        check_shape("initial_state", initial_state, (batch, dim, dstate))


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False, initial_state=None):
    """Mamba-1 selective scan (mamba_ssm.ops.selective_scan_interface.selective_scan_fn).

    u, delta, z: (batch, dim, seqlen) float32/float16/bfloat16 (all one dtype); A: (dim, dstate) real float32;
    B, C: (dim, dstate) time-invariant, (batch, dstate, seqlen), or (batch, groups, dstate, seqlen) with
    dim % groups == 0 (float32 or u's dtype; B and C may differ in kind); D, delta_bias: (dim,) float32;
    initial_state: (batch, dim, dstate) float32 (extension: the scan starts from it).
    Returns out: (batch, dim, seqlen) in u's dtype [, last_state: (batch, dim, dstate) float32].

    dt = softplus?(delta + delta_bias); h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t; out = (C_t.h_t + D u_t) silu(z).
    Differentiable in every tensor argument, including through last_state. float64 inputs (all of them)
    run a float64 kernel (used for gradcheck).

    Complex A (dim, dstate) complex64 (mamba_ssm's complex mode, selective_scan_ref's semantics): a
    time-invariant B/C is complex (dim, dstate) (or real: its real part); a varying one is real
    (batch, [groups,] dstate, 2 * seqlen) with (re, im) interleaved in time; initial_state complex;
    out = (2 Re(C_t . h_t) + D u_t) silu(z), last_state complex. Gradients of complex tensors: dL/dRe + i dL/dIm.
    """
    check_tensor("u", u, ndim=3, dtypes=FLOATS + (torch.float64,))
    batch, dim, seqlen = u.shape
    if seqlen < 1:
        raise ValueError(f"u: seqlen must be >= 1, got shape {tuple(u.shape)}")
    acc = acc_of(u)
    check_tensor("delta", delta, ndim=3, dtypes=(u.dtype,), device=u.device)
    check_shape("delta", delta, u.shape)
    if isinstance(A, Tensor) and A.is_complex():
        _check_complex(u, A, B, C, D, z, delta_bias, initial_state)
        out, last = complex_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state)
        return (out, last) if return_last_state else out
    _check_A(A, 2, (acc,), u.device)
    if A.shape[0] != dim:
        raise ValueError(f"A: expected (dim={dim}, dstate), got {tuple(A.shape)}")
    dstate = A.shape[1]
    if dstate < 1:
        raise ValueError(f"A: dstate must be >= 1, got {tuple(A.shape)}")
    _check_bc("B", B, batch, dim, dstate, seqlen, u)
    _check_bc("C", C, batch, dim, dstate, seqlen, u)
    _check_extras(u, D, z, delta_bias, initial_state, acc, acc, dstate)
    out, last, _ = run_op(selective_scan_fwd, u, delta, A, B, C, D, z, delta_bias, initial_state,
                          bool(delta_softplus))
    return (out, last) if return_last_state else out


def _check_update_tensors(state, x, dt, A, B, C, D, z, dt_bias, heads: bool, batch: int):
    """Dtypes/shapes of selective_state_update's tensors (any float mix mamba_ssm's Triton kernel loads:
    every input is widened to fp32 there; here float64 x means an all-float64 kernel, for gradcheck-style
    checks)."""
    acc = acc_of(x)
    io = _io_dtypes(x)
    check_tensor("state", state, ndim=x.dim() + 1, dtypes=io, device=x.device)
    if tuple(state.shape[1:-1]) != tuple(x.shape[1:]):
        raise ValueError(f"state: expected (batch,) + {tuple(x.shape[1:])} + (dstate,), got {tuple(state.shape)}")
    check_no_overlap("state", state)
    dstate, lead = state.shape[-1], x.shape[1]
    check_tensor("dt", dt, dtypes=io, device=x.device)
    check_shape("dt", dt, x.shape)
    _check_A(A, x.dim(), io + ((torch.float64,) if acc == torch.float32 else ()), x.device)
    check_shape("A", A, tuple(state.shape[1:]))
    for name, M in (("B", B), ("C", C)):
        check_tensor(name, M, dtypes=io, device=x.device)
        if M.dim() == 2 and not heads:
            check_shape(name, M, (batch, dstate))
        elif M.dim() == 3:
            if M.shape[1] < 1 or lead % M.shape[1]:
                raise ValueError(f"{name}: groups={M.shape[1]} must divide {'nheads' if heads else 'dim'}={lead}")
            check_shape(name, M, (batch, M.shape[1], dstate))
        else:
            raise ValueError(f"{name}: expected (batch, dstate) or (batch, groups, dstate), got {tuple(M.shape)}")
    if B.dim() != C.dim() or (B.dim() == 3 and B.shape[1] != C.shape[1]):
        raise ValueError(f"C: expected the same groups as B {tuple(B.shape)}, got {tuple(C.shape)}")
    for name, v in (("D", D), ("dt_bias", dt_bias)):
        if v is not None:
            check_tensor(name, v, dtypes=io + ((torch.float64,) if acc == torch.float32 else ()), device=x.device)
            check_shape(name, v, tuple(x.shape[1:]))
    if z is not None:
        check_tensor("z", z, dtypes=io, device=x.device)
        check_shape("z", z, x.shape)


def _check_indices(idx, state, batch: int, device) -> None:
    check_tensor("state_batch_indices", idx, ndim=1, dtypes=(torch.int32, torch.int64), device=device)
    check_shape("state_batch_indices", idx, (batch,))
    if state.shape[0] < 1:
        raise ValueError(f"state: an empty state pool {tuple(state.shape)} with state_batch_indices")


def _flat(t: Tensor, dims) -> bool:
    """Every index along ``dims`` names the same element (stride 0, or a single index)."""
    return all(t.stride(d) == 0 or t.shape[d] == 1 for d in dims)


def _tied_heads(dt: Tensor, A: Tensor, D: Optional[Tensor], dt_bias: Optional[Tensor]) -> bool:
    """mamba_ssm's TIE_HDIM layout of the head-layout call: one A, dt, D, dt_bias value per head, passed as
    expanded views (A (nheads, headdim, dstate) constant over headdim and dstate, dt (batch, nheads, headdim)
    and D / dt_bias (nheads, headdim) constant over headdim, where given) — what Mamba2.step passes."""
    return _flat(A, (1, 2)) and _flat(dt, (2,)) and all(v is None or _flat(v, (1,)) for v in (D, dt_bias))


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None):
    """One decode step, state updated in place; returns out (mamba_ssm.ops.triton.selective_state_update,
    2.3.2's signature).

    Mamba-1: state (batch, dim, dstate); x, dt, z: (batch, dim); A: (dim, dstate);
    B, C: (batch, dstate) or (batch, groups, dstate); D, dt_bias: (dim,) -> out (batch, dim).
    Mamba-2 heads: state (batch, nheads, headdim, dstate); x, dt, z: (batch, nheads, headdim);
    A: (nheads, headdim, dstate); B, C: (batch, ngroups, dstate); D, dt_bias: (nheads, headdim)
    mamba_ssm's tied per-head dt/A/D/dt_bias (expanded stride-0 views, as Mamba2.step passes them) run a
    kernel that reads one value per head, with no copy; a partly tied call runs the general kernel.
    state_batch_indices: (batch,) int32/int64: row b uses state slot state_batch_indices[b] of a pool
    state (nslots, ...) (continuous batching); a negative index is a padding row: out = 0, no state written.
    Indices >= nslots, or two rows naming one slot, are a ValueError before anything runs. Without indices
    a state with more than batch rows has its first batch rows updated (as upstream's Triton kernel).

    Dtypes: x, dt, z, B, C, state each float32 / float16 / bfloat16 (independently; out in x's dtype);
    A, D, dt_bias any float (widened to float32). A 16-bit state stays in its dtype: the math runs in
    float32 and the new state is rounded once per step. float64 x needs every tensor float64.

    A call with the same shapes, strides, dtypes and flags as an earlier one runs the launch prepared then
    (torch_ops/_fastpath.py; on the CPU the kernel checks the index values itself).

    dt' = softplus?(dt + dt_bias); state = exp(dt' A) state + dt' B x; out = (C . state + D x) * silu(z).
    """
    return _SSU_FAST.call((state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, None), (bool(dt_softplus),),
                          state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices)


def _ssu_values(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, out=None):
    if state_batch_indices is not None:
        _check_slots(state_batch_indices, state.shape[0])


def _run_update(out: Optional[Tensor], *args) -> Tensor:
    """selective_state_update_op(*args), its result in ``out`` when given: the kernel writes ``out`` itself
    in eager mode when it is compact, aligned and apart from every input (a server's preallocated output),
    else the op's result is copied there."""
    if out is None:
        return run_op(selective_state_update_op, *args)
    if kernel_may_write(out, args):
        if args[-1] is not None:
            _check_slots(args[-1], args[0].shape[0])
        launch_update(*args, out)
    else:
        out.copy_(run_op(selective_state_update_op, *args))
    return out


def _selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                            state_batch_indices=None, out=None):
    """The full path of :func:`selective_state_update`: checks, layout, kernel key, launch; ``out`` (vLLM's
    form, torch_ops/serving.py): x's shape, dtype and device, written and returned."""
    check_tensor("x", x, dtypes=FLOATS + (torch.float64,))
    if out is not None:
        check_tensor("out", out, dtypes=(x.dtype,), device=x.device)
        check_shape("out", out, tuple(x.shape))
    acc = acc_of(x)
    if x.dim() not in (2, 3):
        raise ValueError(f"x: expected (batch, dim) or (batch, nheads, headdim), got shape {tuple(x.shape)}")
    heads = x.dim() == 3
    batch = x.shape[0]
    _check_update_tensors(state, x, dt, A, B, C, D, z, dt_bias, heads, batch)
    if state_batch_indices is not None:
        _check_indices(state_batch_indices, state, batch, x.device)
    elif state.shape[0] < batch:
        raise ValueError(f"state: expected at least {batch} rows (x's batch) without state_batch_indices, "
                         f"got shape {tuple(state.shape)}")
    elif state.shape[0] > batch:  # upstream's kernel uses rows 0..batch-1 of a larger state (a view here)
        state = state[:batch]
    if heads and A.numel() and _tied_heads(dt, A, D, dt_bias):  # one value per head: compact views, nothing copied
        dt, A = dt[:, :, 0], A[:, 0, 0]
        D, dt_bias = (v[:, 0] if v is not None else None for v in (D, dt_bias))
    A = A.to(acc)
    D, dt_bias = (v.to(acc) if v is not None else None for v in (D, dt_bias))
    if not heads and B.dim() == 2 and C.dim() == 2:  # Mamba-1's own layout: the kernel takes it as it is
        return _run_update(out, state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus), state_batch_indices)
    if not heads:  # grouped B / C: the head layout with nheads = dim, headdim = 1
        B3 = B if B.dim() == 3 else B.unsqueeze(1)
        C3 = C if C.dim() == 3 else C.unsqueeze(1)
        u = lambda t: t.unsqueeze(-1) if t is not None else None  # noqa: E731
        y = _run_update(u(out), state.unsqueeze(2), u(x), u(dt), A.unsqueeze(1), B3, C3, u(D), u(z), u(dt_bias),
                        bool(dt_softplus), state_batch_indices)
        return y.squeeze(-1) if out is None else out
    return _run_update(out, state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus), state_batch_indices)


_SSU_FAST = FastPath(_selective_state_update, _ssu_values, copies=True, host_checks=True)


def selective_state_update_into(out, state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                                state_batch_indices=None):
    """:func:`selective_state_update` writing ``out`` (x's shape, dtype and device; vLLM's form): in eager mode
    the kernel writes it directly (no output allocated, nothing copied), and a repeated call runs its
    prepared launch as the mamba_ssm form does. Returns ``out``."""
    return _SSU_FAST.call((state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, out), (bool(dt_softplus),),
                          state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, out)
