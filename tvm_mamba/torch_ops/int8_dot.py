"""The int8 packed dot family on TVM kernels: quantize, i8x4 pack/unpack, exact int8 matmul, and the
straight-through low-rank projection / decoder tail of the seed's low-bit training path.

Ops (namespace ``tvm_mamba``): ``int8_matmul``, ``int8_pack``, ``int8_unpack`` (kernels), and
``int8_lowrank_projection_fwd`` / ``int8_decoder_tail_fwd`` (forward = int8 matmul kernel + scale; autograd
registered: straight-through gradients to the float master tensors, computed in float32 by the
``int8_dgrad`` (float x codes) and ``int8_wgrad`` (codes^T x float, two-stage sum over rows) kernels;
torch only permutes/reshapes and applies the ReLU mask).

Saved for backward: the activation codes (int8; with ``offload_codes`` packed i8x4 into int32 words and,
for CUDA tensors, copied to pinned host memory, restored in the backward), the weight codes, the two
scales and, when thresholded, the output (its sign is the ReLU mask: relu(pre - thr) > 0 <=> pre > thr).
"""
from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import Tensor

from ..compute.int8_dot import Int8DotDgrad, Int8DotMatmul, Int8DotPacking, Int8DotWgrad, wgrad_parts
from ._dlpack import check_size, FLOATS, check_tensor, kernel_for, prepare, run_op

OP = "int8_dot"
_INT8 = (torch.int8,)


# --- kernels -----------------------------------------------------------------------------------------
@torch.library.custom_op("tvm_mamba::int8_matmul", mutates_args=())
def int8_matmul_op(a: Tensor, b: Tensor) -> Tensor:
    """a: (M, K) int8, b: (N, K) int8 -> (M, N) int32, exact."""
    M, K = a.shape
    N = b.shape[0]
    c = torch.empty((M, N), device=a.device, dtype=torch.int32)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    kern = kernel_for(OP, "matmul", a.device, Int8DotMatmul.cached(N, K), M=M)
    kern(prepare(a), prepare(b), c)
    return c


@int8_matmul_op.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.int32)


@torch.library.custom_op("tvm_mamba::int8_pack", mutates_args=())
def int8_pack_op(codes: Tensor) -> Tensor:
    """codes: (rows, K) int8 -> (rows, ceil(K/4)) int32."""
    rows, K = codes.shape
    out = torch.empty((rows, (K + 3) // 4), device=codes.device, dtype=torch.int32)
    if rows and K:
        kernel_for(OP, "pack", codes.device, Int8DotPacking.cached(K), rows=rows)(prepare(codes), out)
    return out


@int8_pack_op.register_fake
def _(codes):
    return codes.new_empty((codes.shape[0], (codes.shape[1] + 3) // 4), dtype=torch.int32)


@torch.library.custom_op("tvm_mamba::int8_unpack", mutates_args=())
def int8_unpack_op(packed: Tensor, K: int) -> Tensor:
    """packed: (rows, ceil(K/4)) int32 -> (rows, K) int8."""
    rows = packed.shape[0]
    out = torch.empty((rows, K), device=packed.device, dtype=torch.int8)
    if rows and K:
        kernel_for(OP, "unpack", packed.device, Int8DotPacking.cached(K), rows=rows)(prepare(packed), out)
    return out


@int8_unpack_op.register_fake
def _(packed, K):
    return packed.new_empty((packed.shape[0], K), dtype=torch.int8)


@torch.library.custom_op("tvm_mamba::int8_dgrad", mutates_args=())
def int8_dgrad_op(g: Tensor, codes: Tensor, scale: Tensor) -> Tensor:
    """g: (heads, M, K) float32, codes: (heads, K, N) int8, scale: 0-dim float32 -> (heads, M, N) float32:
    out[h, m, n] = scale * sum_k g[h, m, k] * codes[h, k, n] (straight-through input gradient)."""
    H, M, K = g.shape
    N = codes.shape[2]
    out = torch.empty((H, M, N), device=g.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    if K == 0:
        return out.zero_()
    kern = kernel_for(OP, "dgrad", g.device, Int8DotDgrad.cached(H, N, K), M=M)
    kern(prepare(g), prepare(codes), prepare(scale.reshape(1)), out)
    return out


@int8_dgrad_op.register_fake
def _(g, codes, scale):
    return g.new_empty((g.shape[0], g.shape[1], codes.shape[2]))


@torch.library.custom_op("tvm_mamba::int8_wgrad", mutates_args=())
def int8_wgrad_op(codes: Tensor, g: Tensor, scale: Tensor) -> Tensor:
    """codes: (1 or heads, M, N) int8, g: (heads, M, K) float32, scale: 0-dim float32 -> (heads, N, K) float32:
    out[h, n, k] = scale * sum_m codes[h|0, m, n] * g[h, m, k] (straight-through weight gradient)."""
    CH, M, N = codes.shape
    H, _, K = g.shape
    out = torch.empty((H, N, K), device=g.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    if M == 0:
        return out.zero_()
    nparts = wgrad_parts(M, H, K)
    partial = torch.empty((nparts, H, N, K), device=g.device, dtype=torch.float32)
    kern = kernel_for(OP, "wgrad", g.device, Int8DotWgrad.cached(H, CH, N, K), M=M)
    kern(prepare(codes), prepare(g), prepare(scale.reshape(1)), out, partial)
    return out


@int8_wgrad_op.register_fake
def _(codes, g, scale):
    return g.new_empty((g.shape[0], codes.shape[2], g.shape[2]))


# --- public helpers ------------------------------------------------------------------------------------
def quantize_int8(x, scale=None):
    """x: any shape float -> (codes int8 like x, scale float). scale = absmax(x)/127 when None (1.0 for an
    all-zero x); codes = clamp(round(x / scale), -127, 127), round half to even. scale=None syncs the host."""
    check_tensor("x", x, dtypes=FLOATS + (torch.float64,))
    if x.numel() and not bool(torch.isfinite(x.detach()).all()):
        raise ValueError("x: contains NaN or Inf; int8 codes cannot represent it")
    if scale is None:
        amax = float(x.detach().abs().max()) if x.numel() else 0.0
        scale = amax / 127.0 if amax > 0 else 1.0
    _check_scale("scale", scale)
    s = float(scale) if not isinstance(scale, Tensor) else scale.to(torch.float32)
    codes = torch.clamp(torch.round(x.detach().to(torch.float32) / s), -127, 127).to(torch.int8)
    return codes, scale


def pack_int8x4(codes):
    """codes: (..., K) int8 -> (..., ceil(K/4)) int32; byte i (bits 8i..8i+7) of word j holds codes[..., 4j+i],
    zero padded past K."""
    check_tensor("codes", codes, dtypes=_INT8)
    if codes.dim() < 1:
        raise ValueError("codes: expected at least 1 dim (..., K)")
    K = codes.shape[-1]
    if K == 0 or codes.numel() == 0:
        return torch.zeros((*codes.shape[:-1], (K + 3) // 4), dtype=torch.int32, device=codes.device)
    out = run_op(int8_pack_op, codes.reshape(-1, K))
    return out.reshape(*codes.shape[:-1], (K + 3) // 4)


def unpack_int8x4(packed, K):
    """packed: (..., ceil(K/4)) int32 -> codes: (..., K) int8, the exact inverse of :func:`pack_int8x4`."""
    check_tensor("packed", packed, dtypes=(torch.int32,))
    if isinstance(K, bool) or not isinstance(K, numbers.Integral) or K < 0:
        raise ValueError(f"K: expected a non-negative int, got {K!r}")
    if packed.dim() < 1 or packed.shape[-1] != (K + 3) // 4:
        raise ValueError(f"packed: last dim must be ceil(K/4) = {(K + 3) // 4}, got shape {tuple(packed.shape)}")
    if K == 0 or packed.numel() == 0:
        return torch.zeros((*packed.shape[:-1], K), dtype=torch.int8, device=packed.device)
    out = run_op(int8_unpack_op, packed.reshape(-1, packed.shape[-1]), int(K))
    return out.reshape(*packed.shape[:-1], K)


def int8_matmul(a, b):
    """a: (M, K) int8, b: (N, K) int8 -> (M, N) int32: c[m, n] = sum_k a[m, k] * b[n, k], exact int32
    accumulation (CPU: AVX-512 VNNI; CUDA: dp4a)."""
    check_tensor("a", a, ndim=2, dtypes=_INT8)
    check_tensor("b", b, ndim=2, dtypes=_INT8, device=a.device)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"b: K mismatch, a is {tuple(a.shape)} (M, K) and b is {tuple(b.shape)} (N, K)")
    check_size("out", a.shape[0] * b.shape[0])
    return run_op(int8_matmul_op, a, b)


# --- straight-through projection / decoder tail --------------------------------------------------------
def _check_scale(name, s):
    if isinstance(s, Tensor):
        if s.dim() != 0 or not s.is_floating_point():
            raise TypeError(f"{name}: expected a float or a 0-dim floating tensor, got {s.dtype} {tuple(s.shape)}")
        if s.device.type == "cpu" and not float(s) > 0:  # device tensors are not checked (no host sync)
            raise ValueError(f"{name}: must be positive, got {float(s)}")
    elif isinstance(s, bool) or not isinstance(s, numbers.Real):
        raise TypeError(f"{name}: expected a float or a 0-dim tensor, got {type(s).__name__}")
    elif not (s > 0 and s != float("inf")):
        raise ValueError(f"{name}: must be positive and finite, got {s}")


def _scale_tensor(s, device) -> Tensor:
    return s.detach().to(device=device, dtype=torch.float32) if isinstance(s, Tensor) else \
        torch.tensor(float(s), dtype=torch.float32, device=device)


def _save_codes(codes: Tensor, offload: bool):
    if not offload:
        return codes, None
    packed = pack_int8x4(codes)
    if packed.device.type == "cuda":
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        packed = host
    return packed, codes.shape[-1]


def _load_codes(saved: Tensor, K, device) -> Tensor:
    if K is None:
        return saved
    return unpack_int8x4(saved.to(device, non_blocking=True), K)


@torch.library.custom_op("tvm_mamba::int8_lowrank_projection_fwd", mutates_args=())
def int8_lowrank_projection_fwd(input: Tensor, weight: Tensor, input_codes: Tensor, weight_codes: Tensor,
                                activation_scale: Tensor, weight_scale: Tensor, latent_out: int,
                                relu_threshold: Optional[float], offload_codes: bool) -> Tensor:
    """input_codes: (batch, 1|H, T, E), weight_codes: (H, E, Lc) -> out: (batch, H, T, latent_out) in input's dtype."""
    batch, hin, T, E = input_codes.shape
    H = weight_codes.shape[0]
    lo = latent_out
    if hin == 1:  # one matmul against every head's weight columns at once
        b = weight_codes[:, :, :lo].permute(0, 2, 1).reshape(H * lo, E)
        acc = int8_matmul_op(input_codes.reshape(batch * T, E), b.contiguous())
        acc = acc.reshape(batch, T, H, lo).permute(0, 2, 1, 3)
    else:
        acc = torch.stack([int8_matmul_op(input_codes[:, h].reshape(batch * T, E),
                                          weight_codes[h, :, :lo].T.contiguous()).reshape(batch, T, lo)
                           for h in range(H)], dim=1)
    s = _scale_tensor(activation_scale, input.device) * _scale_tensor(weight_scale, input.device)
    out = acc.to(torch.float32) * s
    if relu_threshold is not None:
        out = torch.relu(out - relu_threshold)
    return out.to(input.dtype).contiguous()


@int8_lowrank_projection_fwd.register_fake
def _(input, weight, input_codes, weight_codes, activation_scale, weight_scale, latent_out, relu_threshold,
      offload_codes):
    batch, _, T, _ = input_codes.shape
    return input.new_empty((batch, weight_codes.shape[0], T, latent_out))


def _proj_setup(ctx, inputs, output):
    input, weight, input_codes, weight_codes, sa, sw, lo, thr, offload = inputs
    saved, ctx.K = _save_codes(input_codes, offload)
    ctx.save_for_backward(saved, weight_codes, sa, sw, output if thr is not None else None)
    ctx.meta = (input.dtype, weight.dtype, input_codes.shape, lo, thr is not None)


def _proj_backward(ctx, grad_out):
    saved, weight_codes, sa, sw, out = ctx.saved_tensors
    in_dtype, w_dtype, in_shape, lo, thresholded = ctx.meta
    dev = grad_out.device
    codes = _load_codes(saved, ctx.K, dev).reshape(in_shape)
    g = grad_out.to(torch.float32)
    if thresholded:
        g = g * (out > 0)
    batch, H, T, _ = g.shape
    hin, E = in_shape[1], in_shape[3]
    wl = weight_codes[:, :, :lo]  # (H, E, lo)
    gh = g.permute(1, 0, 2, 3).reshape(H, batch * T, lo)  # per head, rows (b, t)
    if hin == 1:  # summed over heads: one reduction over k = (h, l)
        gf = g.permute(0, 2, 1, 3).reshape(1, batch * T, H * lo)
        gi = int8_dgrad_op(gf, wl.permute(0, 2, 1).reshape(1, H * lo, E), sw).reshape(batch, 1, T, E)
    else:
        gi = int8_dgrad_op(gh, wl.transpose(1, 2), sw).reshape(H, batch, T, E).permute(1, 0, 2, 3)
    gwl = int8_wgrad_op(codes.permute(1, 0, 2, 3).reshape(hin, batch * T, E), gh, sa)  # (H, E, lo)
    if lo == weight_codes.shape[2]:
        gw = gwl
    else:
        gw = torch.zeros(weight_codes.shape, dtype=torch.float32, device=dev)
        gw[:, :, :lo] = gwl
    return gi.to(in_dtype).contiguous(), gw.to(w_dtype), None, None, None, None, None, None, None


int8_lowrank_projection_fwd.register_autograd(_proj_backward, setup_context=_proj_setup)


def _check_codes(name, codes, float_name, ref, ndim):
    check_tensor(name, codes, ndim=ndim, dtypes=_INT8, device=ref.device)
    if tuple(codes.shape) != tuple(ref.shape):
        raise ValueError(f"{name}: shape {tuple(codes.shape)} does not match {float_name} {tuple(ref.shape)}")


def int8_lowrank_projection(input, weight, input_codes, weight_codes, activation_scale, weight_scale,
                            latent_out=None, relu_threshold=None, offload_codes=False):
    """Low-rank int8 projection with straight-through gradients to the float master tensors.

    input: (batch, 1 or H, T, E) float; weight: (H, E, Lc) float; input_codes / weight_codes: int8 of the
    same shapes; scales: positive floats or 0-dim tensors; latent_out <= Lc (default Lc).
    out[b,h,t,l] = activation_scale*weight_scale*sum_e input_codes[b,h|0,t,e]*weight_codes[h,e,l] (int32
    accumulation), l < latent_out; then relu(out - relu_threshold) when a threshold is given.
    Returns (batch, H, T, latent_out) in input's dtype.
    """
    check_tensor("input", input, ndim=4, dtypes=FLOATS)
    check_tensor("weight", weight, ndim=3, dtypes=FLOATS, device=input.device)
    _check_codes("input_codes", input_codes, "input", input, 4)
    _check_codes("weight_codes", weight_codes, "weight", weight, 3)
    H, E, Lc = weight.shape
    if input.shape[1] not in (1, H):
        raise ValueError(f"input: input_heads must be 1 or H={H}, got {input.shape[1]}")
    if input.shape[3] != E:
        raise ValueError(f"input: last dim must be E={E} (weight is (H, E, Lc)), got {input.shape[3]}")
    _check_scale("activation_scale", activation_scale)
    _check_scale("weight_scale", weight_scale)
    lo = Lc if latent_out is None else latent_out
    if isinstance(lo, bool) or not isinstance(lo, numbers.Integral) or not 1 <= lo <= Lc:
        raise ValueError(f"latent_out: must be an int in 1..Lc={Lc}, got {latent_out!r}")
    if relu_threshold is not None and (isinstance(relu_threshold, bool)
                                       or not isinstance(relu_threshold, numbers.Real)):
        raise TypeError(f"relu_threshold: expected a float or None, got {type(relu_threshold).__name__}")
    sa, sw = _scale_tensor(activation_scale, input.device), _scale_tensor(weight_scale, input.device)
    return run_op(
        int8_lowrank_projection_fwd, input, weight, input_codes, weight_codes, sa, sw, int(lo),
        None if relu_threshold is None else float(relu_threshold), bool(offload_codes))


@torch.library.custom_op("tvm_mamba::int8_decoder_tail_fwd", mutates_args=())
def int8_decoder_tail_fwd(y: Tensor, decoder: Tensor, y_codes: Tensor, decoder_codes: Tensor,
                          activation_scale: Tensor, weight_scale: Tensor, offload_codes: bool) -> Tensor:
    """y_codes: (batch, H, T, L), decoder_codes: (H*L, D) -> out: (batch, 1, T, D) in y's dtype."""
    batch, H, T, L = y_codes.shape
    D = decoder_codes.shape[1]
    a = y_codes.permute(0, 2, 1, 3).reshape(batch * T, H * L)
    acc = int8_matmul_op(a.contiguous(), decoder_codes.T.contiguous())
    s = _scale_tensor(activation_scale, y.device) * _scale_tensor(weight_scale, y.device)
    return (acc.to(torch.float32) * s).reshape(batch, 1, T, D).to(y.dtype)


@int8_decoder_tail_fwd.register_fake
def _(y, decoder, y_codes, decoder_codes, activation_scale, weight_scale, offload_codes):
    return y.new_empty((y.shape[0], 1, y.shape[2], decoder.shape[1]))


def _tail_setup(ctx, inputs, output):
    y, decoder, y_codes, decoder_codes, sa, sw, offload = inputs
    saved, ctx.K = _save_codes(y_codes, offload)
    ctx.save_for_backward(saved, decoder_codes, sa, sw)
    ctx.meta = (y.dtype, decoder.dtype, y_codes.shape)


def _tail_backward(ctx, grad_out):
    saved, decoder_codes, sa, sw = ctx.saved_tensors
    y_dtype, d_dtype, (batch, H, T, L) = ctx.meta
    dev = grad_out.device
    codes = _load_codes(saved, ctx.K, dev).reshape(batch, H, T, L)
    g = grad_out.to(torch.float32)[:, 0].reshape(1, batch * T, -1)  # (1, batch*T, D)
    gy = int8_dgrad_op(g, decoder_codes.T.unsqueeze(0), sw)  # (1, batch*T, H*L)
    gy = gy.reshape(batch, T, H, L).permute(0, 2, 1, 3)
    flat = codes.permute(0, 2, 1, 3).reshape(1, batch * T, H * L)
    gd = int8_wgrad_op(flat, g, sa)[0]  # (H*L, D)
    return gy.to(y_dtype).contiguous(), gd.to(d_dtype), None, None, None, None, None


int8_decoder_tail_fwd.register_autograd(_tail_backward, setup_context=_tail_setup)


def int8_decoder_tail(y, decoder, y_codes, decoder_codes, activation_scale, weight_scale, offload_codes=False):
    """Int8 decoder tail with straight-through gradients.

    y: (batch, H, T, L) float; decoder: (H*L, D) float; y_codes / decoder_codes: int8 of the same shapes.
    out[b,0,t,d] = activation_scale*weight_scale*sum_{h,l} y_codes[b,h,t,l]*decoder_codes[h*L+l, d];
    returns (batch, 1, T, D) in y's dtype. grad_y = weight_scale*sum_d g*decoder_codes;
    grad_decoder = activation_scale*sum_{b,t} y_codes*g.
    """
    check_tensor("y", y, ndim=4, dtypes=FLOATS)
    check_tensor("decoder", decoder, ndim=2, dtypes=FLOATS, device=y.device)
    _check_codes("y_codes", y_codes, "y", y, 4)
    _check_codes("decoder_codes", decoder_codes, "decoder", decoder, 2)
    batch, H, T, L = y.shape
    if decoder.shape[0] != H * L:
        raise ValueError(f"decoder: first dim must be H*L = {H * L}, got {tuple(decoder.shape)}")
    _check_scale("activation_scale", activation_scale)
    _check_scale("weight_scale", weight_scale)
    sa, sw = _scale_tensor(activation_scale, y.device), _scale_tensor(weight_scale, y.device)
    return run_op(int8_decoder_tail_fwd, y, decoder, y_codes, decoder_codes, sa, sw, bool(offload_codes))
