"""Mamba: mamba_ssm 2.3.x's ``modules/mamba_simple.Mamba`` block on the TVM kernels.

Same parameter names, shapes and initialisation as upstream, so a mamba_ssm state_dict loads:

=================  ==============================================
in_proj.weight     (2 * d_inner, d_model)   (+ in_proj.bias with bias=True)
conv1d.weight      (d_inner, 1, d_conv)     conv1d.bias (d_inner,) with conv_bias=True
x_proj.weight      (dt_rank + 2 * d_state, d_inner)
dt_proj.weight     (d_inner, dt_rank)       dt_proj.bias (d_inner,)
A_log              (d_inner, d_state)       D (d_inner,)
out_proj.weight    (d_model, d_inner)       (+ out_proj.bias with bias=True)
=================  ==============================================

Forward: with use_fast_path (default) and no cache to fill, upstream's fused ``mamba_inner_fn``; otherwise
upstream's non-fused path, which it matches: in_proj -> split x, z ->
causal_conv1d_fn(x) + SiLU -> x_proj -> (dt, B, C) -> dt_proj.weight @ dt -> selective_scan_fn(x, dt, A=-exp(A_log),
B, C, D, z, delta_bias=dt_proj.bias, delta_softplus=True) -> out_proj. Decoding uses causal_conv1d_update and
selective_state_update (one token per call).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..torch_ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from ..torch_ops.linear import fp32_linear
from ..torch_ops.mamba_inner import mamba_inner_fn
from ..torch_ops.selective_scan import selective_scan_fn, selective_state_update
from . import _decode
from ._checks import FLOAT_STATES, check_hidden, check_state, states_from_cache
from .linear import Linear


class Mamba(nn.Module):
    """Mamba-1 block. forward(hidden_states: (batch, seqlen, d_model)) -> (batch, seqlen, d_model).

    h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t, y_t = (C_t . h_t + D x_t) * silu(z_t), with x the causal-conv +
    SiLU of in_proj's first half, z its second half and dt = softplus(dt_proj(x_proj(x)[:dt_rank])).
    """

    def __init__(self, d_model, d_state=16, d_conv=4, expand=2, dt_rank="auto", dt_min=0.001, dt_max=0.1,
                 dt_init="random", dt_scale=1.0, dt_init_floor=1e-4, conv_bias=True, bias=False,
                 use_fast_path=True, layer_idx=None, device=None, dtype=None):
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.d_model = d_model
        self.d_state = d_state
        self.d_conv = d_conv
        self.expand = expand
        self.d_inner = int(self.expand * self.d_model)
        self.dt_rank = math.ceil(self.d_model / 16) if dt_rank == "auto" else dt_rank
        self.use_fast_path = use_fast_path  # forward without inference_params: mamba_inner_fn (upstream's)
        self.layer_idx = layer_idx
        self.activation = "silu"

        self.in_proj = Linear(self.d_model, self.d_inner * 2, bias=bias, **factory_kwargs)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, bias=conv_bias, kernel_size=d_conv,
                                groups=self.d_inner, padding=d_conv - 1, **factory_kwargs)
        self.act = nn.SiLU()
        self.x_proj = Linear(self.d_inner, self.dt_rank + self.d_state * 2, bias=False, **factory_kwargs)
        self.dt_proj = Linear(self.dt_rank, self.d_inner, bias=True, **factory_kwargs)

        # Initialize special dt projection to preserve variance at initialization (upstream's init)
        dt_init_std = self.dt_rank ** -0.5 * dt_scale
        if dt_init == "constant":
            nn.init.constant_(self.dt_proj.weight, dt_init_std)
        elif dt_init == "random":
            nn.init.uniform_(self.dt_proj.weight, -dt_init_std, dt_init_std)
        else:
            raise ValueError(f"dt_init: expected 'constant' or 'random', got {dt_init!r}")
        # dt_proj.bias = softplus^-1(dt), dt log-uniform in [dt_min, dt_max]
        dt = torch.exp(torch.rand(self.d_inner, **factory_kwargs) * (math.log(dt_max) - math.log(dt_min))
                       + math.log(dt_min)).clamp(min=dt_init_floor)
        inv_dt = dt + torch.log(-torch.expm1(-dt))
        with torch.no_grad():
            self.dt_proj.bias.copy_(inv_dt)
        self.dt_proj.bias._no_reinit = True

        # S4D real initialization: A = -[1..d_state] per channel
        A = torch.arange(1, self.d_state + 1, dtype=torch.float32, device=device).repeat(self.d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_inner, device=device))
        self.D._no_weight_decay = True
        self.out_proj = Linear(self.d_inner, self.d_model, bias=bias, **factory_kwargs)

    # ------------------------------------------------------------------------------------------------
    def _conv_weight(self):
        return self.conv1d.weight.squeeze(1)  # (d_inner, 1, d_conv) -> (d_inner, d_conv)

    def forward(self, hidden_states, inference_params=None, return_final_states=False):
        """hidden_states: (batch, seqlen, d_model) -> out (batch, seqlen, d_model)
        [, conv_state (batch, d_inner, d_conv), ssm_state (batch, d_inner, d_state) float32 with
        return_final_states: the states to continue from with :meth:`step` (prefill)].
        ``inference_params`` (mamba_ssm's InferenceParams protocol): prefill when seqlen_offset == 0 (the
        cache entry of layer_idx is filled), else one :meth:`step`."""
        check_hidden("hidden_states", hidden_states, self.d_model)
        batch, seqlen, _ = hidden_states.shape
        conv_state = ssm_state = None
        if inference_params is not None:
            conv_state, ssm_state = self._get_states_from_cache(inference_params, batch)
            self._check_states(conv_state, ssm_state, batch, hidden_states.device)
            if inference_params.seqlen_offset > 0:
                out, _, _ = self.step(hidden_states, conv_state, ssm_state)
                return out
        xz = self.in_proj(hidden_states).transpose(1, 2)  # (batch, 2*d_inner, seqlen)
        A = -torch.exp(self.A_log.float())
        if self.use_fast_path and conv_state is None and not return_final_states:  # upstream's training path
            return mamba_inner_fn(xz, self.conv1d.weight, self.conv1d.bias, self.x_proj.weight, self.dt_proj.weight,
                                  self.out_proj.weight, self.out_proj.bias, A, None, None, self.D.float(),
                                  delta_bias=self.dt_proj.bias.float(), delta_softplus=True)
        x, z = xz.chunk(2, dim=1)
        want_states = return_final_states or conv_state is not None
        if want_states:  # the last d_conv inputs of the conv (zero-padded on the left), upstream's layout
            new_conv = F.pad(x, (self.d_conv - seqlen, 0)) if seqlen < self.d_conv else x[..., -self.d_conv:]
        x = causal_conv1d_fn(x, self._conv_weight(), self.conv1d.bias, activation=self.activation)
        x_dbl = self.x_proj(x.transpose(1, 2))  # (batch, seqlen, dt_rank + 2*d_state)
        dt, B, C = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = fp32_linear(dt, self.dt_proj.weight).transpose(1, 2)  # (batch, d_inner, seqlen), bias in the scan
        y = selective_scan_fn(x, dt, A, B.transpose(1, 2), C.transpose(1, 2), self.D.float(), z=z,
                              delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
                              return_last_state=want_states)
        if want_states:
            y, last_state = y
        out = self.out_proj(y.transpose(1, 2))
        if conv_state is not None:
            conv_state[:batch].copy_(new_conv)
            ssm_state[:batch].copy_(last_state)
        if return_final_states:
            return out, new_conv.contiguous(), last_state
        return out

    def _check_states(self, conv_state, ssm_state, batch, device):
        check_state("conv_state", conv_state, batch, (self.d_inner, self.d_conv), FLOAT_STATES, device)
        check_state("ssm_state", ssm_state, batch, (self.d_inner, self.d_state), FLOAT_STATES, device)
        if not ssm_state.is_contiguous():
            raise ValueError("ssm_state: must be contiguous (it is updated in place)")

    def step(self, hidden_states, conv_state, ssm_state):
        """One decode token. hidden_states: (batch, 1, d_model); conv_state: (batch', d_inner, d_conv) and
        ssm_state: (batch', d_inner, d_state) float32, batch' >= batch, updated in place (rows :batch)
        -> (out (batch, 1, d_model), conv_state, ssm_state)."""
        planned = _decode.planned_step(self, hidden_states, conv_state, ssm_state)
        if planned is not None:
            return planned
        batch = hidden_states.shape[0]
        xz = _decode.project(self.in_proj, hidden_states.squeeze(1))  # (batch, 2*d_inner), as the plan's
        x, z = xz.chunk(2, dim=-1)
        x = causal_conv1d_update(x, conv_state[:batch], self._conv_weight(), self.conv1d.bias, self.activation)
        x_db = _decode.project(self.x_proj, x)
        dt, B, C = torch.split(x_db, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = fp32_linear(dt, self.dt_proj.weight)
        A = -torch.exp(self.A_log.float())
        y = selective_state_update(ssm_state[:batch], x, dt, A, B, C, self.D.float(), z=z,
                                   dt_bias=self.dt_proj.bias.float(), dt_softplus=True)
        out = _decode.project(self.out_proj, y)
        return out.unsqueeze(1), conv_state, ssm_state

    def decode_plan(self, conv_state, ssm_state, batch):
        """A :class:`~tvm_mamba.modules._decode.MambaStep` for these (checked) states: :meth:`step`'s work on
        preallocated buffers, its kernels' launches replayed; ``.step(h (batch, d_model), out=None)``."""
        return _decode.MambaStep(self, conv_state, ssm_state, batch)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        """-> conv_state (batch_size, d_inner, d_conv) in dtype (default conv1d.weight's), ssm_state
        (batch_size, d_inner, d_state) float32 (the decode kernel keeps the state in float32; upstream
        uses dtype — a deliberate difference). max_seqlen is unused (the state is constant-size)."""
        device = self.out_proj.weight.device
        conv_dtype = self.conv1d.weight.dtype if dtype is None else dtype
        conv_state = torch.zeros(batch_size, self.d_inner, self.d_conv, device=device, dtype=conv_dtype)
        ssm_state = torch.zeros(batch_size, self.d_inner, self.d_state, device=device, dtype=torch.float32)
        return conv_state, ssm_state

    def _get_states_from_cache(self, inference_params, batch_size, initialize_states=False):
        return states_from_cache(self, inference_params, batch_size, initialize_states)
