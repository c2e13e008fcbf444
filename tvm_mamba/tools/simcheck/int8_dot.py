"""sim-check of the int8 dot family on the CUDA execution harness, through the public functions of
torch_ops/int8_dot.py:

- ``matmul`` (N, K): ``int8_matmul`` (exact int32, compared bit for bit with the int64 reference);
- ``pack`` / ``unpack`` (K): ``pack_int8x4`` / ``unpack_int8x4`` (bit for bit);
- ``dgrad`` (heads, N, K) and ``wgrad`` (heads, code_heads, N, K): the straight-through backward of
  ``int8_lowrank_projection`` (heads > 1, or heads = 1 for dgrad: E = N, latent = K) or of
  ``int8_decoder_tail`` (wgrad with heads = 1: H*L = N, D = K), forward and both gradients against the
  float64 formulas.

Rows (M = batch x T) are small and not multiples of any tile; codes include -128 (the extreme product).
"""
from __future__ import annotations

import torch

from . import CheckFailed, compare, ran, recording, tolerance, generator, size, target

OP = "int8_dot"


def codes(*shape, seed: int = 0) -> torch.Tensor:
    """Random int8 codes over the full range [-128, 127]."""
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=generator(seed))


def _exact(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype != want.dtype and not (got.dtype == torch.int32 and want.dtype == torch.int64):
        raise CheckFailed(f"{name}: dtype {got.dtype}, reference {want.dtype}")
    compare(name, got, want, 0.0, 0.0)


def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 results of sums of many int8 x float products: atol relative to the reference's magnitude."""
    rtol, atol = tolerance(got.dtype)
    compare(name, got, want, rtol, atol * max(1.0, want.abs().max().item()))


def _check_matmul(static: dict, arch: str) -> None:
    from ...reference.int8_dot import int8_matmul_ref
    from ...torch_ops.int8_dot import int8_matmul

    N, K = static["N"], static["K"]
    a, b = codes(size("rows", 3), K, seed=1), codes(N, K, seed=2)
    a[0] = -128  # row 0 x column 0: every product at its extreme, |sum| = K * 2^14
    b[0] = -128
    with recording() as keys, target(arch):
        c = int8_matmul(a, b)
    ran(keys, OP, "matmul", static, {})
    _exact(f"{OP}.matmul {arch}: c", c, int8_matmul_ref(a, b))


def _check_pack(direction: str, static: dict, arch: str) -> None:
    from ...reference.int8_dot import pack_int8x4_ref, unpack_int8x4_ref
    from ...torch_ops.int8_dot import pack_int8x4, unpack_int8x4

    K = static["K"]
    x = codes(size("rows", 3), K, seed=3)
    packed = pack_int8x4_ref(x)
    with recording() as keys, target(arch):
        got = pack_int8x4(x) if direction == "pack" else unpack_int8x4(packed, K)
    ran(keys, OP, direction, static, {})
    want = packed if direction == "pack" else unpack_int8x4_ref(packed, K)
    _exact(f"{OP}.{direction} {arch}", got, want)


def projection_results(hin: int, H: int, E: int, Lc: int, arch: str, batch: int = 1, T: int = 3,
                       latent_out=None, relu_threshold=None, offload_codes: bool = False, **sim):
    """{name: (simulated, float64 reference)} for int8_lowrank_projection's out, grad input and grad weight
    (input (batch, hin, T, E), weight (H, E, Lc)), and the kernel keys it ran."""
    from ...reference.int8_dot import int8_lowrank_projection_grads_ref, int8_lowrank_projection_ref
    from ...torch_ops.int8_dot import int8_lowrank_projection, quantize_int8

    g = generator(7)
    x = torch.randn(batch, hin, T, E, generator=g).requires_grad_()
    w = torch.randn(H, E, Lc, generator=g).requires_grad_()
    xc, sa = quantize_int8(x)
    wc, sw = quantize_int8(w)
    with recording() as keys, target(arch, **sim):
        out = int8_lowrank_projection(x, w, xc, wc, sa, sw, latent_out=latent_out, relu_threshold=relu_threshold,
                                      offload_codes=offload_codes)
        grad = torch.randn(out.shape, generator=g)
        out.backward(grad)
    ref, pre = int8_lowrank_projection_ref(xc, wc, sa, sw, latent_out, relu_threshold)
    gi, gw = int8_lowrank_projection_grads_ref(grad, pre, xc, wc, sa, sw, relu_threshold)
    return {"out": (out, ref), "grad_input": (x.grad, gi), "grad_weight": (w.grad, gw)}, keys


def decoder_tail_results(H: int, L: int, D: int, arch: str, batch: int = 1, T: int = 3,
                         offload_codes: bool = False, **sim):
    """{name: (simulated, float64 reference)} for int8_decoder_tail's out, grad y and grad decoder
    (y (batch, H, T, L), decoder (H*L, D)), and the kernel keys it ran."""
    from ...reference.int8_dot import int8_decoder_tail_grads_ref, int8_decoder_tail_ref
    from ...torch_ops.int8_dot import int8_decoder_tail, quantize_int8

    g = generator(9)
    y = torch.randn(batch, H, T, L, generator=g).requires_grad_()
    dec = torch.randn(H * L, D, generator=g).requires_grad_()
    yc, sa = quantize_int8(y)
    dc, sw = quantize_int8(dec)
    with recording() as keys, target(arch, **sim):
        out = int8_decoder_tail(y, dec, yc, dc, sa, sw, offload_codes=offload_codes)
        grad = torch.randn(out.shape, generator=g)
        out.backward(grad)
    gy, gd = int8_decoder_tail_grads_ref(grad, yc, dc, sa, sw)
    return {"out": (out, int8_decoder_tail_ref(yc, dc, sa, sw)), "grad_y": (y.grad, gy),
            "grad_decoder": (dec.grad, gd)}, keys


def _check_backward(direction: str, static: dict, arch: str) -> None:
    heads, N, K = static["heads"], static["N"], static["K"]
    if direction == "dgrad":  # hin = heads: per-head dgrad; hin = 1 (H = 1): the heads-summed form
        res, keys = projection_results(hin=heads, H=heads, E=N, Lc=K, arch=arch, T=size("rows", 3))
    elif heads == 1:  # the decoder tail's weight gradient: codes (1, rows, H*L), g (1, rows, D)
        if static["code_heads"] != 1:
            raise CheckFailed(f"{OP}: wgrad with heads=1 needs code_heads=1, got {static['code_heads']}")
        res, keys = decoder_tail_results(H=1, L=N, D=K, arch=arch, T=size("rows", 3))
    else:  # code_heads 1: input shared by every head (input_heads = 1); else one input per head
        res, keys = projection_results(hin=static["code_heads"], H=heads, E=N, Lc=K, arch=arch, T=size("rows", 3))
    ran(keys, OP, direction, static, {})
    for name, (got, want) in res.items():
        _close(f"{OP}.{direction} {arch}: {name}", got, want)


def check(direction: str, static: dict, dtypes: dict, arch: str) -> None:
    """Run one build-check configuration of the int8 dot family in the harness (module docstring)."""
    if direction == "matmul":
        _check_matmul(static, arch)
    elif direction in ("pack", "unpack"):
        _check_pack(direction, static, arch)
    elif direction in ("dgrad", "wgrad"):
        _check_backward(direction, static, arch)
    else:
        raise CheckFailed(f"{OP}: unknown direction {direction!r}")
