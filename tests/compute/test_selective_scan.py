"""The compute-layer (generic, unscheduled) selective-scan kernels against the float64 reference.

These run the builders' PrimFuncs exactly as dispatch gets them (serial lanes, scalar dstate loop), compiled
for llvm, in float64: they check the loop-nest math independently of any schedule.
"""
from __future__ import annotations

import pytest
import torch
import tvm

from tvm_mamba.compute import selective_scan as ss
from tvm_mamba.reference.selective_scan import selective_scan_ref, selective_state_update_ref
from tvm_mamba.runtime.target import cpu_target

F64 = dict(u_dtype="float64", B_dtype="float64", C_dtype="float64")
STATIC = dict(dim=4, dstate=4, b_groups=2, c_groups=0, has_D=True, has_z=True, has_delta_bias=True,
              delta_softplus=True, has_init=True, chunk=4)


def _compile(func):
    return tvm.compile(func, target=cpu_target())[str(func.attrs["global_symbol"])]


def _kl(M):
    return M.transpose(-1, -2).contiguous() if M.dim() == 4 else M


def _one_ws(regions):
    """The backward's one workspace (``_signature.bwd_workspace``): room for its regions wsA, wsB, wsC, wsS."""
    return torch.empty(sum(r.numel() for r in regions), dtype=regions[0].dtype)


def test_generic_forward_backward_match_reference():
    batch, dim, N, L = 2, 4, 4, 11  # 3 chunks of 4, the last one partial
    fwd = _compile(ss.selective_scan_fwd(**STATIC, **F64))
    bwd = _compile(ss.selective_scan_bwd(**STATIC, block=2, **F64))
    g = torch.Generator().manual_seed(0)
    o = dict(dtype=torch.float64)
    r = lambda *s: torch.randn(*s, generator=g, **o)  # noqa: E731
    u, delta, z = r(batch, dim, L), 0.5 * r(batch, dim, L), r(batch, dim, L)
    A, B, C = -torch.rand(dim, N, generator=g, **o) - 0.2, r(batch, 2, N, L), r(dim, N)
    D, db, init = r(dim), 0.1 * r(dim), r(batch, dim, N)
    out, last, ck = torch.empty_like(u), torch.empty(batch, dim, N, **o), torch.empty(batch, dim, 3, N, **o)
    fwd(u, delta, A, _kl(B), C, D, z, db, init, out, last, ck)
    leaves = [t.clone().requires_grad_() for t in (u, delta, A, B, C, D, z, db, init)]
    rout, rlast = selective_scan_ref(*leaves[:7], leaves[7], True, True, leaves[8])
    torch.testing.assert_close(out, rout.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(last, rlast.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ck[:, :, 0], init)  # the state before chunk 0 is the initial state
    dout, dlast = r(batch, dim, L), r(batch, dim, N)
    torch.autograd.backward([rout, rlast], [dout, dlast])
    grads = [torch.empty_like(t) for t in (u, delta, A, _kl(B), C, D, db, z, init)]
    du, ddelta, dA, dB, dC, dD, ddb, dz, dinit = grads
    ws = (torch.empty(batch, dim, N, **o), torch.empty(batch, dim // 2, L, N, **o), torch.empty(batch, dim, N, **o),
          torch.empty(batch, dim, 2, **o))
    bwd(u, delta, A, _kl(B), C, D, z, db, init, ck, dout, dlast, du, ddelta, dA, dB, dC, dD, ddb, dz, dinit,
        _one_ws(ws))
    mine = dict(u=du, delta=ddelta, A=dA, B=dB.transpose(-1, -2), C=dC, D=dD, z=dz, db=ddb, init=dinit)
    for (name, val), leaf in zip(mine.items(), leaves):
        torch.testing.assert_close(val, leaf.grad, rtol=1e-9, atol=1e-9, msg=name)


def test_generic_update_matches_reference():
    upd = _compile(ss.selective_scan_update(nheads=4, headdim=2, dstate=4, ngroups=2, has_D=True, has_z=True,
                                            has_dt_bias=True, dt_softplus=True, x_dtype="float64",
                                            B_dtype="float64", C_dtype="float64"))
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    state, x, dt, z = r(3, 4, 2, 4), r(3, 4, 2), r(3, 4, 2), r(3, 4, 2)
    A, B, C, D, dtb = -r(4, 2, 4).abs(), r(3, 2, 4), r(3, 2, 4), r(4, 2), r(4, 2)
    ref_out, ref_state = selective_state_update_ref(state, x, dt, A, B, C, D, z, dtb, True)
    out = torch.empty_like(x)
    upd(state, x, dt, A, B, C, D, z, dtb, torch.zeros(1, dtype=torch.int32), out)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, ref_state, rtol=1e-10, atol=1e-10)


def test_generic_update_state_pool_bf16_state():
    """The template's slot indirection (int64 indices, a padding row) and 16-bit state storage."""
    upd = _compile(ss.selective_scan_update(nheads=2, headdim=2, dstate=4, state_dtype="bfloat16",
                                            idx_dtype="int64"))
    g = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    pool, x, dt = r(5, 2, 2, 4).bfloat16(), r(3, 2, 2), r(3, 2, 2).abs()
    A, B, C = -r(2, 2, 4).abs(), r(3, 1, 4), r(3, 1, 4)
    idx = torch.tensor([4, -1, 0])
    ref_out, ref_pool = selective_state_update_ref(pool, x, dt, A, B, C, state_batch_indices=idx,
                                                   state_dtype=torch.bfloat16)
    out = torch.empty_like(x)
    upd(pool, x, dt, A, B, C, torch.zeros(1, 1), torch.zeros(1, 1, 1), torch.zeros(1, 1), idx, out)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool.double(), ref_pool, rtol=2 ** -7, atol=1e-3)
    assert pool.dtype == torch.bfloat16


def test_builders_are_stamped_and_validate_static_dims():
    f = ss.selective_scan_fwd(dim=8, dstate=16)
    assert str(f.attrs["tvm_mamba.kernel"]) == "selective_scan_fwd"
    with pytest.raises(ValueError, match="B"):
        ss.selective_scan_fwd(dim=6, dstate=16, b_groups=4)
    with pytest.raises(ValueError, match="u"):
        ss.selective_scan_fwd(dim=6, dstate=16, u_dtype="int8")
    with pytest.raises(ValueError, match="block"):
        ss.selective_scan_bwd(dim=6, dstate=16, b_groups=2, block=2)
    with pytest.raises(ValueError, match="ngroups"):
        ss.selective_scan_update(nheads=6, headdim=1, dstate=16, ngroups=4)
    assert ss.block_size(1536, 1, 1) == 16 and ss.block_size(6, 2, 0) == 3
    assert ss.vector_width(16) == 16 and ss.vector_width(24) == 8 and ss.vector_width(7) == 1


def test_generic_complex_forward_backward_match_reference():
    """The complex-A templates (generic: serial lanes and dstate), float64, against the complex128 reference
    through autograd: every gradient in the kernel layouts ((..., 2) pairs)."""
    sx = ss  # the complex-A builders live in the same package

    batch, dim, N, L, chunk = 2, 4, 3, 9, 4  # 3 chunks, the last partial; B varying in 2 groups, C complex
    st = dict(STATIC, dstate=N, chunk=chunk)
    fwd = _compile(sx.selective_scan_fwd_complex(**st, **F64))
    bwd = _compile(sx.selective_scan_bwd_complex(**st, **F64))
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    u, delta, z = r(batch, dim, L), r(batch, dim, L), r(batch, dim, L)
    A, Bk, Ck = r(dim, N, 2), r(batch, 2, L, N, 2), r(dim, N, 2)
    A[..., 0] = -A[..., 0].abs()
    D, db, init = r(dim), 0.1 * r(dim), r(batch, dim, N, 2)
    out, last = torch.empty_like(u), torch.empty(batch, dim, N, 2, dtype=torch.float64)
    ck = torch.empty(batch, dim, 3, N, 2, dtype=torch.float64)
    fwd(u, delta, A, Bk, Ck, D, z, db, init, out, last, ck)
    leaves = [t.clone().requires_grad_() for t in (u, delta, A, Bk, Ck, D, z, db, init)]
    lu, ld, lA, lB, lC, lD, lz, ldb, li = leaves
    cplx = lambda t: torch.view_as_complex(t)  # noqa: E731
    B_user = lB.permute(0, 1, 3, 2, 4).reshape(batch, 2, N, 2 * L)
    ro, rl = selective_scan_ref(lu, ld, cplx(lA), B_user, cplx(lC), lD, lz, ldb, True, True, cplx(li))
    torch.testing.assert_close(out, ro.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(last, torch.view_as_real(rl).detach(), rtol=1e-10, atol=1e-10)
    dout, dlast = r(batch, dim, L), r(batch, dim, N, 2)
    torch.autograd.backward([ro, rl], [dout, cplx(dlast)])
    grads = [torch.empty_like(t) for t in (u, delta, A, Bk, Ck, D, db, z, init)]
    ws = [torch.empty(batch, dim, N, 2, dtype=torch.float64), torch.empty(batch, dim, L, N, 2, dtype=torch.float64),
          torch.empty(batch, dim, N, 2, dtype=torch.float64), torch.empty(batch, dim, 2, dtype=torch.float64)]
    bwd(u, delta, A, Bk, Ck, D, z, db, init, ck, dout, dlast, *grads, _one_ws(ws))
    for name, val, leaf in zip(("du", "ddelta", "dA", "dB", "dC", "dD", "ddb", "dz", "dinit"), grads,
                               (lu, ld, lA, lB, lC, lD, ldb, lz, li)):
        torch.testing.assert_close(val, leaf.grad, rtol=1e-9, atol=1e-9, msg=name)


def test_typed_dims_keep_the_kernel_keys():
    """The typed dims split back into exactly the static / dtype maps the keyword builders keyed kernels
    and tuning records by (optional update fields absent at their defaults)."""
    for direction, static, dtypes in ss.build_check_configs() + ss.tuning_configs():
        dims = ss.DIMS[direction].from_key(static, dtypes)
        assert dims.key_parts() == (static, dtypes), direction
        assert ss.DIMS[direction](**dims.static()) == dims  # the keyword form names every field
    with pytest.raises(TypeError, match="not both"):
        ss.selective_scan_fwd(ss.ScanDims(dim=8, dstate=16), dim=8)


@pytest.mark.parametrize("c_groups", [0, 1])
def test_time_parallel_templates_serial_layout(c_groups):
    """The parallel-in-time forward and backward (timescan.py, timescan_bwd.py; CUDA's kernels) with the serial
    layout (one time thread of 8 steps: two time blocks, the last one ragged) in float64 against the reference;
    its forward's checkpoints equal the sequential forward's (the backward starts its time blocks there)."""
    from tvm_mamba.compute._math import Math

    static = dict(STATIC, c_groups=c_groups)
    fdims, bdims = ss.ScanDims(**static, **F64), ss.ScanBwdDims(**static, block=1, **F64)
    layout = ss.Layout(Math("float64"))
    layout.items = 8
    fwd = _compile(ss.build("fwd", fdims, layout, variant="timescan"))
    bwd = _compile(ss.build("bwd", bdims, layout, variant="timescan"))
    seq_fwd = _compile(ss.selective_scan_fwd(fdims))
    batch, dim, N, L = 2, 4, 4, 11
    g = torch.Generator().manual_seed(1)
    o = dict(dtype=torch.float64)
    r = lambda *s: torch.randn(*s, generator=g, **o)  # noqa: E731
    u, delta, z = r(batch, dim, L), 0.5 * r(batch, dim, L), r(batch, dim, L)
    A, B = -torch.rand(dim, N, generator=g, **o) - 0.2, r(batch, 2, N, L)
    C = r(batch, 1, N, L) if c_groups else r(dim, N)
    D, db, init = r(dim), 0.1 * r(dim), r(batch, dim, N)
    args = (u, delta, A, _kl(B), _kl(C), D, z, db, init)
    out, last, ck = torch.empty_like(u), torch.empty(batch, dim, N, **o), torch.empty(batch, dim, 3, N, **o)
    fwd(*args, out, last, ck)
    ck_seq = torch.empty_like(ck)
    seq_fwd(*args, torch.empty_like(u), torch.empty_like(last), ck_seq)
    leaves = [t.clone().requires_grad_() for t in (u, delta, A, B, C, D, z, db, init)]
    rout, rlast = selective_scan_ref(*leaves[:7], leaves[7], True, True, leaves[8])
    torch.testing.assert_close(out, rout.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(last, rlast.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ck, ck_seq, rtol=1e-12, atol=1e-12)
    dout, dlast = r(batch, dim, L), r(batch, dim, N)
    torch.autograd.backward([rout, rlast], [dout, dlast])
    du, ddelta, dA, dB, dC, dD, ddb, dz, dinit = [torch.empty_like(t) for t in (u, delta, A, _kl(B), _kl(C), D,
                                                                               db, z, init)]
    ws = (torch.empty(batch, dim, N, **o), torch.empty(batch, dim, L, N, **o),
          torch.empty(batch, dim, L, N, **o) if c_groups else torch.empty(batch, dim, N, **o),
          torch.empty(batch, dim, 2, **o))
    bwd(*args, ck, dout, dlast, du, ddelta, dA, dB, dC, dD, ddb, dz, dinit, _one_ws(ws))
    mine = dict(u=du, delta=ddelta, A=dA, B=dB.transpose(-1, -2), C=dC.transpose(-1, -2) if c_groups else dC,
                D=dD, z=dz, db=ddb, init=dinit)
    for (name, val), leaf in zip(mine.items(), leaves):
        torch.testing.assert_close(val, leaf.grad, rtol=1e-9, atol=1e-9, msg=name)
