"""selective_scan_fn with a complex A (mamba_ssm 2.3.2's ``selective_scan_ref`` / complex CUDA kernels):
custom ops ``tvm_mamba::selective_scan_complex_fwd`` / ``_bwd`` on the kernels of
compute/selective_scan/complex_{fwd,bwd}.py, and the glue that maps mamba_ssm's complex layouts to them.

The ops take the kernel layouts (every complex tensor as a real (..., 2) view; varying B/C as
(batch, groups, seqlen, dstate, 2)); :func:`complex_scan` builds those with differentiable views
(``view_as_real``, reshape / permute), so autograd maps the kernel's gradients back to mamba_ssm's layouts
and torch's complex-gradient convention (dL/dRe + i dL/dIm) falls out of ``view_as_real``'s backward.
Backward memory: autograd keeps the inputs only; the backward op reruns the forward kernel to rebuild the
checkpoints (batch, dim, ceil(seqlen/chunk), dstate, 2) in acc, chunk = chunk_size(2 dstate) (the backward's
per-lane state buffer holds (chunk+1) x 2 dstate values), held while it runs (as the real scan).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..compute.selective_scan.dims import WEBGPU_BLOCK, WEBGPU_PRIVATE_FLOATS, ScanBwdDims, ScanDims, block_size, chunk_size
from ..runtime.target import device_target_key
from ..compute.selective_scan.dims import bwd_workspace
from ._dlpack import dummy, kernel_for, prepare, run_op
from ._selective_scan_kernel import OP, acc_of, new_states, opt, scan_dims, scan_forward


def complex_chunk(dstate: int, device=None) -> int:
    """The complex scan's checkpoint interval (its states are (re, im) pairs: 2 dstate floats; on WebGPU the
    lane's 8 KB of private memory, as ``selective_scan.chunk_for``)."""
    webgpu = device is not None and device_target_key(device) == "webgpu"
    return chunk_size(2 * dstate, WEBGPU_PRIVATE_FLOATS if webgpu else None)


def _groups(M: Tensor) -> int:
    return M.shape[1] if M.dim() == 5 else 0


def _dims(cls, u, A, Bk, Ck, D, z, delta_bias, delta_softplus, initial_state, **extra):
    """``scan_dims`` of kernel-layout B / C with the complex scan's checkpoint chunk."""
    return scan_dims(cls, u, A, Bk, _groups(Bk), Ck, _groups(Ck), D, z, delta_bias, delta_softplus, initial_state,
                     complex_chunk(A.shape[1], u.device), **extra)


def _scan_forward(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                  z: Optional[Tensor], delta_bias: Optional[Tensor], initial_state: Optional[Tensor],
                  delta_softplus: bool, out: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """The forward kernel -> (out, last_state, checkpoints); run by the forward op and again by the backward
    op to rebuild the checkpoints (same kernel, same inputs: bitwise the same; out: ``scan_forward``)."""
    Bk, Ck = prepare(B), prepare(C)
    dims = _dims(ScanDims, u, A, Bk, Ck, D, z, delta_bias, delta_softplus, initial_state)
    return scan_forward("fwd_complex", dims, u, delta, A, Bk, Ck, D, z, delta_bias, initial_state, out)


@torch.library.custom_op("tvm_mamba::selective_scan_complex_fwd", mutates_args=())
def selective_scan_complex_fwd(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                               z: Optional[Tensor], delta_bias: Optional[Tensor], initial_state: Optional[Tensor],
                               delta_softplus: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Kernel layouts: A (dim, dstate, 2); B, C (dim, dstate, 2) or (batch, groups, seqlen, dstate, 2);
    initial_state (batch, dim, dstate, 2) -> out (batch, dim, seqlen), last_state (batch, dim, dstate, 2),
    checkpoints (batch, dim, nchunk, dstate, 2) (not kept by autograd: the backward op rebuilds them)."""
    return _scan_forward(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus)


@selective_scan_complex_fwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus):
    return (torch.empty_like(u, memory_format=torch.contiguous_format),
            *new_states(u, A, complex_chunk(A.shape[1], u.device)))


@torch.library.custom_op("tvm_mamba::selective_scan_complex_bwd", mutates_args=())
def selective_scan_complex_bwd(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                               z: Optional[Tensor], delta_bias: Optional[Tensor], initial_state: Optional[Tensor],
                               checkpoints: Optional[Tensor], dout: Tensor, dlast: Optional[Tensor],
                               delta_softplus: bool
                               ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state) in the kernel layouts; absent
    optional inputs get (0,) gradients. checkpoints: the forward's, or None (what autograd passes): rebuilt
    here by one run of the forward kernel (a single chunk: the initial state)."""
    batch, dim, seqlen = u.shape
    dstate, acc = A.shape[1], acc_of(u)
    u, delta, Bk, Ck = prepare(u), prepare(delta), prepare(B), prepare(C)
    bg, cg = _groups(Bk), _groups(Ck)
    blk = block_size(dim, bg, cg, WEBGPU_BLOCK if device_target_key(u.device) == "webgpu" else 16)
    dims = _dims(ScanBwdDims, u, A, Bk, Ck, D, z, delta_bias, delta_softplus, initial_state, block=blk)
    dout = prepare(dout.to(u.dtype))
    dlast = prepare(dlast.to(acc)) if dlast is not None else u.new_zeros((batch, dim, dstate, 2), dtype=acc)
    du, ddelta, dA, dB, dC = (torch.empty_like(t) for t in (u, u, prepare(A), Bk, Ck))
    dD = torch.empty_like(D) if D is not None else dummy(u.device, acc, 1)
    dz = torch.empty_like(u) if z is not None else dummy(u.device, u.dtype, 3)
    ddb = torch.empty_like(delta_bias) if delta_bias is not None else dummy(u.device, acc, 1)
    dinit = u.new_empty((batch, dim, dstate, 2), dtype=acc) if initial_state is not None else dummy(u.device, acc, 4)
    if batch * dim == 0:
        for t in (du, ddelta, dA, dB, dC, dD, ddb, dz):
            t.zero_()
        if initial_state is not None:
            dinit.copy_(dlast)
    else:
        if checkpoints is None and seqlen <= dims.chunk:  # one chunk: its checkpoint is the initial state
            checkpoints = (prepare(initial_state.to(acc)).unsqueeze(2) if initial_state is not None
                           else u.new_zeros((batch, dim, 1, dstate, 2), dtype=acc))
        if checkpoints is None:
            checkpoints = _scan_forward(u, delta, A, Bk, Ck, D, z, delta_bias, initial_state, delta_softplus,
                                        out=du)[2]
        ws = u.new_empty((bwd_workspace(dims, batch, seqlen, (2,))[1],), dtype=acc)  # every region's partials
        kern = kernel_for(OP, "bwd_complex", u.device, dims, seqlen=seqlen)
        kern(u, delta, prepare(A), Bk, Ck, opt(D, u, acc, 1), opt(z, u, u.dtype, 3), opt(delta_bias, u, acc, 1),
             opt(initial_state, u, acc, 4), prepare(checkpoints), dout, dlast,
             du, ddelta, dA, dB, dC, dD, ddb, dz, dinit, ws)
    empty = lambda: u.new_empty((0,), dtype=acc)  # noqa: E731  (one per output: outputs may not alias)
    return (du, ddelta, dA, dB, dC, dD if D is not None else empty(), dz if z is not None else u.new_empty((0,)),
            ddb if delta_bias is not None else empty(), dinit if initial_state is not None else empty())


@selective_scan_complex_bwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, initial_state, checkpoints, dout, dlast, delta_softplus):
    acc = acc_of(u)
    like = lambda t: torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    empty = lambda: u.new_empty((0,), dtype=acc)  # noqa: E731
    return (like(u), like(u), like(A), like(B), like(C), like(D) if D is not None else empty(),
            like(u) if z is not None else u.new_empty((0,)), like(delta_bias) if delta_bias is not None else empty(),
            u.new_empty(tuple(u.shape[:2]) + (A.shape[1], 2), dtype=acc) if initial_state is not None else empty())


def _setup_context(ctx, inputs, output):
    u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus = inputs
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state)  # no checkpoints: rebuilt
    ctx.delta_softplus = delta_softplus


def _backward(ctx, dout, dlast, _dck):
    u, delta, A, B, C, D, z, delta_bias, initial_state = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(u)
    du, ddelta, dA, dB, dC, dD, dz, ddb, dinit = torch.ops.tvm_mamba.selective_scan_complex_bwd(
        u, delta, A, B, C, D, z, delta_bias, initial_state, None, dout, dlast, ctx.delta_softplus)
    return (du, ddelta, dA, dB, dC, dD if D is not None else None, dz if z is not None else None,
            ddb if delta_bias is not None else None, dinit if initial_state is not None else None, None)


selective_scan_complex_fwd.register_autograd(_backward, setup_context=_setup_context)


def _bc_kernel(M: Tensor, seqlen: int) -> Tensor:
    """mamba_ssm's B/C with a complex A -> the kernel layout, by differentiable views: complex (dim, dstate)
    -> (dim, dstate, 2); a real (dim, dstate) is the real part (imaginary 0); real (batch, [groups,] dstate,
    2 seqlen) with (re, im) interleaved in time -> (batch, groups, seqlen, dstate, 2)."""
    if M.dim() == 2:
        return torch.view_as_real(M) if M.is_complex() else torch.stack([M, torch.zeros_like(M)], dim=-1)
    if M.dim() == 3:
        M = M.unsqueeze(1)
    return M.reshape(*M.shape[:3], seqlen, 2).permute(0, 1, 3, 2, 4)


def complex_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state):
    """selective_scan_fn's complex-A path on validated inputs -> (out, last_state complex (batch, dim, dstate))."""
    seqlen = u.shape[2]
    init = torch.view_as_real(initial_state) if initial_state is not None else None
    out, last, _ = run_op(selective_scan_complex_fwd, u, delta, torch.view_as_real(A), _bc_kernel(B, seqlen),
                          _bc_kernel(C, seqlen), D, z, delta_bias, init, bool(delta_softplus))
    return out, torch.view_as_complex(last)
