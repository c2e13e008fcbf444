"""overhead: what a decode-step op costs above its kernel, called one at a time as a server calls it.

Each row times the public function (tvm ms) against its own kernel launched alone on the same tensors (ref
ms: the launch captured with ``capture_launches`` and run again, tensors converted by tvm_ffi per call as
in any call); the note gives the overhead in microseconds and the op's full path (every check, the key,
the cache lookup), which the first call of a signature takes. The two are timed in alternating rounds (a
loop of calls, then a loop of kernel launches) and the overhead is the median of the rounds' differences:
a single call's time swings more than the overhead on a shared VM, and slow stretches hit both loops of a
round alike. Decode shapes of the 130M models, batch 1 and 8 (the batch-8 rows from a slot pool with state
indices, as continuous batching calls them).
"""
from __future__ import annotations

import itertools
import statistics
import time

import torch
from benchlib import Row, median_ms

import tvm_mamba
from tvm_mamba.torch_ops import causal_conv1d as conv_ops
from tvm_mamba.torch_ops import selective_scan as scan_ops
from tvm_mamba.torch_ops._dlpack import capture_launches

TIMING = dict(warmup=50, iters=300, min_time_s=0.3)
_STEPS = 2  # activations of this many decode steps, called in turn: each call sees new tensors, as a server's
# calls do (a view remembered from the last call is not this call's), parameters at the same addresses


def _kernel_alone(calls):
    """The kernel launches of ``calls`` (one each), replayed in turn."""
    launches = []
    for call in calls:
        with capture_launches() as captured:
            call()
        launches += captured
    return _turns([lambda launch=launch: launch.kernel(*launch.args) for launch in launches])


def _turns(fns):
    """A callable that runs ``fns`` in turn, one per call."""
    step = itertools.cycle(fns).__next__
    return lambda: step()()


def _loop_ms(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e3 * (time.perf_counter() - t0) / n


def _paired(call, alone, rounds: int = 31, n: int = 100) -> tuple[float, float, float]:
    """Medians of (call, kernel alone, call - kernel alone) over alternating rounds of ``n`` runs each, ms."""
    for fn in (call, alone):
        _loop_ms(fn, TIMING["warmup"])
    pairs = [(_loop_ms(call, n), _loop_ms(alone, n)) for _ in range(rounds)]
    return (statistics.median(c for c, _ in pairs), statistics.median(a for _, a in pairs),
            statistics.median(c - a for c, a in pairs))


def _row(op: str, shape: str, case) -> Row:
    calls, full = case
    for call in calls:
        call()  # build / load, and the signature's prepared launch
    tvm, alone, overhead = _paired(_turns(calls), _kernel_alone(calls))
    full_ms = median_ms(full, **TIMING)
    note = f"overhead {1e3 * overhead:.1f} us; full path {1e3 * full_ms:.1f} us"
    return Row(op, "call vs its kernel alone", shape, tvm, alone, None, "kernel launch alone", note, overhead)


def _ssu_case(batch: int, pool: int, H: int, P: int, N: int, g):
    """Mamba2.step's call as vLLM's layer makes it: tied per-head dt / A / D / dt_bias as expanded views made
    again each step (A, D, dt_bias of the same parameters), no z."""
    state = torch.randn(pool, H, P, N, generator=g)
    A_h, D_h, dtb_h = -torch.rand(H, generator=g), torch.randn(H, generator=g), torch.randn(H, generator=g)
    idx = torch.randperm(pool, generator=g)[:batch].to(torch.int32) if pool != batch else None

    def step_args():
        x, B, C = (torch.randn(batch, *shape, generator=g) for shape in ((H, P), (1, N), (1, N)))
        dt = torch.rand(batch, H, generator=g)[:, :, None].expand(-1, -1, P)
        A, D, dtb = A_h[:, None, None].expand(-1, P, N), D_h[:, None].expand(-1, P), dtb_h[:, None].expand(-1, P)
        return (state, x, dt, A, B, C, D, None, dtb, True, idx)

    steps = [step_args() for _ in range(_STEPS)]
    calls = [lambda a=a: tvm_mamba.selective_state_update(*a[:9], dt_softplus=True, state_batch_indices=idx)
             for a in steps]
    return calls, lambda: scan_ops._selective_state_update(*steps[0])


def _mamba1_case(batch: int, dim: int, N: int, g):
    state, A = torch.randn(batch, dim, N, generator=g), -torch.rand(dim, N, generator=g)
    D, dt_bias = torch.randn(dim, generator=g), torch.randn(dim, generator=g)

    def step_args():
        x, z, dt = torch.randn(batch, dim, generator=g), torch.randn(batch, dim, generator=g), \
            torch.rand(batch, dim, generator=g)
        B, C = torch.randn(batch, N, generator=g), torch.randn(batch, N, generator=g)
        return (state, x, dt, A, B, C, D, z, dt_bias, True, None)

    steps = [step_args() for _ in range(_STEPS)]
    calls = [lambda a=a: tvm_mamba.selective_state_update(*a[:9], dt_softplus=True) for a in steps]
    return calls, lambda: scan_ops._selective_state_update(*steps[0])


def _conv_case(batch: int, pool: int, dim: int, g):
    state = torch.randn(pool, dim, 3, generator=g)
    w, b = torch.randn(dim, 4, generator=g), torch.randn(dim, generator=g)
    idx = torch.randperm(pool, generator=g)[:batch].to(torch.int32) if pool != batch else None
    steps = [(torch.randn(batch, dim, generator=g), state, w, b, "silu", None, idx) for _ in range(_STEPS)]
    return [lambda a=a: tvm_mamba.causal_conv1d_update(*a) for a in steps], \
        lambda: conv_ops._causal_conv1d_update(*steps[0])


def run(quick: bool = False) -> list[Row]:
    g = torch.Generator().manual_seed(0)
    H, P, N, dim, conv_dim = (4, 16, 16, 64, 96) if quick else (24, 64, 128, 1536, 1792)
    rows = []
    for batch, pool in ((1, 1), (8, 16)):
        rows.append(_row("selective_state_update", f"Mamba-2 b={batch}, pool={pool}, H={H}, P={P}, N={N}, tied, fp32",
                         _ssu_case(batch, pool, H, P, N, g)))
        rows.append(_row("causal_conv1d_update", f"b={batch}, pool={pool}, d={conv_dim}, w=4, silu, fp32",
                         _conv_case(batch, pool, conv_dim, g)))
    rows.append(_row("selective_state_update", f"Mamba-1 b=1, d={dim}, N=16, z, fp32", _mamba1_case(1, dim, 16, g)))
    return rows


if __name__ == "__main__":
    from benchlib import format_table

    print(format_table(run()))
