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
    across a change of seq_idx count as 0; initial_states belong to the sequence of position 0; out is 0 at
    padding positions (seq_idx < 0), as causal-conv1d 1.7.0 defines them. Computed in x's dtype (pass
    float64 for the reference).
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
    if seq_idx is not None:
        out = out.masked_fill((seq_idx < 0)[:, None, :], 0.0)
    if return_final_states:
        return out, xx[..., xx.shape[-1] - (width - 1):]
    return out


def causal_conv1d_update_ref(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                             conv_state_indices=None):
    """x: (batch, dim) or (batch, dim, seqlen); conv_state: (batch, dim, state_len), or with
    conv_state_indices (batch,) a pool (pool, dim, state_len) -> (out, new_conv_state).

    Pure: returns the new state (the whole pool) instead of updating in place. Row b uses slot
    conv_state_indices[b] (slot < 0: a padding row, out 0, no slot touched). Per row, with window
    w = the last width-1 state entries (circular: entries (cache_seqlens[b] - (width-1) + j) mod state_len)
    and xs = [w | x]: out[t] = act(bias + sum_k weight[k] * xs[t + k]). State: linear, new = [state | x][-state_len:];
    circular, x[i] is written at (cache_seqlens[b] + i) mod state_len, i ascending (a later token wins).
    """
    squeeze = x.dim() == 2
    if squeeze:
        x = x.unsqueeze(-1)
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    state_len = conv_state.shape[-1]
    new_state = conv_state.clone()
    out = torch.zeros_like(x)
    for b in range(batch):
        slot = b if conv_state_indices is None else int(conv_state_indices[b])
        if slot < 0:
            continue
        row = conv_state[slot].to(x.dtype)  # (dim, state_len)
        if cache_seqlens is None:
            xs = torch.cat([row[:, state_len - (width - 1):], x[b]], dim=-1)
            new_state[slot] = torch.cat([row, x[b]], dim=-1)[:, -state_len:].to(conv_state.dtype)
        else:
            start = int(cache_seqlens[b]) % state_len
            window = [(start - (width - 1) + j) % state_len for j in range(width - 1)]
            xs = torch.cat([row[:, window], x[b]], dim=-1)
            for i in range(seqlen):
                new_state[slot, :, (start + i) % state_len] = x[b, :, i].to(conv_state.dtype)
        acc = sum(xs[:, k:k + seqlen] * weight[:, k].to(x.dtype)[:, None] for k in range(width))
        if bias is not None:
            acc = acc + bias.to(x.dtype)[:, None]
        out[b] = F.silu(acc) if activation in ("silu", "swish") else acc
    return (out.squeeze(-1) if squeeze else out), new_state


def causal_conv1d_varlen_states_ref(x, cu_seqlens, state_len):
    """x: (total_tokens, dim); cu_seqlens: (batch + 1,) -> states: (batch, dim, state_len).

    states[b] = the last state_len tokens of packed sequence b (x[cu_seqlens[b]:cu_seqlens[b+1]]), right
    aligned, zeros on the left where the sequence is shorter (causal-conv1d 1.7.0's
    causal_conv1d_varlen_states).
    """
    batch = cu_seqlens.shape[0] - 1
    states = x.new_zeros(batch, x.shape[1], state_len)
    for b in range(batch):
        end = int(cu_seqlens[b + 1])
        start = max(int(cu_seqlens[b]), end - state_len)
        if end > start:
            states[b, :, state_len - (end - start):] = x[start:end].T
    return states
