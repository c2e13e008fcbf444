"""Mamba2: mamba_ssm 2.3.x's ``modules/mamba2.Mamba2`` block (single process) on the TVM kernels.

Same parameter names, shapes and initialisation as upstream, so a mamba_ssm state_dict loads
(d_in_proj = 2*d_inner + 2*ngroups*d_state + nheads, conv_dim = d_ssm + 2*ngroups*d_state):

=================  ==============================================
in_proj.weight     (d_in_proj, d_model)        (+ in_proj.bias with bias=True)
conv1d.weight      (conv_dim, 1, d_conv)       conv1d.bias (conv_dim,) with conv_bias=True
dt_bias            (nheads,)                   A_log (nheads,)
D                  (nheads,) or (d_ssm,) with D_has_hdim
norm.weight        (d_ssm,)                    (with rmsnorm=True)
out_proj.weight    (d_model, d_inner)          (+ out_proj.bias with bias=True)
=================  ==============================================

Forward: with use_mem_eff_path (default) and no cache to fill, upstream's fused
``mamba_split_conv1d_scan_combined``; otherwise upstream's unfused path, which it matches:
in_proj -> [z0, x0 (d_mlp each), z, xBC, dt] -> causal_conv1d_fn(xBC) + SiLU -> [x, B, C] ->
mamba_chunk_scan_combined(x, dt, A=-exp(A_log), B, C, D, dt_bias, dt_softplus=True, dt_limit) ->
RMSNormGated(y, z) (norm_before_gate=False, group_size = d_ssm/ngroups) -> [silu(z0)*x0, y] -> out_proj.
Decoding uses causal_conv1d_update and selective_state_update (head layout), one token per call.
Varlen prefill (cu_seqlens with inference_params) uses causal_conv1d_varlen_states and the scan's
return_varlen_states; cu_seqlens may stop before the row's end, the rest being padding (upstream's
test_generation_varlen_with_padding). Not supported: tensor/sequence parallelism (process_group).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..torch_ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update, causal_conv1d_varlen_states
from ..torch_ops.mamba_split import channels_to_rows, mamba_split_conv1d_scan_combined
from ..torch_ops.selective_scan import selective_state_update
from ..torch_ops.ssd import mamba_chunk_scan_combined
from . import _decode
from ._checks import FLOAT_STATES, check_cu_seqlens, check_hidden, check_state, states_from_cache
from .linear import Linear
from .rmsnorm_gated import RMSNormGated

NO_LIMIT = (0.0, float("inf"))


class Mamba2(nn.Module):
    """Mamba-2 block. forward(u: (batch, seqlen, d_model)) -> (batch, seqlen, d_model).

    Per head h: state_t = exp(dt_t A_h) state_{t-1} + dt_t x_t B_t^T, y_t = state_t C_t + D_h x_t, with
    dt = clamp(softplus(dt_raw + dt_bias), dt_limit); out = out_proj(rmsnorm_g(y * silu(z)) * weight).
    """

    def __init__(self, d_model, d_state=128, d_conv=4, conv_init=None, expand=2, headdim=64, d_ssm=None,
                 ngroups=1, A_init_range=(1, 16), D_has_hdim=False, rmsnorm=True, norm_before_gate=False,
                 dt_min=0.001, dt_max=0.1, dt_init_floor=1e-4, dt_limit=(0.0, float("inf")), bias=False,
                 conv_bias=True, chunk_size=256, use_mem_eff_path=True, layer_idx=None, process_group=None,
                 sequence_parallel=True, device=None, dtype=None):
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        if process_group is not None:
            raise ValueError("process_group: tensor parallelism is not supported (use None)")
        self.d_model = d_model
        self.d_state = d_state
        self.d_conv = d_conv
        self.conv_init = conv_init
        self.expand = expand
        self.d_inner = self.expand * self.d_model
        self.headdim = headdim
        self.d_ssm = self.d_inner if d_ssm is None else d_ssm
        if self.d_ssm % headdim:
            raise ValueError(f"headdim: must divide d_ssm={self.d_ssm}, got {headdim}")
        self.ngroups = ngroups
        self.nheads = self.d_ssm // self.headdim
        if self.nheads % ngroups:
            raise ValueError(f"ngroups: must divide nheads={self.nheads}, got {ngroups}")
        self.D_has_hdim = D_has_hdim
        self.rmsnorm = rmsnorm
        self.norm_before_gate = norm_before_gate
        self.dt_limit = tuple(dt_limit)
        self.activation = "silu"
        self.chunk_size = chunk_size
        self.use_mem_eff_path = use_mem_eff_path  # forward without inference_params: the fused split path
        self.layer_idx = layer_idx
        self.world_size = 1

        d_in_proj = 2 * self.d_inner + 2 * self.ngroups * self.d_state + self.nheads
        self.in_proj = Linear(self.d_model, d_in_proj, bias=bias, **factory_kwargs)
        conv_dim = self.d_ssm + 2 * self.ngroups * self.d_state
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, bias=conv_bias, kernel_size=d_conv, groups=conv_dim,
                                padding=d_conv - 1, **factory_kwargs)
        if self.conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -self.conv_init, self.conv_init)
        self.act = nn.SiLU()

        # dt_bias = softplus^-1(dt), dt log-uniform in [dt_min, dt_max] (upstream's init)
        dt = torch.exp(torch.rand(self.nheads, **factory_kwargs) * (math.log(dt_max) - math.log(dt_min))
                       + math.log(dt_min))
        dt = torch.clamp(dt, min=dt_init_floor)
        inv_dt = dt + torch.log(-torch.expm1(-dt))
        self.dt_bias = nn.Parameter(inv_dt)
        self.dt_bias._no_weight_decay = True
        if not (0 < A_init_range[0] <= A_init_range[1]):
            raise ValueError(f"A_init_range: expected 0 < low <= high, got {A_init_range!r}")
        A = torch.empty(self.nheads, dtype=torch.float32, device=device).uniform_(*A_init_range)
        self.A_log = nn.Parameter(torch.log(A).to(dtype=dtype))
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_ssm if self.D_has_hdim else self.nheads, device=device))
        self.D._no_weight_decay = True
        if self.rmsnorm:
            self.norm = RMSNormGated(self.d_ssm, eps=1e-5, norm_before_gate=self.norm_before_gate,
                                     group_size=self.d_ssm // ngroups, **factory_kwargs)
        self.out_proj = Linear(self.d_inner, self.d_model, bias=bias, **factory_kwargs)

    # ------------------------------------------------------------------------------------------------
    def _conv_weight(self):
        return self.conv1d.weight.squeeze(1)  # (conv_dim, 1, d_conv) -> (conv_dim, d_conv)

    def _split(self, zxbcdt):
        d_mlp = (zxbcdt.shape[-1] - 2 * self.d_ssm - 2 * self.ngroups * self.d_state - self.nheads) // 2
        return d_mlp, torch.split(zxbcdt, [d_mlp, d_mlp, self.d_ssm,
                                           self.d_ssm + 2 * self.ngroups * self.d_state, self.nheads], dim=-1)

    def _finish(self, y, z, z0, x0, d_mlp, project=None):
        """Gated norm, the MLP half, out_proj (``project(out_proj, y)`` when given: the decode step's)."""
        if self.rmsnorm:
            y = self.norm(y, z)
        if d_mlp > 0:
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)
        return self.out_proj(y) if project is None else project(self.out_proj, y)

    def forward(self, u, seqlen=None, seq_idx=None, cu_seqlens=None, inference_params=None,
                return_final_states=False):
        """u: (batch, seqlen, d_model), or (batch*seqlen, d_model) with ``seqlen`` given -> out shaped like u
        [, conv_state (batch, conv_dim, d_conv), ssm_state (batch, nheads, headdim, d_state) float32 with
        return_final_states (prefill)].

        seq_idx: (batch, seqlen) int32, packed sequences (no state crosses a change of id). cu_seqlens:
        (nseq + 1,) int32 boundaries of nseq sequences packed in one row (batch 1): with inference_params,
        the cache rows 0..nseq-1 get each sequence's final conv / ssm state (upstream's varlen prefill); the
        sequences are kept apart by seq_idx, derived from cu_seqlens when not given (upstream needs both).
        Positions from cu_seqlens[-1] on are padding: they get no cache row and change no sequence's output or
        state; their own output is upstream's for the seq_idx given there (derived: a sequence of its own;
        negative ids: the conv gives 0 there, so y is 0 before the gate and norm).
        ``inference_params`` as mamba_ssm (prefill when seqlen_offset == 0, else one :meth:`step`)."""
        if seqlen is not None:  # upstream's (batch*seqlen, d_model) input form
            if u.dim() != 2 or u.shape[0] % seqlen:
                raise ValueError(f"u: with seqlen={seqlen} expected (batch*seqlen, d_model), got {tuple(u.shape)}")
            out = self.forward(u.reshape(-1, seqlen, u.shape[-1]), None, seq_idx, cu_seqlens, inference_params,
                               return_final_states)
            return (out[0].reshape(u.shape[0], -1), *out[1:]) if return_final_states else out.reshape(u.shape[0], -1)
        check_hidden("u", u, self.d_model)
        batch, seqlen, _ = u.shape
        if cu_seqlens is not None:
            seq_idx = check_cu_seqlens(cu_seqlens, batch, seqlen, seq_idx)
            if return_final_states:
                raise ValueError("return_final_states: not available with cu_seqlens (the per-sequence states "
                                 "go to inference_params' cache)")
        conv_state = ssm_state = None
        if inference_params is not None:
            cache_batch = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else batch
            conv_state, ssm_state = self._get_states_from_cache(inference_params, cache_batch)
            self._check_states(conv_state, ssm_state, cache_batch, u.device)
            if inference_params.seqlen_offset > 0:
                out, _, _ = self.step(u, conv_state, ssm_state)
                return out
        varlen = cu_seqlens is not None and conv_state is not None
        zxbcdt = self.in_proj(u)  # (batch, seqlen, d_in_proj)
        A = -torch.exp(self.A_log.float())
        if self.use_mem_eff_path and conv_state is None and not return_final_states:  # upstream's training path
            return self._fused_forward(zxbcdt, A, seq_idx)
        d_mlp, (z0, x0, z, xBC, dt) = self._split(zxbcdt)
        want_states = return_final_states or conv_state is not None
        xBC_t = xBC.transpose(1, 2)  # (batch, conv_dim, seqlen)
        if varlen:  # each sequence's last d_conv conv inputs (zero-padded on the left), one cache row each
            new_conv = causal_conv1d_varlen_states(xBC[0], cu_seqlens, state_len=self.d_conv)
        elif want_states:  # the last d_conv conv inputs (zero-padded on the left), upstream's layout
            new_conv = F.pad(xBC_t, (self.d_conv - seqlen, 0)) if seqlen < self.d_conv else xBC_t[..., -self.d_conv:]
        xBC = causal_conv1d_fn(xBC_t, self._conv_weight(), self.conv1d.bias, seq_idx=seq_idx,
                               activation=self.activation)
        x, B, C = channels_to_rows(xBC, [self.d_ssm, self.ngroups * self.d_state, self.ngroups * self.d_state])
        y = mamba_chunk_scan_combined(
            x.reshape(batch, seqlen, self.nheads, self.headdim), dt, A,
            B.reshape(batch, seqlen, self.ngroups, self.d_state), C.reshape(batch, seqlen, self.ngroups, self.d_state),
            chunk_size=self.chunk_size, D=self.D.reshape(self.nheads, self.headdim) if self.D_has_hdim else self.D,
            z=None if self.rmsnorm else z.reshape(batch, seqlen, self.nheads, self.headdim),
            dt_bias=self.dt_bias, dt_softplus=True, seq_idx=seq_idx, dt_limit=self.dt_limit,
            cu_seqlens=cu_seqlens if varlen else None, return_final_states=want_states and not varlen,
            return_varlen_states=varlen)
        if want_states:  # (y, final_states) or, varlen, (y, varlen_states (nseq, nheads, headdim, d_state))
            y, last_state = y
        out = self._finish(y.reshape(batch, seqlen, self.d_ssm), z, z0, x0, d_mlp)
        if conv_state is not None:
            conv_state[:new_conv.shape[0]].copy_(new_conv)
            ssm_state[:last_state.shape[0]].copy_(last_state)
        if return_final_states:
            return out, new_conv.contiguous(), last_state
        return out

    def _fused_forward(self, zxbcdt, A, seq_idx):
        """zxbcdt: (batch, seqlen, d_in_proj) -> (batch, seqlen, d_model) through mamba_split_conv1d_scan_combined
        (conv, SSD, gated norm and out_proj in one autograd node: upstream's memory behaviour, docs/fused.md)."""
        return mamba_split_conv1d_scan_combined(
            zxbcdt, self.conv1d.weight, self.conv1d.bias, self.dt_bias, A,
            D=self.D.reshape(self.nheads, self.headdim) if self.D_has_hdim else self.D, chunk_size=self.chunk_size,
            seq_idx=seq_idx, dt_limit=self.dt_limit, activation=self.activation,
            rmsnorm_weight=self.norm.weight if self.rmsnorm else None,
            rmsnorm_eps=self.norm.eps if self.rmsnorm else 1e-6, outproj_weight=self.out_proj.weight,
            outproj_bias=self.out_proj.bias, headdim=None if self.D_has_hdim else self.headdim,
            ngroups=self.ngroups, norm_before_gate=self.norm_before_gate)

    def _check_states(self, conv_state, ssm_state, batch, device):
        conv_dim = self.conv1d.weight.shape[0]
        check_state("conv_state", conv_state, batch, (conv_dim, self.d_conv), FLOAT_STATES, device)
        check_state("ssm_state", ssm_state, batch, (self.nheads, self.headdim, self.d_state), FLOAT_STATES, device)

    def step(self, hidden_states, conv_state, ssm_state):
        """One decode token. hidden_states: (batch, 1, d_model); conv_state: (batch', conv_dim, d_conv) and
        ssm_state: (batch', nheads, headdim, d_state) float32 (or 16-bit: kept in its dtype, fp32 math), batch' >=
        batch, updated in place (rows :batch)
        -> (out (batch, 1, d_model), conv_state, ssm_state)."""
        planned = _decode.planned_step(self, hidden_states, conv_state, ssm_state)
        if planned is not None:
            return planned
        batch = hidden_states.shape[0]
        zxbcdt = _decode.project(self.in_proj, hidden_states.squeeze(1))  # (batch, d_in_proj), as the plan's
        d_mlp, (z0, x0, z, xBC, dt) = self._split(zxbcdt)
        xBC = causal_conv1d_update(xBC, conv_state[:batch], self._conv_weight(), self.conv1d.bias, self.activation)
        x, B, C = torch.split(xBC, [self.d_ssm, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1)
        hp = (self.nheads, self.headdim)
        A = (-torch.exp(self.A_log.float()))[:, None, None].expand(*hp, self.d_state)
        D = self.D.float().reshape(hp) if self.D_has_hdim else self.D.float()[:, None].expand(hp)
        if self.dt_limit == NO_LIMIT:  # softplus(dt + dt_bias) inside the kernel
            dt_k, dt_bias, softplus = dt, self.dt_bias.float()[:, None].expand(hp), True
        else:  # the kernel has no clamp: apply softplus and dt_limit here so decode matches forward
            dt_k = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit).to(dt.dtype)
            dt_bias, softplus = None, False
        y = selective_state_update(
            ssm_state[:batch], x.reshape(batch, *hp), dt_k[:, :, None].expand(batch, *hp), A,
            B.reshape(batch, self.ngroups, self.d_state), C.reshape(batch, self.ngroups, self.d_state), D,
            z=None if self.rmsnorm else z.reshape(batch, *hp), dt_bias=dt_bias, dt_softplus=softplus)
        out = self._finish(y.reshape(batch, self.d_ssm), z, z0, x0, d_mlp, _decode.project)
        return out.unsqueeze(1), conv_state, ssm_state

    def decode_plan(self, conv_state, ssm_state, batch):
        """A :class:`~tvm_mamba.modules._decode.Mamba2Step` for these (checked) states: :meth:`step`'s work on
        preallocated buffers, its kernels' launches replayed; ``.step(h (batch, d_model), out=None)``."""
        return _decode.Mamba2Step(self, conv_state, ssm_state, batch)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        """-> conv_state (batch_size, conv_dim, d_conv) in dtype (default conv1d.weight's), ssm_state
        (batch_size, nheads, headdim, d_state) float32 (the decode kernel keeps the state in float32)."""
        device = self.out_proj.weight.device
        conv_dtype = self.conv1d.weight.dtype if dtype is None else dtype
        conv_state = torch.zeros(batch_size, self.conv1d.weight.shape[0], self.d_conv, device=device,
                                 dtype=conv_dtype)
        ssm_state = torch.zeros(batch_size, self.nheads, self.headdim, self.d_state, device=device,
                                dtype=torch.float32)
        return conv_state, ssm_state

    def _get_states_from_cache(self, inference_params, batch_size, initialize_states=False):
        return states_from_cache(self, inference_params, batch_size, initialize_states)
