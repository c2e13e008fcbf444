"""overhead: what a decode-step op costs above its kernel, called one at a time as a server calls it.

Each row times the public function (tvm ms) against its own kernel launched alone on the same tensors (ref
ms: the launch captured with ``capture_launches`` and run again, tensors converted by tvm_ffi per call as
in any call); the note gives the difference in microseconds and the op's full path (every check, the key,
the cache lookup), which the first call of a signature takes. Decode shapes of the 130M models, batch 1
and 8 (the batch-8 rows from a slot pool with state indices, as continuous batching calls them).
"""
from __future__ import annotations

import torch
from benchlib import Row, median_ms

import tvm_mamba
from tvm_mamba.torch_ops import causal_conv1d as conv_ops
from tvm_mamba.torch_ops import selective_scan as scan_ops
from tvm_mamba.torch_ops._dlpack import capture_launches

TIMING = dict(warmup=50, iters=300, min_time_s=0.3)


def _kernel_alone(call):
    with capture_launches() as launches:
        call()
    (launch,) = launches
    return lambda: launch.kernel(*launch.args)


def _row(op: str, shape: str, call, full) -> Row:
    call()  # build / load, and the signature's prepared launch
    tvm = median_ms(call, **TIMING)
    alone = median_ms(_kernel_alone(call), **TIMING)
    full_ms = median_ms(full, **TIMING)
    note = f"overhead {1e3 * (tvm - alone):.1f} us; full path {1e3 * full_ms:.1f} us"
    return Row(op, "call vs its kernel alone", shape, tvm, alone, None, "kernel launch alone", note, tvm - alone)


def _ssu_case(batch: int, pool: int, H: int, P: int, N: int, g):
    """Mamba2.step's call: tied per-head dt / A / D / dt_bias as expanded views, no z."""
    state = torch.randn(pool, H, P, N, generator=g)
    x, B, C = torch.randn(batch, H, P, generator=g), torch.randn(batch, 1, N, generator=g), \
        torch.randn(batch, 1, N, generator=g)
    dt = torch.rand(batch, H, generator=g)[:, :, None].expand(-1, -1, P)
    A = (-torch.rand(H, generator=g))[:, None, None].expand(-1, P, N)
    D, dt_bias = torch.randn(H, generator=g)[:, None].expand(-1, P), torch.randn(H, generator=g)[:, None].expand(-1, P)
    idx = torch.randperm(pool, generator=g)[:batch].to(torch.int32) if pool != batch else None
    args = (state, x, dt, A, B, C, D, None, dt_bias, True, idx)
    return (lambda: tvm_mamba.selective_state_update(*args[:9], dt_softplus=True, state_batch_indices=idx),
            lambda: scan_ops._selective_state_update(*args))


def _mamba1_case(batch: int, dim: int, N: int, g):
    state, x, z = torch.randn(batch, dim, N, generator=g), torch.randn(batch, dim, generator=g), \
        torch.randn(batch, dim, generator=g)
    dt, A = torch.rand(batch, dim, generator=g), -torch.rand(dim, N, generator=g)
    B, C, D, dt_bias = torch.randn(batch, N, generator=g), torch.randn(batch, N, generator=g), \
        torch.randn(dim, generator=g), torch.randn(dim, generator=g)
    args = (state, x, dt, A, B, C, D, z, dt_bias, True, None)
    return (lambda: tvm_mamba.selective_state_update(*args[:9], dt_softplus=True),
            lambda: scan_ops._selective_state_update(*args))


def _conv_case(batch: int, pool: int, dim: int, g):
    x, state = torch.randn(batch, dim, generator=g), torch.randn(pool, dim, 3, generator=g)
    w, b = torch.randn(dim, 4, generator=g), torch.randn(dim, generator=g)
    idx = torch.randperm(pool, generator=g)[:batch].to(torch.int32) if pool != batch else None
    args = (x, state, w, b, "silu", None, idx)
    return (lambda: tvm_mamba.causal_conv1d_update(*args),
            lambda: conv_ops._causal_conv1d_update(*args))


def run(quick: bool = False) -> list[Row]:
    g = torch.Generator().manual_seed(0)
    H, P, N, dim, conv_dim = (4, 16, 16, 64, 96) if quick else (24, 64, 128, 1536, 1792)
    rows = []
    for batch, pool in ((1, 1), (8, 16)):
        call, full = _ssu_case(batch, pool, H, P, N, g)
        rows.append(_row("selective_state_update", f"Mamba-2 b={batch}, pool={pool}, H={H}, P={P}, N={N}, tied, fp32",
                         call, full))
        call, full = _conv_case(batch, pool, conv_dim, g)
        rows.append(_row("causal_conv1d_update", f"b={batch}, pool={pool}, d={conv_dim}, w=4, silu, fp32", call, full))
    call, full = _mamba1_case(1, dim, 16, g)
    rows.append(_row("selective_state_update", f"Mamba-1 b=1, d={dim}, N=16, z, fp32", call, full))
    return rows


if __name__ == "__main__":
    from benchlib import format_table

    print(format_table(run()))
