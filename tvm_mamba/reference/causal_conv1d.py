"""Causal depthwise conv1d written from the math in plain PyTorch (float64-capable; no TVM).

Used by the tests and benchmarks as the independent reference; autograd through it gives the reference
gradients.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_ref(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                      activation=None):
    """x: (batch, dim, seqlen); weight: (dim, width); bias: (dim,); seq_idx: (batch, seqlen) int;
    initial_states: (batch, dim, width-1) -> out: (batch, dim, seqlen) [, final_states: (batch, dim, width-1)].

    out[b,c,t] = act(bias[c] + sum_k weight[c,k] * xx[b,c,t-(width-1)+k]), xx = [initial_states | x], taps
    across a change of seq_idx count as 0; initial_states belong to the sequence of position 0. Computed in
    x's dtype (pass float64 for the reference).
    """
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    pad = initial_states if initial_states is not None else x.new_zeros(batch, dim, width - 1)
    xx = torch.cat([pad.to(x.dtype), x], dim=-1)  # (batch, dim, width-1+seqlen)
    out = torch.zeros_like(x) if bias is None else bias.to(x.dtype)[None, :, None].expand(batch, dim, seqlen).clone()
    t = torch.arange(seqlen, device=x.device)
    for k in range(width):
        tap = xx[..., k:k + seqlen] * weight[:, k].to(x.dtype)[None, :, None]
        if seq_idx is not None:
            src = t - (width - 1) + k
            same = seq_idx[:, src.clamp(min=0)] == seq_idx  # (batch, seqlen)
            # a tap before t = 0 reads initial_states, which continue the row's first sequence only
            first = seq_idx[:, :1] == seq_idx if initial_states is not None else torch.zeros_like(same)
            same = torch.where((src >= 0)[None, :], same, first)
            tap = tap * same[:, None, :].to(x.dtype)
        out = out + tap
    if activation in ("silu", "swish"):
        out = F.silu(out)
    if return_final_states:
        return out, xx[..., xx.shape[-1] - (width - 1):]
    return out


def causal_conv1d_update_ref(x, conv_state, weight, bias=None, activation=None):
    """x: (batch, dim) or (batch, dim, seqlen); conv_state: (batch, dim, state_len) -> (out, new_state).

    Pure: returns the new state instead of updating in place. xs = [conv_state | x];
    out[t] = act(bias + sum_k weight[k] * xs[state_len + t - (width-1) + k]); new_state = xs[..., -state_len:].
    """
    squeeze = x.dim() == 2
    if squeeze:
        x = x.unsqueeze(-1)
    width = weight.shape[1]
    state_len = conv_state.shape[-1]
    seqlen = x.shape[-1]
    xs = torch.cat([conv_state.to(x.dtype), x], dim=-1)
    out = torch.zeros_like(x)
    for k in range(width):
        start = state_len - (width - 1) + k
        out = out + xs[..., start:start + seqlen] * weight[:, k].to(x.dtype)[None, :, None]
    if bias is not None:
        out = out + bias.to(x.dtype)[None, :, None]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    new_state = xs[..., -state_len:]
    return (out.squeeze(-1) if squeeze else out), new_state
