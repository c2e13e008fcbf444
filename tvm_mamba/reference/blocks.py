"""Mamba / Mamba-2 blocks and the small LM composed from the PyTorch references (no TVM).

Functional forms over a parameter dict keyed by mamba_ssm's state_dict names, so tests can run them in
float64 on a copy of a module's parameters and compare outputs and every parameter gradient; the benchmark
runs them in float32 as the "same block written with the PyTorch references".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .causal_conv1d import causal_conv1d_ref, causal_conv1d_update_ref
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
