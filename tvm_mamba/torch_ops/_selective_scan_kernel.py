"""What the real and the complex-A selective-scan ops share when they call a kernel: the typed dims of a call,
the placeholders of absent inputs, and the forward launch (run by each forward op and again by its backward
op to rebuild the checkpoints).

Kernel layouts (compute/selective_scan): u, delta, z, out (batch, dim, seqlen); the states last_state
(batch, dim, dstate) and checkpoints (batch, dim, nchunk, dstate), each with a trailing (re, im) axis of 2
for a complex A; absent optional inputs are cached (1,)*ndim placeholders.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._dlpack import dummy, kernel_for, prepare, tvm_dtype

OP = "selective_scan"


def acc_of(u: Tensor) -> torch.dtype:
    """The accumulation dtype of a call (A, D, delta_bias and the states): float64 for float64 u (gradcheck)."""
    return torch.float64 if u.dtype == torch.float64 else torch.float32


def opt(t: Optional[Tensor], like: Tensor, dtype, ndim: int) -> Tensor:
    """``t`` in the kernel layout, or the placeholder of an absent input."""
    return prepare(t) if t is not None else dummy(like.device, dtype, ndim)


def scan_dims(cls, u: Tensor, A: Tensor, Bk: Tensor, bg: int, Ck: Tensor, cg: int, D, z, delta_bias,
              delta_softplus: bool, initial_state, chunk: int, **extra):
    """The typed static dims (``cls``: ``ScanDims``, or ``ScanBwdDims`` with ``extra`` = its block) of a call
    on kernel-layout B / C with ``bg`` / ``cg`` groups (0: time-invariant). Their ``key_parts()`` are the maps
    kernel caches and committed tuning records are keyed by."""
    return cls.cached(dim=u.shape[1], dstate=A.shape[1], b_groups=bg, c_groups=cg, has_D=D is not None,
                      has_z=z is not None, has_delta_bias=delta_bias is not None,
                      delta_softplus=bool(delta_softplus), has_init=initial_state is not None, chunk=chunk,
                      **extra, u_dtype=tvm_dtype(u), B_dtype=tvm_dtype(Bk), C_dtype=tvm_dtype(Ck))


def new_states(u: Tensor, A: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """Uninitialised (last_state, checkpoints) of a forward on kernel-layout u and A (a complex A's trailing
    (re, im) axis carries over to both); also what the forward ops' fake implementations return."""
    (batch, dim, seqlen), dstate, pair, acc = u.shape, A.shape[1], tuple(A.shape[2:]), acc_of(u)
    return (u.new_empty((batch, dim, dstate, *pair), dtype=acc),
            u.new_empty((batch, dim, -(-seqlen // chunk), dstate, *pair), dtype=acc))


def scan_forward(direction: str, dims, u: Tensor, delta: Tensor, A: Tensor, Bk: Tensor, Ck: Tensor,
                 D: Optional[Tensor], z: Optional[Tensor], delta_bias: Optional[Tensor],
                 initial_state: Optional[Tensor], out: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Run forward kernel ``direction`` of ``dims`` on kernel-layout inputs -> (out, last_state, checkpoints).
    out: a (batch, dim, seqlen) buffer in u's dtype to write into (a backward passes its du, which its own
    kernel overwrites next: rebuilding the checkpoints then allocates only them)."""
    batch, dim, seqlen = u.shape
    acc, state_rank = acc_of(u), A.dim() + 1  # (batch, dim, dstate[, 2]) as A is (dim, dstate[, 2])
    u, delta = prepare(u), prepare(delta)
    out = torch.empty_like(u) if out is None else out
    last, ck = new_states(u, A, dims.chunk)
    if batch * dim == 0:  # nothing to scan (an empty grid is refused by TVM's argument checks)
        last.copy_(initial_state) if initial_state is not None else last.zero_()
        return out, last, ck.zero_()
    kern = kernel_for(OP, direction, u.device, dims, seqlen=seqlen)
    kern(u, delta, prepare(A), Bk, Ck, opt(D, u, acc, 1), opt(z, u, u.dtype, 3), opt(delta_bias, u, acc, 1),
         opt(initial_state, u, acc, state_rank), out, last, ck)
    return out, last, ck
