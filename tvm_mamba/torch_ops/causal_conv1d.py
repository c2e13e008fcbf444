"""causal_conv1d_fn / causal_conv1d_update / causal_conv1d_varlen_states: causal-conv1d 1.7.0's API on TVM
kernels, as torch custom ops.

Ops (namespace ``tvm_mamba``): ``causal_conv1d_fwd``, ``causal_conv1d_bwd``, ``causal_conv1d_update``,
``causal_conv1d_varlen_states``; each has a fake (meta) implementation for torch.compile, and the forward
has autograd registered.

Backward memory: the forward saves only its inputs (x, weight, bias, seq_idx, initial_states); the
backward recomputes the pre-activation (one extra pass over x, cheaper than storing batch*dim*seqlen
fp32) and uses two fp32 workspaces: g = dout * act'(pre) (batch, dim, seqlen) and the per-row dweight /
dbias partials (batch, dim, width+1), summed over batch in a fixed order (deterministic, no atomics).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..compute.causal_conv1d.dims import (CausalConv1dBwd, CausalConv1dFwd, CausalConv1dUpdate,
                                           CausalConv1dVarlenStates)
from ._fastpath import FastPath
from ._dlpack import (FLOATS, check_no_overlap, check_shape, check_size, check_tensor, dummy, kernel_for,
                      kernel_may_write, prepare, prepare_pool, run_op, slot_stats, tvm_dtype)

OP = "causal_conv1d"


def _dims(cls, x: Tensor, weight: Tensor, silu: bool, bias, seq_idx, initial_states, flag: bool):
    """The forward's or backward's dims (``cls``); ``flag``: return_final / has_dfinal."""
    return cls.cached(x.shape[1], weight.shape[1], "silu" if silu else "none", bias is not None,
                      seq_idx is not None, initial_states is not None, flag, tvm_dtype(x), tvm_dtype(weight))


def _opt(t: Optional[Tensor], like: Tensor, dtype, ndim: int) -> Tensor:
    return prepare(t) if t is not None else dummy(like.device, dtype, ndim)


@torch.library.custom_op("tvm_mamba::causal_conv1d_fwd", mutates_args=())
def causal_conv1d_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], seq_idx: Optional[Tensor],
                      initial_states: Optional[Tensor], return_final_states: bool,
                      silu: bool) -> tuple[Tensor, Tensor]:
    """x: (batch, dim, seqlen) -> out: (batch, dim, seqlen), final_states: (batch, dim, width-1) (or (0,))."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    x, weight = prepare(x), prepare(weight)
    out = torch.empty_like(x)
    final = x.new_empty((batch, dim, width - 1) if return_final_states else (0,))
    if x.numel() == 0:
        if return_final_states and batch * dim:
            final.copy_(initial_states if initial_states is not None else torch.zeros_like(final))
        return out, final
    dims = _dims(CausalConv1dFwd, x, weight, silu, bias, seq_idx, initial_states, return_final_states)
    kern = kernel_for(OP, "fwd", x.device, dims, batch=batch, seqlen=seqlen)
    kern(x, weight, _opt(bias, x, weight.dtype, 1), _opt(seq_idx, x, torch.int32, 2),
         _opt(initial_states, x, x.dtype, 3), out,
         final if return_final_states else dummy(x.device, x.dtype, 3))
    return out, final


@causal_conv1d_fwd.register_fake
def _(x, weight, bias, seq_idx, initial_states, return_final_states, silu):
    batch, dim, _ = x.shape
    final = x.new_empty((batch, dim, weight.shape[1] - 1) if return_final_states else (0,))
    return torch.empty_like(x, memory_format=torch.contiguous_format), final


@torch.library.custom_op("tvm_mamba::causal_conv1d_bwd", mutates_args=())
def causal_conv1d_bwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], seq_idx: Optional[Tensor],
                      initial_states: Optional[Tensor], dout: Tensor, dfinal: Optional[Tensor],
                      silu: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dx, dweight, dbias or (0,), dinitial_states or (0,)) of causal_conv1d_fwd."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    x, weight, dout = prepare(x), prepare(weight), prepare(dout.to(x.dtype))
    dx = torch.empty_like(x)
    dweight = torch.zeros_like(weight)
    dbias = torch.zeros_like(bias) if bias is not None else weight.new_empty((0,))
    dinit = x.new_empty((batch, dim, width - 1)) if initial_states is not None else x.new_empty((0,))
    if x.numel() == 0:
        if initial_states is not None:
            dinit.copy_(dfinal if dfinal is not None else torch.zeros_like(dinit))
        return dx, dweight, dbias, dinit
    dims = _dims(CausalConv1dBwd, x, weight, silu, bias, seq_idx, initial_states, dfinal is not None)
    kern = kernel_for(OP, "bwd", x.device, dims, batch=batch, seqlen=seqlen)
    g = torch.empty(x.shape, device=x.device, dtype=torch.float32)
    partial = torch.empty((batch, dim, width + 1), device=x.device, dtype=torch.float32)
    kern(x, weight, _opt(bias, x, weight.dtype, 1), _opt(seq_idx, x, torch.int32, 2),
         _opt(initial_states, x, x.dtype, 3), dout,
         prepare(dfinal.to(x.dtype)) if dfinal is not None else dummy(x.device, x.dtype, 3),
         dx, dweight, dbias if bias is not None else dummy(x.device, weight.dtype, 1),
         dinit if initial_states is not None else dummy(x.device, x.dtype, 3), g, partial)
    return dx, dweight, dbias, dinit


@causal_conv1d_bwd.register_fake
def _(x, weight, bias, seq_idx, initial_states, dout, dfinal, silu):
    batch, dim, _ = x.shape
    dbias = torch.empty_like(bias) if bias is not None else weight.new_empty((0,))
    dinit = x.new_empty((batch, dim, weight.shape[1] - 1)) if initial_states is not None else x.new_empty((0,))
    return (torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight), dbias, dinit)


def _setup_context(ctx, inputs, output):
    x, weight, bias, seq_idx, initial_states, _, silu = inputs
    ctx.save_for_backward(x, weight, bias, seq_idx, initial_states)
    ctx.silu = silu


def _backward(ctx, dout, dfinal):
    x, weight, bias, seq_idx, initial_states = ctx.saved_tensors
    if dfinal is not None and dfinal.numel() == 0:
        dfinal = None
    if dout is None:
        dout = torch.zeros_like(x)
    dx, dweight, dbias, dinit = torch.ops.tvm_mamba.causal_conv1d_bwd(
        x, weight, bias, seq_idx, initial_states, dout, dfinal, ctx.silu)
    return (dx, dweight, dbias if bias is not None else None, None,
            dinit if initial_states is not None else None, None, None)


causal_conv1d_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check_update_values(conv_state: Tensor, cache_seqlens: Optional[Tensor],
                         conv_state_indices: Optional[Tensor]) -> None:
    """ValueError for an index the kernel must not follow, before it runs (conv_state untouched). Here, in
    the op's implementation, not in the public function: reading the values is data-dependent, and
    torch.compile traces the public function (the fake implementation checks shapes only)."""
    if conv_state_indices is not None and conv_state_indices.numel():
        pool = conv_state.shape[0]
        hi, dup = slot_stats(conv_state_indices)
        if hi >= pool:
            raise ValueError(f"conv_state_indices: a slot must be < conv_state.shape[0] = {pool} (negative: a "
                             f"padding row), got {hi}")
        if dup:
            raise ValueError("conv_state_indices: two rows name the same conv_state slot (each row updates its "
                             "slot in place)")
    if cache_seqlens is not None:  # a padding row's value is never read
        low = _live_min(cache_seqlens, conv_state_indices)
        if low is not None and low < 0:
            raise ValueError(f"cache_seqlens: must be >= 0, got {low}")


def _live_min(values: Tensor, rows: Optional[Tensor]) -> Optional[int]:
    """The smallest of ``values`` over the rows that are not padding (``rows`` >= 0), None if there are none;
    a CPU tensor through numpy (~2 us; torch's masked min ~15 us at decode sizes)."""
    if values.device.type == "cpu":
        v = values.numpy() if rows is None else values.numpy()[rows.numpy() >= 0]
        return int(v.min()) if v.size else None
    live = values if rows is None else values[rows >= 0]
    return int(live.min()) if live.numel() else None


@torch.library.custom_op("tvm_mamba::causal_conv1d_update", mutates_args=("conv_state",))
def causal_conv1d_update_op(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor], silu: bool,
                            cache_seqlens: Optional[Tensor], conv_state_indices: Optional[Tensor]) -> Tensor:
    """x: (batch, dim, seqlen) or (batch, dim) (one token: out in that form, no view made);
    conv_state: (batch or pool, dim, state_len), updated in place -> out."""
    _check_update_values(conv_state, cache_seqlens, conv_state_indices)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    launch_update(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices, out)
    return out


def launch_update(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor], silu: bool,
                  cache_seqlens: Optional[Tensor], conv_state_indices: Optional[Tensor], out: Optional[Tensor]) -> None:
    """The decode-step kernel on :func:`causal_conv1d_update_op`'s tensors (values checked by the caller),
    writing ``out`` (x's shape, compact), or x itself when ``out`` is None (in place, vLLM's convention: x
    (batch, dim), compact, 64-byte aligned, apart from the other tensors; the caller checked)."""
    batch, dim, seqlen = x.shape if x.dim() == 3 else (*x.shape, 1)
    if batch * dim == 0 or seqlen == 0:
        return
    xk, weight = x if out is None else prepare(x), prepare(weight)  # in place: x as it is (the caller checked)
    state = prepare_pool(conv_state, False)  # conv_state itself unless its elements overlap or it is unaligned
    dims = CausalConv1dUpdate.cached(dim, weight.shape[1], state.shape[2], "silu" if silu else "none",
                                     bias is not None, conv_state_indices is not None, cache_seqlens is not None,
                                     tvm_dtype(xk), tvm_dtype(weight), tvm_dtype(state), x.dim() == 2, out is None)
    kern = kernel_for(OP, "update", x.device, dims, batch=batch, seqlen=seqlen)
    kern(xk, state, weight, _opt(bias, x, weight.dtype, 1), _opt(conv_state_indices, x, torch.int32, 1),
         _opt(cache_seqlens, x, torch.int32, 1), out if out is not None else dummy(x.device, x.dtype, 2))
    if state is not conv_state:  # a strided or unaligned conv_state: the kernel updated a compact copy
        conv_state.copy_(state)


@causal_conv1d_update_op.register_fake
def _(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _check_cu_seqlens(cu_seqlens: Tensor, total: int) -> None:
    """ValueError unless cu_seqlens starts at 0, never decreases and ends at or before total_tokens (the tokens
    after its last entry are padding, read by no state: causal-conv1d 1.7.0's kernel reads only inside each
    sequence). Data-dependent: checked in the op's implementation, before its kernel runs."""
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    if first != 0 or last > total:
        raise ValueError(f"cu_seqlens: must start at 0 and end at or before total_tokens = {total}, got {first} "
                         f"... {last}")
    if cu_seqlens.numel() > 1 and bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError("cu_seqlens: must be non-decreasing (cumulative sequence lengths)")


@torch.library.custom_op("tvm_mamba::causal_conv1d_varlen_states", mutates_args=())
def causal_conv1d_varlen_states_op(x: Tensor, cu_seqlens: Tensor, state_len: int) -> Tensor:
    """x: (total_tokens, dim); cu_seqlens: (batch + 1,) -> states: (batch, state_len, dim), contiguous."""
    _check_cu_seqlens(cu_seqlens, x.shape[0])
    batch, dim = cu_seqlens.shape[0] - 1, x.shape[1]
    if batch == 0 or dim == 0 or x.shape[0] == 0:
        return x.new_zeros((batch, state_len, dim))
    xk, cu = prepare(x), prepare(cu_seqlens.to(torch.int32))
    states = x.new_empty((batch, state_len, dim))
    kern = kernel_for(OP, "varlen_states", x.device, CausalConv1dVarlenStates.cached(dim, state_len, tvm_dtype(xk)),
                      batch=batch, seqlen=x.shape[0])
    kern(xk, cu, states)
    return states


@causal_conv1d_varlen_states_op.register_fake
def _(x, cu_seqlens, state_len):
    return x.new_empty((cu_seqlens.shape[0] - 1, state_len, x.shape[1]))


# ----------------------------------------------------------------------------------------------------
# Public API (causal-conv1d 1.7.0 names, argument order and semantics)
# ----------------------------------------------------------------------------------------------------
def _activation(activation) -> bool:
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation: must be None, 'silu' or 'swish', got {activation!r}")
    return activation in ("silu", "swish")


def _check_weight_bias(weight, bias, x, dim):
    check_tensor("weight", weight, ndim=2, dtypes=(torch.float32, x.dtype), device=x.device)
    if weight.shape[0] != dim:
        raise ValueError(f"weight: expected (dim={dim}, width), got {tuple(weight.shape)}")
    if not 2 <= weight.shape[1] <= 8:
        raise ValueError(f"weight: width must be in 2..8, got {weight.shape[1]}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(weight.dtype,), device=x.device)
        check_shape("bias", bias, (dim,))


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    """Causal depthwise conv1d.

    x: (batch, dim, seqlen), contiguous or channel-last (x.stride(1) == 1); weight: (dim, width), width 2..8,
    float32 or x's dtype; bias: (dim,) same dtype as weight; seq_idx: (batch, seqlen) int32 (taps never
    cross a change of id; seq_idx < 0 marks padding: its out is 0 and it feeds no other position);
    initial_states: (batch, dim, width-1) in x's dtype; activation: None, "silu" or "swish". A
    channel-last x is read through one contiguous copy. Returns out: (batch, dim, seqlen) in x's dtype
    (contiguous), and final_states
    (batch, dim, width-1) — the last width-1 inputs — when return_final_states (written into
    final_states_out when given).

    out[b, c, t] = act(bias[c] + sum_k weight[c, k] * xx[b, c, t - (width-1) + k]), xx = [initial_states | x].
    Extensions over upstream (which asserts against them): seq_idx may be combined with initial_states
    (they continue the first sequence of each row) and with return_final_states (raw last inputs).
    """
    check_tensor("x", x, ndim=3, dtypes=FLOATS)
    batch, dim, seqlen = x.shape
    silu = _activation(activation)
    _check_weight_bias(weight, bias, x, dim)
    width = weight.shape[1]
    if seq_idx is not None:
        check_tensor("seq_idx", seq_idx, ndim=2, dtypes=(torch.int32,), device=x.device)
        check_shape("seq_idx", seq_idx, (batch, seqlen))
    if initial_states is not None:
        check_tensor("initial_states", initial_states, ndim=3, dtypes=(x.dtype,), device=x.device)
        check_shape("initial_states", initial_states, (batch, dim, width - 1))
    if final_states_out is not None:
        if not return_final_states:
            raise ValueError("final_states_out: given but return_final_states is False")
        check_tensor("final_states_out", final_states_out, ndim=3, dtypes=(x.dtype,), device=x.device)
        check_shape("final_states_out", final_states_out, (batch, dim, width - 1))
    out, final = run_op(causal_conv1d_fwd, x, weight, bias, seq_idx, initial_states, bool(return_final_states), silu)
    if not return_final_states:
        return out
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


def _check_update_args(x3, conv_state, weight, cache_seqlens, conv_state_indices) -> None:
    batch, dim, _ = x3.shape
    check_tensor("conv_state", conv_state, ndim=3, dtypes=FLOATS, device=x3.device)
    check_no_overlap("conv_state", conv_state)
    rows = "pool" if conv_state_indices is not None else f"batch={batch}"
    if (conv_state_indices is None and conv_state.shape[0] != batch) or conv_state.shape[1] != dim or \
            conv_state.shape[2] < weight.shape[1] - 1:
        raise ValueError(f"conv_state: expected ({rows}, dim={dim}, state_len>={weight.shape[1] - 1}), "
                         f"got {tuple(conv_state.shape)}")
    for name, t in (("cache_seqlens", cache_seqlens), ("conv_state_indices", conv_state_indices)):
        if t is not None:
            check_tensor(name, t, ndim=1, dtypes=(torch.int32,), device=x3.device)
            check_shape(name, t, (batch,))


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None):
    """Decode step(s): x: (batch, dim) or (batch, dim, seqlen); conv_state: (batch, dim, state_len),
    state_len >= width-1, updated in place; returns out shaped like x.

    xs = [conv_state | x]; out[t] = act(bias + sum_k weight[k] * xs[state_len + t - (width-1) + k]);
    conv_state <- xs[..., -state_len:].
    cache_seqlens: (batch,) int32 >= 0: conv_state is a circular buffer; the window is the width-1 entries
    before position cache_seqlens % state_len and x is written from there on (wrapping).
    conv_state_indices: (batch,) int32: row b uses slot conv_state_indices[b] of a pool conv_state
    (pool, dim, state_len) (continuous batching); a negative index marks a padding row: its out is 0 and
    no slot is touched. A slot >= pool, a slot named twice or a negative cache_seqlens is a ValueError
    before the kernel runs. A call with the same shapes, strides, dtypes and flags as an earlier one runs
    the launch prepared then (torch_ops/_fastpath.py; on the CPU the kernel checks the index values itself).
    """
    return _UPDATE_FAST.call((x, conv_state, weight, bias, cache_seqlens, conv_state_indices), (activation, False),
                             x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices)


def causal_conv1d_update_into_x(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None):
    """:func:`causal_conv1d_update` with the result written over x and x returned (vLLM's convention): for a
    one-token x (batch, dim), compact and aligned, in eager mode, the kernel writes it in place (nothing
    allocated, nothing copied); otherwise the result is copied there."""
    return _UPDATE_FAST.call((x, conv_state, weight, bias, None, conv_state_indices), (activation, True),
                             x, conv_state, weight, bias, activation, None, conv_state_indices, True)


def _update_values(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices, into_x=False):
    _check_update_values(conv_state, cache_seqlens, conv_state_indices)


def _causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                          conv_state_indices=None, into_x=False):
    """The full path of :func:`causal_conv1d_update` (``into_x``: of :func:`causal_conv1d_update_into_x`):
    checks, kernel key, launch."""
    check_tensor("x", x, dtypes=FLOATS)
    if x.dim() not in (2, 3):
        raise ValueError(f"x: expected (batch, dim) or (batch, dim, seqlen), got shape {tuple(x.shape)}")
    x3 = x.unsqueeze(-1) if x.dim() == 2 else x  # for the checks: the kernel takes a 2-D x as it is
    silu = _activation(activation)
    _check_weight_bias(weight, bias, x, x3.shape[1])
    _check_update_args(x3, conv_state, weight, cache_seqlens, conv_state_indices)
    args = (x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices)
    if not into_x:
        return run_op(causal_conv1d_update_op, *args)
    if x.dim() == 2 and kernel_may_write(x, args[1:]):
        _check_update_values(conv_state, cache_seqlens, conv_state_indices)
        launch_update(*args, None)
    else:
        x.copy_(run_op(causal_conv1d_update_op, *args))
    return x


def causal_conv1d_varlen_states(x, cu_seqlens, state_len):
    """x: (total_tokens, dim) packed sequences; cu_seqlens: (batch + 1,) int32 or int64, cumulative lengths
    (0, ..., <= total_tokens, non-decreasing: tokens after cu_seqlens[-1] are padding, in no sequence, as
    upstream allows); state_len: int >= 1 -> states: (batch, dim, state_len) in x's
    dtype (a transposed view with dim innermost, as upstream returns it).

    states[b] = the last state_len tokens of sequence b, right-aligned, zeros on the left where it is
    shorter: the conv_state to continue decoding each sequence with causal_conv1d_update. Forward only.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOATS)
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32, torch.int64), device=x.device)
    if cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens: expected (batch + 1,) cumulative lengths starting at 0, got an empty tensor")
    if isinstance(state_len, bool) or not isinstance(state_len, int):
        raise TypeError(f"state_len: expected an int, got {type(state_len).__name__}")
    if state_len < 1:
        raise ValueError(f"state_len: must be >= 1, got {state_len}")
    check_size("states", (cu_seqlens.numel() - 1) * state_len * x.shape[1])
    return run_op(causal_conv1d_varlen_states_op, x, cu_seqlens, state_len).transpose(1, 2)


_UPDATE_FAST = FastPath(_causal_conv1d_update, _update_values, copies=True, host_checks=True)
