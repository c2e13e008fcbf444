"""mamba_split_conv1d_scan_combined: mamba_ssm 2.3.x's fused Mamba-2 layer path
(``ops/triton/ssd_combined.MambaSplitConv1dScanCombinedFn``).

zxbcdt (the in_proj output) -> split [z0, x0 | z | xBC | dt] -> causal conv1d (+ SiLU) of xBC -> SSD scan ->
gated RMSNorm (or the z gate) -> [silu(z0) * x0 | y] -> out_proj, in one autograd node. The SSM math runs in
tvm_mamba's kernels through their registered custom ops (``tvm_mamba::causal_conv1d_fwd/bwd``,
``ssd_fwd/bwd``, ``rmsnorm_gated_fwd/bwd``); out_proj is a torch GEMM, and the optional d_nonssm SwiGLU
branch (upstream's ``_swiglu_fwd``) is three torch elementwise ops, as in tvm_mamba's Mamba2 module.

What backward keeps (docs/fused.md has the bytes per token at the 130M / 2.7B shapes), s = zxbcdt's element
size: zxbcdt itself, the SSD output before the gate / norm (dim*s), the RMSNorm's rstd (ngroups*4) — as
upstream — plus the SSD's dt_out and dA_cumsum (2*nheads*4; upstream recomputes them inside its backward,
ssd_bwd takes them as inputs), and with rmsnorm_weight=None and out_proj given the gated output (dim*s;
upstream recomputes it: here the gate is inside the SSD kernel). Recomputed in backward as upstream: the
conv1d output (one conv1d forward), the chunk states (inside ssd_bwd) and the out_proj input (one RMSNorm
forward, one SwiGLU).
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
from .ssd import check_seq_idx, dt_limit_pair, ssd_bwd, ssd_fwd

# the tensor arguments, in upstream's order (the autograd node's inputs, by name)
TENSORS = ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D", "initial_states", "seq_idx",
           "rmsnorm_weight", "outproj_weight", "outproj_bias")


@dataclass(frozen=True)
class SplitDims:
    """Static dims and flags of one call."""
    nheads: int
    headdim: int
    ngroups: int
    dstate: int
    d_nonssm: int
    chunk_size: int
    dt_limit: tuple
    silu: bool
    eps: float
    norm_before_gate: bool

    # no gradient needed (the caller's grad mode and tensors, decided before the Function: its forward runs with
    # grad mode off either way): the projections take fp32_linear (the modules' inference route), else F.linear
    infer: bool = False

    @property
    def dim(self) -> int:
        return self.nheads * self.headdim

    @property
    def splits(self) -> list:
        """zxbcdt's last-dim split: [z0 x0, z, xBC, dt]."""
        return [2 * self.d_nonssm, self.dim, self.dim + 2 * self.ngroups * self.dstate, self.nheads]


def channels_to_rows(out: Tensor, sizes: list) -> list:
    """out: (batch, channels, seqlen) contiguous (a conv1d output) -> one contiguous (batch, seqlen, size) tensor
    per part of ``sizes`` channels (x, B, C for the SSD, whose kernels take compact buffers).

    Copied one 2-D (size, seqlen) -> (seqlen, size) transpose per batch row: torch copies a fully transposed
    2-D matrix with its blocked transpose, while the same data as a 3-D transposed view (what ``prepare`` got
    before) goes through the generic strided copy, 2-4x slower at (1, 1792, 256..1024) fp32 on one core."""
    batch, _, seqlen = out.shape
    parts = []
    for part in torch.split(out, sizes, dim=1):
        rows = part.new_empty((batch, seqlen, part.shape[1]))
        for b in range(batch):
            rows[b].copy_(part[b].t())
        parts.append(rows)
    return parts


def _conv(t: dict, dims: SplitDims):
    """xBC -> act(conv1d(xBC)) as (batch, conv_dim, seqlen) -> x, B, C for the SSD (compact)."""
    batch, seqlen, _ = t["zxbcdt"].shape
    xBC = torch.split(t["zxbcdt"], dims.splits, dim=-1)[2].transpose(1, 2)
    out, _ = run_op(causal_conv1d_fwd, xBC, t["conv1d_weight"], t["conv1d_bias"], t["seq_idx"], None, False,
                    dims.silu)
    gn = dims.ngroups * dims.dstate
    x, B, C = channels_to_rows(out, [dims.dim, gn, gn])
    return (x.view(batch, seqlen, dims.nheads, dims.headdim), B.view(batch, seqlen, dims.ngroups, dims.dstate),
            C.view(batch, seqlen, dims.ngroups, dims.dstate))


def _ssd_args(t: dict, dims: SplitDims) -> tuple:
    """(dt, A, chunk_size, D, dt_bias, initial_states, seq_idx) for ssd_fwd / ssd_bwd; dt is a view of zxbcdt."""
    dt = torch.split(t["zxbcdt"], dims.splits, dim=-1)[3]
    return dt, t["A"], dims.chunk_size, t["D"], t["dt_bias"], t["initial_states"], t["seq_idx"]


def _z(t: dict, dims: SplitDims) -> Tensor:
    return torch.split(t["zxbcdt"], dims.splits, dim=-1)[1]  # (batch, seqlen, dim)


def _norm(t: dict, dims: SplitDims, y: Tensor):
    """Gated RMSNorm of the SSD output y (batch, seqlen, dim) with z, group dim/ngroups -> (out rows, rstd)."""
    return norm_fwd(y.reshape(-1, dims.dim), t["rmsnorm_weight"], _z(t, dims).reshape(-1, dims.dim), dims.eps,
                    dims.dim // dims.ngroups, dims.norm_before_gate)


def _swiglu(zx0: Tensor) -> Tensor:
    """zx0: (batch, seqlen, 2*d_nonssm) = [a | b] -> silu(a) * b: (batch, seqlen, d_nonssm) (upstream's
    _swiglu_fwd: the MLP columns of a Mamba2 block with d_ssm < d_inner, as tvm_mamba's Mamba2 computes them)."""
    a, b = zx0.chunk(2, dim=-1)
    return F.silu(a) * b


def _swiglu_bwd(zx0: Tensor, dout: Tensor) -> Tensor:
    """d[a | b] of silu(a) * b: [dout * b * silu'(a) | dout * silu(a)], silu'(a) = sig(a) (1 + a (1 - sig(a)))."""
    a, b = zx0.chunk(2, dim=-1)
    sig = torch.sigmoid(a)
    return torch.cat([dout * b * sig * (1 + a * (1 - sig)), dout * a * sig], dim=-1)


class _MambaSplit(torch.autograd.Function):
    """One node for the whole path; saves by name exactly what the module docstring lists."""

    @staticmethod
    def forward(ctx, dims: SplitDims, *tensors):
        t = dict(zip(TENSORS, tensors))
        batch, seqlen, _ = t["zxbcdt"].shape
        x, B, C = _conv(t, dims)
        dt, A, Q, D, dt_bias, init, seq_idx = _ssd_args(t, dims)
        has_rms = t["rmsnorm_weight"] is not None
        z4 = _z(t, dims).reshape(batch, seqlen, dims.nheads, dims.headdim)
        y, final, dt_out, dA_cs, _, y_pre = run_op(  # (later outputs, e.g. varlen states: unused)
            ssd_fwd, x, dt, A, B, C, Q, D, None if has_rms else z4, dt_bias, init, seq_idx, True,
            list(dims.dt_limit), False)[:6]
        keep = dict(t, dt_out=dt_out, dA_cs=dA_cs)
        if has_rms:
            out, keep["rstd"] = _norm(t, dims, y)
            keep["y"] = y
        else:
            out, keep["y"] = y, y_pre
            if t["outproj_weight"] is not None:
                keep["y_gated"] = y
        out = out.reshape(batch, seqlen, dims.dim)
        if dims.d_nonssm:
            out = torch.cat([_swiglu(torch.split(t["zxbcdt"], dims.splits, dim=-1)[0]), out], dim=-1)
        if t["outproj_weight"] is not None:
            out = fp32_linear_if(dims.infer)(out, t["outproj_weight"], t["outproj_bias"])
        ctx.names = tuple(keep)
        ctx.save_for_backward(*keep.values())
        ctx.dims = dims
        ctx.out_shape = tuple(out.shape)
        ctx.set_materialize_grads(False)
        return out, final

    @staticmethod
    def backward(ctx, dout, dfinal):
        dims: SplitDims = ctx.dims
        s = dict(zip(ctx.names, ctx.saved_tensors))
        zxbcdt = s["zxbcdt"]
        batch, seqlen, _ = zxbcdt.shape
        dim, has_rms = dims.dim, s["rmsnorm_weight"] is not None
        if dout is None:
            dout = zxbcdt.new_zeros(ctx.out_shape)
        zx0, z = torch.split(zxbcdt, dims.splits, dim=-1)[:2]
        g = {}
        if s["outproj_weight"] is not None:  # recompute out_proj's input (norm + swiglu), as upstream
            y1 = _norm(s, dims, s["y"])[0].reshape(batch, seqlen, dim) if has_rms else s["y_gated"].reshape(
                batch, seqlen, dim)
            lin_in = torch.cat([_swiglu(zx0), y1], dim=-1) if dims.d_nonssm else y1
            g["outproj_weight"] = torch.einsum("bso,bsd->od", dout, lin_in)
            if s["outproj_bias"] is not None:
                g["outproj_bias"] = dout.sum((0, 1))
            dout = torch.matmul(dout, s["outproj_weight"])
        dzx0 = None
        if dims.d_nonssm:
            dout0, dout = torch.split(dout, [dims.d_nonssm, dim], dim=-1)
            dzx0 = _swiglu_bwd(zx0, dout0)
        x, B, C = _conv(s, dims)
        dt, A, Q, D, dt_bias, init, seq_idx = _ssd_args(s, dims)
        shape4 = (batch, seqlen, dims.nheads, dims.headdim)
        if has_rms:
            dy, dz, g["rmsnorm_weight"] = norm_bwd(s["y"].reshape(-1, dim), s["rmsnorm_weight"], z.reshape(-1, dim),
                                                   dout.reshape(-1, dim), s["rstd"], dims.eps, dim // dims.ngroups,
                                                   dims.norm_before_gate)
            z4, y_pre = None, None
        else:
            dy, z4, y_pre = dout, z.reshape(shape4), s["y"]
        dx, ddt, g["A"], dB, dC, dD, dz4, ddt_bias, dinit = run_op(
            ssd_bwd, dy.reshape(shape4), dfinal, x, dt, A, B, C, Q, D, z4, dt_bias, init, seq_idx, True,
            list(dims.dt_limit), s["dt_out"], s["dA_cs"], None, y_pre)
        if not has_rms:
            dz = dz4
        g["D"], g["dt_bias"] = dD, ddt_bias
        if init is not None:
            g["initial_states"] = dinit
        dxBC = torch.cat([dx.reshape(batch, seqlen, dim), dB.reshape(batch, seqlen, -1),
                          dC.reshape(batch, seqlen, -1)], dim=-1).transpose(1, 2)
        xBC = torch.split(zxbcdt, dims.splits, dim=-1)[2].transpose(1, 2)
        dxBC_in, g["conv1d_weight"], dcb, _ = run_op(causal_conv1d_bwd, xBC, s["conv1d_weight"], s["conv1d_bias"],
                                                     seq_idx, None, dxBC, None, dims.silu)
        if s["conv1d_bias"] is not None:
            g["conv1d_bias"] = dcb
        parts = [dzx0] if dzx0 is not None else []
        parts += [dz.reshape(batch, seqlen, dim).to(zxbcdt.dtype), dxBC_in.transpose(1, 2), ddt.to(zxbcdt.dtype)]
        g["zxbcdt"] = torch.cat(parts, dim=-1)
        return (None,) + tuple(g.get(n) for n in TENSORS)


# ----------------------------------------------------------------------------------------------------
# Public API (mamba_ssm 2.3.x name, argument order and defaults)
# ----------------------------------------------------------------------------------------------------
def _check_vec(name: str, v, n: int, dtypes, device) -> None:
    if v is not None:
        check_tensor(name, v, ndim=1, dtypes=dtypes, device=device)
        check_shape(name, v, (n,))


def _int(name: str, v, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ValueError(f"{name}: must be in {lo}..{hi}, got {v}")
    return v


def _heads(D, headdim, ngroups, dev):
    """nheads, headdim from D ((nheads,) with headdim given, or (nheads, headdim)); ngroups must divide nheads."""
    check_tensor("D", D, dtypes=FLOATS, device=dev)
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("headdim: required when D is (nheads,)")
        nheads, headdim = D.shape[0], _int("headdim", headdim, 1, 256)
    elif D.dim() == 2:
        (nheads, hd), headdim = D.shape, D.shape[1] if headdim is None else headdim
        if headdim != hd:
            raise ValueError(f"headdim: {headdim} differs from D's {tuple(D.shape)}")
        _int("headdim", headdim, 1, 256)
    else:
        raise ValueError(f"D: expected (nheads,) or (nheads, headdim), got {tuple(D.shape)}")
    if nheads < 1:
        raise ValueError(f"D: nheads must be >= 1, got {tuple(D.shape)}")
    _int("ngroups", ngroups, 1, nheads)
    if nheads % ngroups:
        raise ValueError(f"ngroups: must divide nheads={nheads}, got {ngroups}")
    return nheads, headdim


def _check_widths(zxbcdt, w, dim, nheads, ngroups):
    """dstate from conv1d_weight ((dim + 2*ngroups*dstate, width)) and d_nonssm from zxbcdt's last dim."""
    conv_dim = w.shape[0]
    if conv_dim <= dim or (conv_dim - dim) % (2 * ngroups) or not 2 <= w.shape[1] <= 8:
        raise ValueError(f"conv1d_weight: expected (dim + 2*ngroups*dstate, width) with dim={dim}, "
                         f"ngroups={ngroups}, dstate >= 1, width 2..8, got {tuple(w.shape)}")
    dstate = (conv_dim - dim) // (2 * ngroups)
    if dstate > 256:
        raise ValueError(f"conv1d_weight: dstate must be <= 256, got {dstate}")
    rest = zxbcdt.shape[2] - 2 * dim - 2 * ngroups * dstate - nheads
    if rest < 0 or rest % 2:
        raise ValueError(f"zxbcdt: last dim must be 2*d_nonssm + 2*dim + 2*ngroups*dstate + nheads = 2*d_nonssm + "
                         f"{2 * dim + 2 * ngroups * dstate + nheads}, got {zxbcdt.shape[2]}")
    return dstate, rest // 2


def _validate(t: dict, chunk_size, dt_limit, activation, rmsnorm_eps, headdim, ngroups, norm_before_gate):
    zx = t["zxbcdt"]
    check_tensor("zxbcdt", zx, ndim=3, dtypes=FLOATS)
    batch, seqlen, _ = zx.shape
    dev, dtype = zx.device, zx.dtype
    if batch < 1 or seqlen < 1:
        raise ValueError(f"zxbcdt: batch and seqlen must be >= 1, got {tuple(zx.shape)}")
    nheads, headdim = _heads(t["D"], headdim, ngroups, dev)
    dim = nheads * headdim
    w = t["conv1d_weight"]
    check_tensor("conv1d_weight", w, ndim=2, dtypes=(torch.float32, dtype), device=dev)
    dstate, d_nonssm = _check_widths(zx, w, dim, nheads, ngroups)
    _check_vec("conv1d_bias", t["conv1d_bias"], w.shape[0], (w.dtype,), dev)
    for name in ("dt_bias", "A"):
        check_tensor(name, t[name], ndim=1, dtypes=FLOATS, device=dev)
        check_shape(name, t[name], (nheads,))
    if t["initial_states"] is not None:
        check_tensor("initial_states", t["initial_states"], ndim=4, dtypes=FLOATS, device=dev)
        check_shape("initial_states", t["initial_states"], (batch, nheads, headdim, dstate))
    if t["seq_idx"] is not None:
        check_seq_idx(t["seq_idx"], batch, seqlen, dev, padding=True)
    _check_vec("rmsnorm_weight", t["rmsnorm_weight"], dim, (torch.float32, dtype), dev)
    if t["outproj_weight"] is not None:
        check_tensor("outproj_weight", t["outproj_weight"], ndim=2, dtypes=(dtype,), device=dev)
        if t["outproj_weight"].shape[1] != d_nonssm + dim:
            raise ValueError(f"outproj_weight: expected (d_out, {d_nonssm + dim}), got "
                             f"{tuple(t['outproj_weight'].shape)}")
        _check_vec("outproj_bias", t["outproj_bias"], t["outproj_weight"].shape[0], (dtype,), dev)
    elif t["outproj_bias"] is not None:
        raise ValueError("outproj_bias: given without outproj_weight")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation: must be None, 'silu' or 'swish', got {activation!r}")
    if not isinstance(rmsnorm_eps, (int, float)) or isinstance(rmsnorm_eps, bool) or not rmsnorm_eps >= 0:
        raise ValueError(f"rmsnorm_eps: expected a non-negative float, got {rmsnorm_eps!r}")
    return SplitDims(nheads, headdim, ngroups, dstate, d_nonssm, _int("chunk_size", chunk_size, 1, 256),
                     dt_limit_pair(dt_limit), activation is not None, float(rmsnorm_eps), bool(norm_before_gate))


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True):
    """Mamba-2's fused layer path (mamba_ssm.ops.triton.ssd_combined.mamba_split_conv1d_scan_combined).

    zxbcdt: (batch, seqlen, 2*d_nonssm + 2*dim + 2*ngroups*dstate + nheads), dim = nheads*headdim,
    float32/float16/bfloat16; conv1d_weight: (dim + 2*ngroups*dstate, width) (or with a middle 1), float32 or
    zxbcdt's dtype; conv1d_bias: (dim + 2*ngroups*dstate,); dt_bias, A: (nheads,); D: (nheads, headdim) or
    (nheads,) with headdim given; chunk_size in 1..256; initial_states: (batch, nheads, headdim, dstate);
    seq_idx: (batch, seqlen) int32, nondecreasing or ending in negative ids (padding: conv out 0, a sequence of
    its own for the SSD, as upstream's kernels); rmsnorm_weight: (dim,); outproj_weight:
    (d_out, d_nonssm + dim) and outproj_bias (d_out,) in zxbcdt's dtype.
    Returns out: (batch, seqlen, d_out) (or d_nonssm + dim without outproj_weight) in zxbcdt's dtype
    [, final_states: (batch, nheads, headdim, dstate) float32].

    xBC = act(conv1d(xBC, seq_idx)); y = SSD(x, dt, A, B, C, D, dt_bias, dt_softplus=True, dt_limit,
    initial_states, seq_idx); y = rmsnorm_g(y, z) (group dim/ngroups, norm_before_gate) if rmsnorm_weight
    else y * silu(z); out = outproj([silu(z0) * x0, y]). Differentiable in every float tensor argument (and
    through final_states); docs/fused.md lists what backward keeps, in bytes per token.
    """
    t = dict(zip(TENSORS, (zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, seq_idx,
                           rmsnorm_weight, outproj_weight, outproj_bias)))
    if isinstance(conv1d_weight, Tensor) and conv1d_weight.dim() == 3 and conv1d_weight.shape[1] == 1:
        t["conv1d_weight"] = conv1d_weight.squeeze(1)
    if isinstance(zxbcdt, Tensor) and torch.is_autocast_enabled(zxbcdt.device.type):
        # under autocast, out_proj runs in zxbcdt's (autocast) dtype, as upstream's custom_fwd path
        for name in ("outproj_weight", "outproj_bias"):
            if t[name] is not None:
                t[name] = t[name].to(zxbcdt.dtype)
    dims = _validate(t, chunk_size, dt_limit, activation, rmsnorm_eps, headdim, ngroups, norm_before_gate)
    with torch.autocast(zxbcdt.device.type, enabled=False):
        dims = replace(dims, infer=not (torch.is_grad_enabled() and any(
            isinstance(v, Tensor) and v.requires_grad for v in t.values())))
        out, final = _MambaSplit.apply(dims, *(t[n] for n in TENSORS))
    return (out, final) if return_final_states else out
