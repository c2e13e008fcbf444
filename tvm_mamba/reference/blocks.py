"""Mamba / Mamba-2 / Mamba-3 (SISO) blocks and the small LM composed from the PyTorch references (no TVM).

Functional forms over a parameter dict keyed by mamba_ssm's state_dict names, so tests can run them in
float64 on a copy of a module's parameters and compare outputs and every parameter gradient; the benchmark
runs them in float32 as the "same block written with the PyTorch references".
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from .causal_conv1d import causal_conv1d_ref, causal_conv1d_update_ref
from .mamba3 import mamba3_siso_chunked_ref, mamba3_siso_combined_ref
from .mamba3_mimo import mamba3_mimo_ref
from .rmsnorm_gated import rmsnorm_gated_ref
from .selective_scan import selective_scan_ref, selective_state_update_ref
from .ssd import ssd_chunked_ref, ssd_recurrence_ref

NO_LIMIT = (0.0, float("inf"))


def _linear(x, p, name):
    return F.linear(x, p[name + ".weight"], p.get(name + ".bias"))


def mamba_ref(p, hidden_states, return_final_states=False):
    """p: Mamba parameters (in_proj.weight (2*d_inner, d_model), conv1d.weight (d_inner, 1, d_conv),
    conv1d.bias, x_proj.weight (dt_rank + 2*d_state, d_inner), dt_proj.weight (d_inner, dt_rank),
    dt_proj.bias, A_log (d_inner, d_state), D, out_proj.weight); hidden_states: (batch, seqlen, d_model)
    -> out (batch, seqlen, d_model) [, conv_state (batch, d_inner, d_conv), ssm_state (batch, d_inner, d_state)].

    x, z = in_proj(u); x = silu(conv(x)); (dt, B, C) = x_proj(x); dt = dt_proj.weight @ dt;
    y = selective_scan(x, dt, -exp(A_log), B, C, D, z, delta_bias=dt_proj.bias, softplus); out = out_proj(y).
    Computed in hidden_states' dtype (the scan steps in that dtype).
    """
    dtype = hidden_states.dtype
    d_state = p["A_log"].shape[1]
    dt_rank = p["dt_proj.weight"].shape[1]
    d_conv = p["conv1d.weight"].shape[-1]
    xz = _linear(hidden_states, p, "in_proj").transpose(1, 2)
    x, z = xz.chunk(2, dim=1)
    conv_state = F.pad(x, (d_conv - x.shape[-1], 0)) if x.shape[-1] < d_conv else x[..., -d_conv:]
    x = causal_conv1d_ref(x, p["conv1d.weight"][:, 0], p.get("conv1d.bias"), activation="silu")
    dt, B, C = torch.split(F.linear(x.transpose(1, 2), p["x_proj.weight"]), [dt_rank, d_state, d_state], dim=-1)
    dt = F.linear(dt, p["dt_proj.weight"]).transpose(1, 2)
    A = -torch.exp(p["A_log"].to(dtype))
    y, last = selective_scan_ref(x, dt, A, B.transpose(1, 2), C.transpose(1, 2), p["D"], z=z,
                                 delta_bias=p["dt_proj.bias"], delta_softplus=True, return_last_state=True,
                                 dtype=dtype)
    out = _linear(y.transpose(1, 2), p, "out_proj")
    return (out, conv_state, last) if return_final_states else out


def mamba_step_ref(p, hidden_states, conv_state, ssm_state):
    """One decode token, pure: hidden_states (batch, 1, d_model) -> (out (batch, 1, d_model), conv_state',
    ssm_state'); the update refs of conv1d and the scan."""
    d_state = p["A_log"].shape[1]
    dt_rank = p["dt_proj.weight"].shape[1]
    x, z = _linear(hidden_states[:, 0], p, "in_proj").chunk(2, dim=-1)
    x, conv_state = causal_conv1d_update_ref(x, conv_state, p["conv1d.weight"][:, 0], p.get("conv1d.bias"), "silu")
    dt, B, C = torch.split(F.linear(x, p["x_proj.weight"]), [dt_rank, d_state, d_state], dim=-1)
    dt = F.linear(dt, p["dt_proj.weight"])
    y, ssm_state = selective_state_update_ref(ssm_state, x, dt, -torch.exp(p["A_log"]), B, C, p["D"], z=z,
                                              dt_bias=p["dt_proj.bias"], dt_softplus=True)
    return _linear(y.to(x.dtype), p, "out_proj")[:, None], conv_state, ssm_state


def mamba2_ref(p, u, *, headdim, d_state, ngroups=1, rmsnorm=True, norm_before_gate=False,
               dt_limit=NO_LIMIT, eps=1e-5, scan="recurrence", chunk_size=64, return_final_states=False):
    """p: Mamba2 parameters (in_proj.weight (d_in_proj, d_model), conv1d.weight (conv_dim, 1, d_conv),
    conv1d.bias, dt_bias (nheads,), A_log (nheads,), D (nheads,) or (d_ssm,), norm.weight (d_ssm,),
    out_proj.weight (d_model, d_inner)); u: (batch, seqlen, d_model) -> out (batch, seqlen, d_model)
    [, conv_state (batch, conv_dim, d_conv), ssm_state (batch, nheads, headdim, d_state)].

    [z0, x0, z, xBC, dt] = in_proj(u); xBC = silu(conv(xBC)); y = SSD(x, dt, -exp(A_log), B, C, D, dt_bias,
    softplus, dt_limit); y = rmsnorm_g(y, z) (group = d_ssm/ngroups); out = out_proj([silu(z0) x0, y]).
    scan: "recurrence" (step by step, the test oracle) or "chunked" (upstream's einsum algorithm).
    """
    batch, seqlen, _ = u.shape
    nheads = p["A_log"].shape[0]
    d_ssm = nheads * headdim
    d_conv = p["conv1d.weight"].shape[-1]
    zxbcdt = _linear(u, p, "in_proj")
    d_mlp = (zxbcdt.shape[-1] - 2 * d_ssm - 2 * ngroups * d_state - nheads) // 2
    z0, x0, z, xBC, dt = torch.split(zxbcdt, [d_mlp, d_mlp, d_ssm, d_ssm + 2 * ngroups * d_state, nheads], dim=-1)
    xBC_t = xBC.transpose(1, 2)
    conv_state = F.pad(xBC_t, (d_conv - seqlen, 0)) if seqlen < d_conv else xBC_t[..., -d_conv:]
    xBC = causal_conv1d_ref(xBC_t, p["conv1d.weight"][:, 0], p.get("conv1d.bias"), activation="silu").transpose(1, 2)
    x, B, C = torch.split(xBC, [d_ssm, ngroups * d_state, ngroups * d_state], dim=-1)
    D = p["D"].reshape(nheads, headdim) if p["D"].numel() == d_ssm and d_ssm != nheads else p["D"]
    args = (x.reshape(batch, seqlen, nheads, headdim), dt, -torch.exp(p["A_log"].to(u.dtype)),
            B.reshape(batch, seqlen, ngroups, d_state), C.reshape(batch, seqlen, ngroups, d_state))
    kw = dict(D=D, z=None if rmsnorm else z.reshape(batch, seqlen, nheads, headdim), dt_bias=p["dt_bias"],
              dt_softplus=True, dt_limit=tuple(dt_limit), return_final_states=True)
    if scan == "recurrence":
        y, last = ssd_recurrence_ref(*args, **kw)
    else:
        y, last = ssd_chunked_ref(*args, chunk_size, **kw)
    y = y.reshape(batch, seqlen, d_ssm)
    if rmsnorm:
        y = rmsnorm_gated_ref(y, p["norm.weight"], z=z, eps=eps, group_size=d_ssm // ngroups,
                              norm_before_gate=norm_before_gate)
    if d_mlp > 0:
        y = torch.cat([F.silu(z0) * x0, y], dim=-1)
    out = _linear(y, p, "out_proj")
    return (out, conv_state, last) if return_final_states else out


def mamba3_ref(p, u, *, headdim, d_state, ngroups=1, num_rope_angles, A_floor=1e-4, is_outproj_norm=False,
               eps=1e-5, states=None, return_final_states=False, chunk_size=None):
    """p: Mamba3 parameters (in_proj.weight (d_in_proj, d_model), dt_bias, D (nheads,), B_bias, C_bias
    (nheads, R, d_state), B_norm.weight, C_norm.weight (d_state,), mimo_x, mimo_z, mimo_o (nheads, R, headdim)
    for MIMO (R = mimo_rank; without them SISO, R = 1), norm.weight (d_inner,) with is_outproj_norm,
    out_proj.weight (d_model, d_inner)); u: (batch, seqlen, d_model); states (SISO only): None or (angle
    (batch, nheads, num_rope_angles), ssm (batch, nheads, headdim, d_state), k (batch, nheads, d_state), v
    (batch, nheads, headdim)) to continue from -> out (batch, seqlen, d_model) [, the final states (MIMO: k
    (batch, R, nheads, d_state))].

    Columns of in_proj(u): [z | x | B | C | dd_dt | dd_A | trap | angles]; A = min(-softplus(dd_A), -A_floor),
    DT = softplus(dd_dt + dt_bias); B, C RMS-normed over each (rank, group)'s d_state; the recurrence of
    mamba3_siso_combined_ref (or mamba3_mimo_ref) with Q = C, K = B, V = x, ADT = A DT, Trap = trap (logit),
    biases C_bias / B_bias, the angles shared by every head; then the gated RMSNorm (group headdim, norm before
    gate) with is_outproj_norm (MIMO: per rank against z * mimo_z, then summed with mimo_o), else the silu(z)
    gate inside; out_proj. Computed in u's dtype (float64 in the tests). chunk_size (SISO): None runs the
    recurrence, an int the chunked form (mamba3_siso_chunked_ref, the benchmarks' float32 baseline).
    """
    batch, seqlen, _ = u.shape
    nheads = p["D"].shape[0]
    mimo = "mimo_x" in p
    d_inner, R = nheads * headdim, p["mimo_x"].shape[1] if mimo else 1
    gn = ngroups * d_state * R
    cols = F.linear(u, p["in_proj.weight"])
    edges = torch.tensor([0, d_inner, d_inner, gn, gn, nheads, nheads, nheads, num_rope_angles]).cumsum(0).tolist()
    z, x, B, C, dd_dt, dd_A, trap, ang = (cols[..., lo:hi] for lo, hi in zip(edges[:-1], edges[1:]))
    DT = F.softplus(dd_dt + p["dt_bias"].to(u.dtype))
    A = torch.minimum(-F.softplus(dd_A), torch.full_like(dd_A, -A_floor))
    B = rmsnorm_ref(B.unflatten(-1, (R, ngroups, d_state)), p["B_norm.weight"].to(u.dtype), eps)
    C = rmsnorm_ref(C.unflatten(-1, (R, ngroups, d_state)), p["C_norm.weight"].to(u.dtype), eps)
    heads = lambda t: t.unflatten(-1, (nheads, headdim))  # noqa: E731
    scan = ((A * DT).transpose(1, 2), DT.transpose(1, 2), trap.transpose(1, 2))
    angles = ang[:, :, None, :].expand(batch, seqlen, nheads, num_rope_angles)
    if mimo:
        if states is not None:
            raise ValueError("states: the MIMO reference starts from zero states")
        mimo_o = None if is_outproj_norm else p["mimo_o"]
        res = mamba3_mimo_ref(C, B, heads(x), *scan, p["C_bias"], p["B_bias"], p["mimo_x"], p["mimo_z"], mimo_o,
                              angles, p["D"], None if is_outproj_norm else heads(z), return_state=True, dtype=u.dtype)
    else:
        siso = mamba3_siso_combined_ref if chunk_size is None else partial(mamba3_siso_chunked_ref,
                                                                           chunk_size=chunk_size)
        res = siso(C[:, :, 0], B[:, :, 0], heads(x), *scan, p["C_bias"][:, 0], p["B_bias"][:, 0], angles, D=p["D"],
                   Z=None if is_outproj_norm else heads(z), Input_States=states, return_final_states=True,
                   dtype=u.dtype)
    y = res[0]
    if is_outproj_norm and mimo:
        zr = torch.einsum("blhp,hrp->blrhp", heads(z), p["mimo_z"].to(u.dtype)).flatten(-2)
        y = rmsnorm_gated_ref(y.flatten(-2), p["norm.weight"].to(u.dtype), z=zr, eps=eps, group_size=headdim,
                              norm_before_gate=True).unflatten(-1, (nheads, headdim))
        y = torch.einsum("blrhp,hrp->blhp", y, p["mimo_o"].to(u.dtype)).flatten(-2)
    elif is_outproj_norm:
        y = rmsnorm_gated_ref(y.flatten(-2), p["norm.weight"].to(u.dtype), z=z, eps=eps, group_size=headdim,
                              norm_before_gate=True)
    out = F.linear(y.flatten(-2) if y.dim() == 4 else y, p["out_proj.weight"])
    return (out, tuple(res[1:])) if return_final_states else out


def rmsnorm_ref(x, weight, eps=1e-5):
    """x: (..., d) -> x / sqrt(mean(x^2) + eps) * weight, in float32 or wider, returned in weight's dtype."""
    return rmsnorm_gated_ref(x, weight, eps=eps).to(weight.dtype)


def lm_ref(p, input_ids, mixer, n_layer, residual_in_fp32=True, eps=1e-5):
    """p: MambaLMHeadModel parameters (backbone.embedding.weight (vocab, d_model),
    backbone.layers.{i}.norm.weight, backbone.layers.{i}.mixer.*, backbone.norm_f.weight, lm_head.weight);
    input_ids: (batch, seqlen) -> logits (batch, seqlen, vocab). mixer(params_of_layer, hidden) -> hidden.

    residual = h + residual; h = mixer(norm(residual)); logits = lm_head(norm_f(h + residual)).
    """
    h = F.embedding(input_ids, p["backbone.embedding.weight"])
    residual = None
    for i in range(n_layer):
        pre = f"backbone.layers.{i}."
        residual = h if residual is None else h + residual
        h = rmsnorm_ref(residual, p[pre + "norm.weight"], eps)
        if residual_in_fp32:
            residual = residual.to(torch.promote_types(residual.dtype, torch.float32))
        h = mixer({k[len(pre) + 6:]: v for k, v in p.items() if k.startswith(pre + "mixer.")}, h)
    h = rmsnorm_ref(h + residual, p["backbone.norm_f.weight"], eps)
    return F.linear(h, p["lm_head.weight"])


def mamba_inner_ref(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                    out_proj_bias, A, B=None, C=None, D=None, delta_bias=None, B_proj_bias=None, C_proj_bias=None,
                    delta_softplus=True, checkpoint_lvl=1, b_rms_weight=None, c_rms_weight=None, dt_rms_weight=None,
                    b_c_dt_rms_eps=1e-6):
    """Mamba-1's fused path (mamba_ssm ``mamba_inner_fn``) composed from the references, in xz's dtype.

    xz: (batch, 2*d_inner, seqlen); conv1d_weight: (d_inner, 1, width) or (d_inner, width); x_proj_weight:
    (dt_rank + 2*d_state, d_inner) (B at rows dt_rank:dt_rank+d_state, C the last d_state, each only when not
    given); delta_proj_weight: (d_inner, dt_rank); out_proj_weight: (d_out, d_inner); A: (d_inner, d_state)
    -> out: (batch, seqlen, d_out). A complex A (d_inner, d_state) takes 2*d_state x_proj rows per B / C,
    (re, im) interleaved: rows r0 + 2n, r0 + 2n + 1 are state n's (upstream's "(dstate two)"); B / C then go
    to the scan as (batch, d_state, 2*seqlen), (re, im) interleaved in time (selective_scan_ref's layout).

    x, z = xz; u = silu(conv(x)); x_dbl = x_proj(u); delta = dt_proj(x_dbl[:dt_rank]) (rms * dt_rms_weight);
    B = rms(x_dbl[B rows] + B_proj_bias) * b_rms_weight (C alike); y = scan(u, delta, A, B, C, D, z,
    delta_bias, delta_softplus); out = out_proj(y). checkpoint_lvl changes memory only.
    """
    dtype = xz.dtype
    dim = xz.shape[1] // 2
    rank, dstate = delta_proj_weight.shape[1], A.shape[1] * (2 if A.is_complex() else 1)
    w = conv1d_weight[:, 0] if conv1d_weight.dim() == 3 else conv1d_weight
    x, z = xz.chunk(2, dim=1)
    u = causal_conv1d_ref(x, w, conv1d_bias, activation="silu")
    x_dbl = F.linear(u.transpose(1, 2), x_proj_weight)  # (batch, seqlen, K)
    delta = F.linear(x_dbl[..., :rank], delta_proj_weight)
    if dt_rms_weight is not None:
        delta = rmsnorm_gated_ref(delta, dt_rms_weight, eps=b_c_dt_rms_eps)
    mats = {}
    for name, M, rows, bias, rms in (("B", B, slice(rank, rank + dstate), B_proj_bias, b_rms_weight),
                                     ("C", C, slice(x_dbl.shape[-1] - dstate, None), C_proj_bias, c_rms_weight)):
        if M is None:
            M = x_dbl[..., rows]
            if bias is not None:
                M = M + bias.to(dtype)
            if rms is not None:
                M = rmsnorm_gated_ref(M, rms, eps=b_c_dt_rms_eps)
            if A.is_complex():  # (batch, seqlen, (d_state two)) -> (batch, d_state, (seqlen two))
                M = M.reshape(*M.shape[:2], -1, 2).permute(0, 2, 1, 3).reshape(M.shape[0], -1, 2 * M.shape[1])
            else:
                M = M.transpose(1, 2)  # (batch, d_state, seqlen)
        mats[name] = M
    y = selective_scan_ref(u, delta.transpose(1, 2), A, mats["B"], mats["C"], D, z=z, delta_bias=delta_bias,
                           delta_softplus=delta_softplus, dtype=dtype)
    return F.linear(y.transpose(1, 2), out_proj_weight, out_proj_bias)


def mamba_split_conv1d_scan_ref(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None,
                                seq_idx=None, dt_limit=NO_LIMIT, return_final_states=False, activation="silu",
                                rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None,
                                headdim=None, ngroups=1, norm_before_gate=True):
    """Mamba-2's fused path (mamba_ssm ``mamba_split_conv1d_scan_combined``) composed from the references
    (the step-by-step SSD recurrence), in zxbcdt's dtype.

    zxbcdt: (batch, seqlen, 2*d_nonssm + 2*dim + 2*ngroups*dstate + nheads), dim = nheads*headdim;
    conv1d_weight: (dim + 2*ngroups*dstate, width) (or with a middle 1); dt_bias, A: (nheads,); D: (nheads,)
    (headdim given) or (nheads, headdim); initial_states: (batch, nheads, headdim, dstate); seq_idx:
    (batch, seqlen); rmsnorm_weight: (dim,); outproj_weight: (d_out, d_nonssm + dim)
    -> out: (batch, seqlen, d_out or d_nonssm + dim) [, final_states (batch, nheads, headdim, dstate)].

    [z0, x0, z, xBC, dt] = zxbcdt; xBC = act(conv(xBC, seq_idx)); [x, B, C] = xBC; y = SSD(x, dt, A, B, C, D,
    dt_bias, softplus, dt_limit, initial_states, seq_idx); y = rmsnorm_g(y, z) (group dim/ngroups) if
    rmsnorm_weight else y * silu(z); out = outproj([silu(z0) * x0, y]). chunk_size changes nothing here.
    """
    batch, seqlen, width = zxbcdt.shape
    if D.dim() == 1:
        nheads = D.shape[0]
    else:
        nheads, headdim = D.shape
    dim = nheads * headdim
    w = conv1d_weight[:, 0] if conv1d_weight.dim() == 3 else conv1d_weight
    dstate = (w.shape[0] - dim) // ngroups // 2
    d_nonssm = (width - 2 * dim - 2 * ngroups * dstate - nheads) // 2
    z0, x0, z, xBC, dt = torch.split(zxbcdt, [d_nonssm, d_nonssm, dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    xBC = causal_conv1d_ref(xBC.transpose(1, 2), w, conv1d_bias, seq_idx=seq_idx, activation=activation)
    x, B, C = torch.split(xBC.transpose(1, 2), [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    z = z.reshape(batch, seqlen, nheads, headdim)
    y, final = ssd_recurrence_ref(
        x.reshape(batch, seqlen, nheads, headdim), dt, A, B.reshape(batch, seqlen, ngroups, dstate),
        C.reshape(batch, seqlen, ngroups, dstate), D=D, z=z if rmsnorm_weight is None else None, dt_bias=dt_bias,
        initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True, dt_limit=tuple(dt_limit),
        return_final_states=True)
    y = y.reshape(batch, seqlen, dim)
    if rmsnorm_weight is not None:
        y = rmsnorm_gated_ref(y, rmsnorm_weight, z=z.reshape(batch, seqlen, dim), eps=rmsnorm_eps,
                              group_size=dim // ngroups, norm_before_gate=norm_before_gate)
    if d_nonssm > 0:
        y = torch.cat([F.silu(z0) * x0, y], dim=-1)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    return (y, final) if return_final_states else y
