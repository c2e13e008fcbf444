"""mamba_inner_fn: mamba_ssm 2.3.x's fused Mamba-1 layer path (``ops/selective_scan_interface.MambaInnerFn``).

xz (the in_proj output) -> causal conv1d + SiLU -> x_proj -> dt_proj -> selective scan gated by z -> out_proj,
in one autograd node. The SSM math runs in tvm_mamba's kernels, called through their registered custom ops
(``tvm_mamba::causal_conv1d_fwd/bwd``, ``selective_scan_fwd/bwd``, ``rmsnorm_gated_fwd/bwd`` for the optional
B / C / dt RMSNorms); the projections are torch GEMMs.

What backward keeps (docs/fused.md has the bytes per token at the 130M / 2.7B shapes), s = xz's element size:
* always: xz (2*d_inner*s), x_dbl = x_proj(conv_out) ((dt_rank + 2*d_state)*s), out_z = the gated scan
  output (d_inner*s; upstream keeps the pre-gate output instead, the same size); no scan states (upstream
  keeps one per 2048 tokens): the scan's backward op rebuilds its checkpoints with one forward kernel run
  (real and complex A alike; with a complex A x_dbl has 4*d_state state columns);
* checkpoint_lvl=0 also conv1d_out and delta (2*d_inner*s); checkpoint_lvl=1 (default) recomputes them in
  backward (one conv1d forward + one dt_proj GEMM), as upstream.
* B and C are never stored apart from x_dbl (upstream keeps contiguous copies, 2*d_state*s): backward
  slices them from x_dbl again (and re-applies B_proj_bias / the RMSNorms).
Both levels run the same kernels in the same order: their gradients are bitwise equal.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ._dlpack import FLOATS, check_shape, check_tensor, run_op
from .causal_conv1d import causal_conv1d_bwd, causal_conv1d_fwd
from .linear import fp32_linear_if
from ._fused import norm_bwd, norm_fwd
from ._selective_scan_complex import _bc_kernel as complex_bc_kernel
from ._selective_scan_complex import selective_scan_complex_bwd, selective_scan_complex_fwd
from .selective_scan import selective_scan_bwd, selective_scan_fwd

# the tensor arguments of mamba_inner_fn, in upstream's order (the autograd node's inputs, by name)
TENSORS = ("xz", "conv1d_weight", "conv1d_bias", "x_proj_weight", "delta_proj_weight", "out_proj_weight",
           "out_proj_bias", "A", "B", "C", "D", "delta_bias", "B_proj_bias", "C_proj_bias", "b_rms_weight",
           "c_rms_weight", "dt_rms_weight")


@dataclass(frozen=True)
class InnerDims:
    """Static dims and flags of one call (d_inner = dim of the scan, dt_rank, d_state, which of B / C come
    from x_proj)."""
    dim: int
    dt_rank: int
    dstate: int
    proj_B: bool
    proj_C: bool
    delta_softplus: bool
    checkpoint_lvl: int
    eps: float
    complex_A: bool = False

    # no gradient needed (the caller's grad mode and tensors, decided before the Function: its forward runs with
    # grad mode off either way): the projections take fp32_linear (the modules' inference route), else F.linear
    infer: bool = False

    @property
    def bc_cols(self) -> int:
        """x_proj columns of a projected B / C: d_state, or 2*d_state (re, im interleaved) for a complex A."""
        return self.dstate * (2 if self.complex_A else 1)


def _rms_fwd(x: Tensor, w, eps: float):
    """Per-row RMSNorm of (rows, hidden) through the gated-norm kernel (no gate) -> (out, rstd)."""
    return norm_fwd(x, w, None, eps, x.shape[1], True)


def _rms_bwd(x: Tensor, w, dout: Tensor, rstd: Tensor, eps: float):
    dx, _, dw = norm_bwd(x, w, None, dout, rstd, eps, x.shape[1], True)
    return dx, dw


def _bc(dims: InnerDims, t: dict, x_dbl: Tensor, batch: int, which: str):
    """B or C for the scan: the given tensor, or x_dbl's slice (+ proj bias, RMSNorm) as (batch, 1, dstate,
    seqlen). Returns (scan operand, pre-norm (tokens, dstate) or None, rstd or None)."""
    if not getattr(dims, "proj_" + which):
        return t[which], None, None
    R, N, W = dims.dt_rank, dims.dstate, dims.bc_cols
    M = x_dbl[:, R:R + W] if which == "B" else x_dbl[:, x_dbl.shape[1] - W:]
    bias, rms = t[which + "_proj_bias"], t[which.lower() + "_rms_weight"]
    if bias is not None:
        M = M + bias.to(M.dtype)
    if dims.complex_A:  # column 2n + k is (re, im)[k] of state n (upstream's "(dstate two)"): the kernel layout
        return M.reshape(batch, -1, 1, N, 2).transpose(1, 2), None, None  # (batch, 1, seqlen, dstate, 2)
    pre, rstd = None, None
    if rms is not None:
        pre = M.contiguous()
        M, rstd = _rms_fwd(pre, rms, dims.eps)
    return M.reshape(batch, -1, 1, N).permute(0, 2, 3, 1), pre, rstd


def _delta(dims: InnerDims, t: dict, x_dbl: Tensor, batch: int):
    """delta = dt_proj(x_dbl[:, :dt_rank]) (+ RMSNorm over d_inner) as (batch, d_inner, seqlen) contiguous.
    Returns (delta, pre-norm (tokens, d_inner) or None, rstd or None)."""
    low = x_dbl[:, :dims.dt_rank]
    W = t["delta_proj_weight"]
    if t["dt_rms_weight"] is None:  # straight into the scan's layout: one batched GEMM, no transpose copy
        return torch.matmul(W, low.reshape(batch, -1, dims.dt_rank).transpose(1, 2)), None, None
    pre = F.linear(low, W)  # (tokens, d_inner): rows for the norm
    out, rstd = _rms_fwd(pre, t["dt_rms_weight"], dims.eps)
    return out.reshape(batch, -1, dims.dim).transpose(1, 2).contiguous(), pre, rstd


def _scan_fwd(dims: InnerDims, t: dict, conv_out: Tensor, delta: Tensor, B: Tensor, C: Tensor):
    """The layer's selective scan gated by z -> out_z (batch, d_inner, seqlen); no states are kept (each
    scan's backward op rebuilds its checkpoints). Real A: selective_scan_fwd; complex A: the complex kernels
    in their layouts (A, time-invariant B / C as (..., 2) real views; varying (batch, g, seqlen, dstate, 2))."""
    z = t["xz"][:, dims.dim:]
    if not dims.complex_A:
        return run_op(selective_scan_fwd, conv_out, delta, t["A"], B, C, t["D"], z, t["delta_bias"], None,
                      dims.delta_softplus)[0]
    seqlen = conv_out.shape[2]
    Bk = B if dims.proj_B else complex_bc_kernel(B, seqlen)
    Ck = C if dims.proj_C else complex_bc_kernel(C, seqlen)
    return run_op(selective_scan_complex_fwd, conv_out, delta, torch.view_as_real(t["A"]), Bk, Ck, t["D"], z,
                  t["delta_bias"], None, dims.delta_softplus)[0]


def _complex_bc_grad(dK: Tensor, M: Tensor) -> Tensor:
    """The kernel-layout gradient of a given B / C (complex A) -> M's layout: complex (d_inner, d_state)
    (dL/dRe + i dL/dIm), a real (d_inner, d_state) its real part, (batch, [groups,] d_state, 2*seqlen)."""
    if M.dim() == 2:
        return torch.view_as_complex(dK.contiguous()) if M.is_complex() else dK[..., 0].contiguous()
    g = dK.permute(0, 1, 3, 2, 4).reshape(dK.shape[0], dK.shape[1], dK.shape[3], -1)
    return g.squeeze(1) if M.dim() == 3 else g


def _scan_bwd(dims: InnerDims, s: dict, conv_out: Tensor, delta: Tensor, B: Tensor, C: Tensor, dy: Tensor):
    """Gradients of :func:`_scan_fwd` -> (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias); dB / dC in the
    layout :func:`_bc` gave a projected one, in the user's layout for a given one."""
    z = s["xz"][:, dims.dim:]
    if not dims.complex_A:
        return run_op(selective_scan_bwd, conv_out, delta, s["A"], B, C, s["D"], z, s["delta_bias"], None, None, dy,
                      None, dims.delta_softplus)[:8]
    seqlen = conv_out.shape[2]
    Bk = B if dims.proj_B else complex_bc_kernel(B, seqlen)
    Ck = C if dims.proj_C else complex_bc_kernel(C, seqlen)
    du, ddelta, dA, dB, dC, dD, dz, ddb, _ = run_op(
        selective_scan_complex_bwd, conv_out, delta, torch.view_as_real(s["A"]), Bk, Ck, s["D"], z,
        s["delta_bias"], None, None, dy, None, dims.delta_softplus)
    dB = dB if dims.proj_B else _complex_bc_grad(dB, B)
    dC = dC if dims.proj_C else _complex_bc_grad(dC, C)
    return du, ddelta, torch.view_as_complex(dA.contiguous()), dB, dC, dD, dz, ddb


def _conv(t: dict, dims: InnerDims):
    x = t["xz"][:, :dims.dim]
    out, _ = run_op(causal_conv1d_fwd, x, t["conv1d_weight"], t["conv1d_bias"], None, None, False, True)
    return out


class _MambaInner(torch.autograd.Function):
    """One node for the whole path; saves by name exactly what the module docstring lists."""

    @staticmethod
    def forward(ctx, dims: InnerDims, *tensors):
        t = dict(zip(TENSORS, tensors))
        batch = t["xz"].shape[0]
        conv_out = _conv(t, dims)  # (batch, d_inner, seqlen)
        x_dbl = fp32_linear_if(dims.infer)(conv_out.transpose(1, 2).reshape(-1, dims.dim), t["x_proj_weight"])  # (tokens, K)
        delta, _, _ = _delta(dims, t, x_dbl, batch)
        B, _, _ = _bc(dims, t, x_dbl, batch, "B")
        C, _, _ = _bc(dims, t, x_dbl, batch, "C")
        out_z = _scan_fwd(dims, t, conv_out, delta, B, C)
        keep = dict(t, x_dbl=x_dbl, out_z=out_z)  # no scan states: the scan's backward op rebuilds them
        keep["B"] = None if dims.proj_B else t["B"]
        keep["C"] = None if dims.proj_C else t["C"]
        if dims.checkpoint_lvl == 0:
            keep.update(conv_out=conv_out, delta=delta)
        ctx.names = tuple(keep)
        ctx.save_for_backward(*keep.values())
        ctx.dims = dims
        return fp32_linear_if(dims.infer)(out_z.transpose(1, 2), t["out_proj_weight"], t["out_proj_bias"])

    @staticmethod
    def backward(ctx, dout):
        dims: InnerDims = ctx.dims
        s = dict(zip(ctx.names, ctx.saved_tensors))
        xz, x_dbl, out_z = s["xz"], s["x_dbl"], s["out_z"]
        batch, dim = xz.shape[0], dims.dim
        # recompute (checkpoint_lvl 1) or read (0) the scan's inputs; B / C always from x_dbl
        conv_out = s["conv_out"] if dims.checkpoint_lvl == 0 else _conv(s, dims)
        delta, dt_pre, dt_rstd = s.get("delta"), None, None
        if dims.checkpoint_lvl == 1 or s["dt_rms_weight"] is not None:  # (the dt norm's backward needs its input)
            recomputed, dt_pre, dt_rstd = _delta(dims, s, x_dbl, batch)
            delta = recomputed if delta is None else delta
        B, B_pre, B_rstd = _bc(dims, s, x_dbl, batch, "B")
        C, C_pre, C_rstd = _bc(dims, s, x_dbl, batch, "C")
        W = s["out_proj_weight"]
        g = {"out_proj_weight": torch.einsum("ble,bdl->ed", dout, out_z)}
        if s["out_proj_bias"] is not None:
            g["out_proj_bias"] = dout.sum((0, 1))
        dy = torch.matmul(W.t(), dout.transpose(1, 2))  # (batch, d_inner, seqlen)
        du, ddelta, g["A"], dB, dC, dD, dz, ddb = _scan_bwd(dims, s, conv_out, delta, B, C, dy)
        g["D"] = dD if s["D"] is not None else None
        g["delta_bias"] = ddb if s["delta_bias"] is not None else None
        parts = [None, None, None]  # d x_dbl columns: dt_rank, B, C
        for i, (which, dM, pre, rstd) in enumerate((("B", dB, B_pre, B_rstd), ("C", dC, C_pre, C_rstd)), 1):
            if not getattr(dims, "proj_" + which):
                g[which] = dM
                continue
            if dims.complex_A:  # (batch, 1, seqlen, dstate, 2) -> (tokens, 2*dstate)
                dM = dM.reshape(-1, dims.bc_cols)
            else:
                dM = dM.reshape(batch, dims.dstate, -1).transpose(1, 2).reshape(-1, dims.dstate)  # (tokens, dstate)
            if pre is not None:
                dM, g[which.lower() + "_rms_weight"] = _rms_bwd(pre, s[which.lower() + "_rms_weight"], dM, rstd,
                                                                dims.eps)
            if s[which + "_proj_bias"] is not None:
                g[which + "_proj_bias"] = dM.sum(0).to(s[which + "_proj_bias"].dtype)
            parts[i] = dM.to(x_dbl.dtype)
        low = x_dbl[:, :dims.dt_rank]
        if dt_pre is not None:  # through the dt RMSNorm: rows of (tokens, d_inner)
            dpre, g["dt_rms_weight"] = _rms_bwd(dt_pre, s["dt_rms_weight"], ddelta.transpose(1, 2).reshape(-1, dim),
                                                dt_rstd, dims.eps)
            g["delta_proj_weight"] = dpre.t() @ low
            parts[0] = dpre @ s["delta_proj_weight"]
        else:
            g["delta_proj_weight"] = torch.einsum("bdl,blr->dr", ddelta, low.reshape(batch, -1, dims.dt_rank))
            parts[0] = torch.matmul(ddelta.transpose(1, 2), s["delta_proj_weight"]).reshape(-1, dims.dt_rank)
        dx_dbl = _assemble(parts, x_dbl, dims)
        g["x_proj_weight"] = torch.einsum("bkl,bdl->kd", dx_dbl.reshape(batch, -1, x_dbl.shape[1]).transpose(1, 2),
                                          conv_out)
        dconv = du + torch.matmul(s["x_proj_weight"].t(), dx_dbl.reshape(batch, -1, x_dbl.shape[1]).transpose(1, 2))
        dx, g["conv1d_weight"], dcb, _ = run_op(causal_conv1d_bwd, xz[:, :dim], s["conv1d_weight"], s["conv1d_bias"],
                                                None, None, dconv, None, True)
        if s["conv1d_bias"] is not None:
            g["conv1d_bias"] = dcb
        g["xz"] = torch.cat([dx, dz], dim=1)
        return (None,) + tuple(g.get(n) for n in TENSORS)


def _assemble(parts, x_dbl: Tensor, dims: InnerDims) -> Tensor:
    """d x_dbl (tokens, K) from the dt_rank / B / C column blocks (zeros for columns not used)."""
    dx = torch.zeros_like(x_dbl)
    R, N, K = dims.dt_rank, dims.bc_cols, x_dbl.shape[1]
    dx[:, :R] = parts[0]
    if parts[1] is not None:
        dx[:, R:R + N] = parts[1]
    if parts[2] is not None:
        dx[:, K - N:] = parts[2]
    return dx


# ----------------------------------------------------------------------------------------------------
# Public API (mamba_ssm 2.3.x name, argument order and defaults)
# ----------------------------------------------------------------------------------------------------
def _check_vec(name: str, v, n: int, dtypes, device) -> None:
    if v is not None:
        check_tensor(name, v, ndim=1, dtypes=dtypes, device=device)
        check_shape(name, v, (n,))


def _validate(t: dict, delta_softplus, checkpoint_lvl, eps) -> InnerDims:
    xz = t["xz"]
    check_tensor("xz", xz, ndim=3, dtypes=FLOATS)
    batch, two_dim, seqlen = xz.shape
    dev, dt = xz.device, xz.dtype
    if batch < 1 or seqlen < 1 or two_dim < 2 or two_dim % 2:
        raise ValueError(f"xz: expected (batch, 2*d_inner, seqlen) with every dim >= 1, got {tuple(xz.shape)}")
    dim = two_dim // 2
    w = t["conv1d_weight"]
    check_tensor("conv1d_weight", w, ndim=2, dtypes=(torch.float32, dt), device=dev)
    if w.shape[0] != dim or not 2 <= w.shape[1] <= 8:
        raise ValueError(f"conv1d_weight: expected (d_inner={dim}, 1, width) with width 2..8, got {tuple(w.shape)}")
    _check_vec("conv1d_bias", t["conv1d_bias"], dim, (w.dtype,), dev)
    A = t["A"]
    check_tensor("A", A, ndim=2, dtypes=(torch.float32, torch.complex64), device=dev)
    if A.shape[0] != dim or A.shape[1] < 1:
        raise ValueError(f"A: expected (d_inner={dim}, d_state), got {tuple(A.shape)}")
    dstate, cplx = A.shape[1], A.is_complex()
    cols = dstate * (2 if cplx else 1)  # x_proj columns of B / C: (re, im) interleaved for a complex A
    dpw = t["delta_proj_weight"]
    check_tensor("delta_proj_weight", dpw, ndim=2, dtypes=(dt,), device=dev)
    if dpw.shape[0] != dim or dpw.shape[1] < 1:
        raise ValueError(f"delta_proj_weight: expected (d_inner={dim}, dt_rank), got {tuple(dpw.shape)}")
    rank = dpw.shape[1]
    proj_B, proj_C = t["B"] is None, t["C"] is None
    xpw = t["x_proj_weight"]
    check_tensor("x_proj_weight", xpw, ndim=2, dtypes=(dt,), device=dev)
    K = rank + cols * (proj_B + proj_C)
    check_shape("x_proj_weight", xpw, (K, dim))
    opw = t["out_proj_weight"]
    check_tensor("out_proj_weight", opw, ndim=2, dtypes=(dt,), device=dev)
    if opw.shape[1] != dim:
        raise ValueError(f"out_proj_weight: expected (d_out, d_inner={dim}), got {tuple(opw.shape)}")
    _check_vec("out_proj_bias", t["out_proj_bias"], opw.shape[0], (dt,), dev)
    for name in ("D", "delta_bias"):
        _check_vec(name, t[name], dim, (torch.float32,), dev)
    for which, proj in (("B", proj_B), ("C", proj_C)):
        rms = which.lower() + "_rms_weight"
        if proj:
            _check_vec(which + "_proj_bias", t[which + "_proj_bias"], cols, FLOATS, dev)
            if cplx and t[rms] is not None:  # upstream's norm path cannot reshape the (re, im) layout either
                raise ValueError(f"{rms}: not supported with a complex A")
            _check_vec(rms, t[rms], dstate, (torch.float32, dt), dev)
            continue
        for name in (which + "_proj_bias", rms):
            if t[name] is not None:
                raise ValueError(f"{name}: applies to the {which} projected by x_proj; it cannot be combined with "
                                 f"a given {which}")
        _check_given_bc(which, t[which], batch, dim, dstate, seqlen, xz, cplx)
    _check_vec("dt_rms_weight", t["dt_rms_weight"], dim, (torch.float32, dt), dev)
    if checkpoint_lvl not in (0, 1) or isinstance(checkpoint_lvl, bool):
        raise ValueError(f"checkpoint_lvl: must be 0 or 1, got {checkpoint_lvl!r}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"b_c_dt_rms_eps: expected a non-negative float, got {eps!r}")
    return InnerDims(dim, rank, dstate, proj_B, proj_C, bool(delta_softplus), int(checkpoint_lvl), float(eps),
                     cplx)


def _check_given_bc(name: str, M, batch, dim, dstate, seqlen, xz, cplx: bool) -> None:
    """A given B / C in selective_scan_fn's layouts: (d_inner, d_state), (batch, d_state, seqlen) or
    (batch, groups, d_state, seqlen); with a complex A a (d_inner, d_state) may be complex64 and the varying
    ones are real with (re, im) interleaved in time: seqlen -> 2*seqlen."""
    check_tensor(name, M, dtypes=(torch.float32, xz.dtype, torch.complex64) if cplx else (torch.float32, xz.dtype),
                 device=xz.device)
    if M.is_complex() and M.dim() != 2:
        raise ValueError(f"{name}: with a complex A a time-varying {name} is real, (re, im) interleaved in time: "
                         f"(batch, [groups,] d_state, 2*seqlen), got complex")
    if cplx and M.dim() == 2 and M.dtype != torch.float32 and not M.is_complex():
        raise TypeError(f"{name}: a time-invariant {name} with a complex A is complex64 or float32, got {M.dtype}")
    seqlen = 2 * seqlen if cplx else seqlen
    shapes = {2: (dim, dstate), 3: (batch, dstate, seqlen)}
    if M.dim() == 4:
        if M.shape[1] < 1 or dim % M.shape[1]:
            raise ValueError(f"{name}: groups={M.shape[1]} must divide d_inner={dim}")
        shapes[4] = (batch, M.shape[1], dstate, seqlen)
    if M.dim() not in shapes:
        raise ValueError(f"{name}: expected (d_inner, d_state), (batch, d_state, seqlen) or "
                         f"(batch, groups, d_state, seqlen), got {tuple(M.shape)}")
    check_shape(name, M, shapes[M.dim()])


def _autocast(xz: Tensor, t: dict) -> None:
    """Under autocast the projection weights run in xz's (autocast) dtype, as upstream's custom_fwd path."""
    if torch.is_autocast_enabled(xz.device.type):
        for name in ("x_proj_weight", "delta_proj_weight", "out_proj_weight", "out_proj_bias"):
            if t[name] is not None and t[name].is_floating_point():
                t[name] = t[name].to(xz.dtype)


def mamba_inner_fn(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                   out_proj_bias, A, B=None, C=None, D=None, delta_bias=None, B_proj_bias=None, C_proj_bias=None,
                   delta_softplus=True, checkpoint_lvl=1, b_rms_weight=None, c_rms_weight=None, dt_rms_weight=None,
                   b_c_dt_rms_eps=1e-6):
    """Mamba-1's fused layer path (mamba_ssm.ops.selective_scan_interface.mamba_inner_fn).

    xz: (batch, 2*d_inner, seqlen) float32/float16/bfloat16 (in_proj's output, x then z); conv1d_weight:
    (d_inner, 1, width) or (d_inner, width), float32 or xz's dtype; conv1d_bias: (d_inner,); x_proj_weight:
    (dt_rank + 2*d_state, d_inner) (fewer rows by d_state for each of B / C given); delta_proj_weight:
    (d_inner, dt_rank); out_proj_weight: (d_out, d_inner); out_proj_bias: (d_out,) — projections in xz's
    dtype; A: (d_inner, d_state) float32 or complex64; B, C: None (projected: x_proj rows
    dt_rank:dt_rank+d_state and the last d_state; 2*d_state rows each, (re, im) interleaved, for a complex A)
    or given as in selective_scan_fn (its complex-A layouts for a complex A); D, delta_bias: (d_inner,)
    float32; B_proj_bias, C_proj_bias: (d_state,) (2*d_state for a complex A); b_rms_weight, c_rms_weight:
    (d_state,) (real A only); dt_rms_weight: (d_inner,).
    Returns out: (batch, seqlen, d_out) in xz's dtype.

    x, z = xz; u = silu(conv1d(x)); (dt, B, C) = x_proj(u); B += B_proj_bias; B = rms(B) * b_rms_weight (C
    alike); delta = dt_proj(dt) (rms * dt_rms_weight); y = selective_scan(u, delta, A, B, C, D, z, delta_bias,
    delta_softplus); out = out_proj(y). checkpoint_lvl 1 recomputes conv1d_out and delta in backward (0 keeps
    them): docs/fused.md lists what backward keeps, in bytes per token. Every tensor argument is
    differentiable (upstream returns no gradient for the three RMSNorm weights; here they get theirs).
    """
    t = dict(zip(TENSORS, (xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                           out_proj_bias, A, B, C, D, delta_bias, B_proj_bias, C_proj_bias, b_rms_weight,
                           c_rms_weight, dt_rms_weight)))
    if isinstance(conv1d_weight, Tensor) and conv1d_weight.dim() == 3:
        if conv1d_weight.shape[1] != 1:
            raise ValueError(f"conv1d_weight: expected (d_inner, 1, width), got {tuple(conv1d_weight.shape)}")
        t["conv1d_weight"] = conv1d_weight.squeeze(1)
    if isinstance(xz, Tensor):
        _autocast(xz, t)
    dims = _validate(t, delta_softplus, checkpoint_lvl, b_c_dt_rms_eps)
    with torch.autocast(xz.device.type, enabled=False):
        dims = replace(dims, infer=not (torch.is_grad_enabled() and any(
            isinstance(v, Tensor) and v.requires_grad for v in t.values())))
        return _MambaInner.apply(dims, *(t[n] for n in TENSORS))
