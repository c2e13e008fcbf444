"""Int8 packed dot family written from the math in plain PyTorch (int64 / float64; no TVM).

The references of the tests: exact integer matmul in int64, the packing layout, and the straight-through
projection / decoder-tail forward and gradient formulas.
"""
from __future__ import annotations

import torch


def quantize_int8_ref(x, scale=None):
    """x: any shape float -> (codes int8 same shape, scale: float). scale = absmax(x)/127 when None;
    codes = clamp(round(x / scale), -127, 127) (round half to even, as torch.round)."""
    if scale is None:
        scale = float(x.detach().abs().max().double().item()) / 127.0
        scale = scale if scale > 0 else 1.0
    codes = torch.clamp(torch.round(x.double() / float(scale)), -127, 127).to(torch.int8)
    return codes, scale


def pack_int8x4_ref(codes):
    """codes: (..., K) int8 -> (..., ceil(K/4)) int32; byte i (bits 8i..8i+7) of word j = codes[..., 4j+i]."""
    K = codes.shape[-1]
    W = (K + 3) // 4
    u = codes.to(torch.int64) & 0xFF
    pad = torch.zeros(*codes.shape[:-1], 4 * W - K, dtype=torch.int64, device=codes.device)
    u = torch.cat([u, pad], dim=-1).reshape(*codes.shape[:-1], W, 4)
    word = u[..., 0] | (u[..., 1] << 8) | (u[..., 2] << 16) | (u[..., 3] << 24)
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32)


def unpack_int8x4_ref(packed, K):
    """packed: (..., W) int32 -> (..., K) int8, the inverse of :func:`pack_int8x4_ref`."""
    w = packed.to(torch.int64) & 0xFFFFFFFF
    lanes = torch.stack([(w >> (8 * i)) & 0xFF for i in range(4)], dim=-1)
    lanes = torch.where(lanes >= 128, lanes - 256, lanes).reshape(*packed.shape[:-1], -1)
    return lanes[..., :K].to(torch.int8)


def int8_matmul_ref(a, b):
    """a: (M, K) int8, b: (N, K) int8 -> (M, N) int64: c[m, n] = sum_k a[m, k] * b[n, k] (exact)."""
    return a.to(torch.int64) @ b.to(torch.int64).T


def int8_lowrank_projection_ref(input_codes, weight_codes, activation_scale, weight_scale, latent_out=None,
                                relu_threshold=None):
    """input_codes: (batch, 1 or H, T, E) int8; weight_codes: (H, E, Lc) int8 -> (out, pre) float64
    (batch, H, T, latent_out): pre = sa*sw*sum_e in[b,h|0,t,e]*w[h,e,l]; out = relu(pre - thr) or pre."""
    H, E, Lc = weight_codes.shape
    lo = Lc if latent_out is None else latent_out
    acc = torch.einsum("bhte,hel->bhtl", input_codes.to(torch.int64).expand(-1, H, -1, -1).double(),
                       weight_codes[..., :lo].double())
    pre = float(activation_scale) * float(weight_scale) * acc
    out = pre if relu_threshold is None else torch.relu(pre - float(relu_threshold))
    return out, pre


def int8_lowrank_projection_grads_ref(grad_out, pre, input_codes, weight_codes, activation_scale, weight_scale,
                                      relu_threshold=None):
    """Straight-through gradients (float64): g = grad_out * (pre - thr > 0 if thresholded);
    grad_input[b,h',t,e] = sw * sum_{(h),l} g*w[h,e,l]; grad_weight[h,e,l] = sa * sum_{b,t} in*g (0 for l >= lo)."""
    g = grad_out.double()
    if relu_threshold is not None:
        g = g * ((pre - float(relu_threshold)) > 0).double()
    H, E, Lc = weight_codes.shape
    lo = g.shape[-1]
    gi = float(weight_scale) * torch.einsum("bhtl,hel->bhte", g, weight_codes[..., :lo].double())
    if input_codes.shape[1] == 1:
        gi = gi.sum(dim=1, keepdim=True)
    gw = torch.zeros(H, E, Lc, dtype=torch.float64, device=g.device)
    gw[..., :lo] = float(activation_scale) * torch.einsum(
        "bhte,bhtl->hel", input_codes.double().expand(-1, H, -1, -1), g)
    return gi, gw


def int8_decoder_tail_ref(y_codes, decoder_codes, activation_scale, weight_scale):
    """y_codes: (batch, H, T, L) int8; decoder_codes: (H*L, D) int8 -> (batch, 1, T, D) float64:
    out[b,0,t,d] = sa*sw*sum_{h,l} y[b,h,t,l]*dec[h*L+l, d]."""
    batch, H, T, L = y_codes.shape
    flat = y_codes.permute(0, 2, 1, 3).reshape(batch, T, H * L).double()
    return (float(activation_scale) * float(weight_scale) * (flat @ decoder_codes.double())).unsqueeze(1)


def int8_decoder_tail_grads_ref(grad_out, y_codes, decoder_codes, activation_scale, weight_scale):
    """grad_y[b,h,t,l] = sw * sum_d g[b,0,t,d]*dec[h*L+l, d]; grad_decoder[h*L+l, d] = sa * sum_{b,t} y*g."""
    batch, H, T, L = y_codes.shape
    g = grad_out.double()[:, 0]  # (batch, T, D)
    gy = float(weight_scale) * (g @ decoder_codes.double().T)  # (batch, T, H*L)
    gy = gy.reshape(batch, T, H, L).permute(0, 2, 1, 3)
    flat = y_codes.permute(0, 2, 1, 3).reshape(batch * T, H * L).double()
    gd = float(activation_scale) * (flat.T @ g.reshape(batch * T, -1))
    return gy, gd
