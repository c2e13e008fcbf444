"""SSD kernel builders: dims validation, stamping, and the chunk-level kernels against torch math."""
from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import assert_close_to_ref
from tvm_mamba.compute import ssd
from tvm_mamba.compute.ssd import dims as ssd_dims
from tvm_mamba.reference.ssd import process_dt, ssd_recurrence_ref
from tvm_mamba.runtime import KernelKey, build_and_load, target_for_device, target_key

H, P, N, Q = 2, 4, 8, 8


def _kernel(direction, static, dtypes=None):
    key = KernelKey.make("ssd", direction, dtypes or {}, static, target_key(target_for_device("cpu")))
    return build_and_load(key)


@pytest.mark.parametrize("bad, match", [
    (dict(headdim=257), "headdim"), (dict(dstate=0), "dstate"), (dict(chunk_size=300), "chunk_size"),
    (dict(ngroups=3), "ngroups"),
])
def test_check_dims(bad, match):
    dims = dict(nheads=4, ngroups=2, headdim=8, dstate=8, chunk_size=16)
    dims.update(bad)
    with pytest.raises(ValueError, match=match):
        ssd.check_dims(**dims)


@pytest.mark.parametrize("direction", ssd.KERNELS)
def test_builders_are_stamped(direction):
    import dataclasses

    full = dict(nheads=H, ngroups=1, headdim=P, dstate=N, chunk_size=Q)
    fn = getattr(ssd, f"ssd_{direction}")
    cls = ssd.DIMS[direction]
    dims = cls(**{f.name: full[f.name] for f in dataclasses.fields(cls) if f.name in full})
    func = fn(dims)
    assert str(func.attrs["tvm_mamba.kernel"]) == f"ssd_{direction}"
    assert str(func.attrs["global_symbol"]) == f"ssd_{direction}"
    assert set(func.attrs.keys()) == {"global_symbol", "tirx.noalias", "tvm_mamba.kernel"}  # no static stamp


def test_dims_keep_the_keys():
    """Every key the op, build-check, tuning and the committed tuning records use rebuilds into its typed dims
    and back into the same two maps (caches and tuning records still match); state_dtype at its default
    stays out of the key and the stamp."""
    import pathlib

    cases = [(d, s, t) for d, s, t in ssd.build_check_configs() + ssd.tuning_configs()]
    logs = pathlib.Path(__file__).parents[2] / "tuning_logs"
    for path in logs.glob("*/ssd/*.jsonl"):
        for line in path.read_text().splitlines():
            k = json.loads(line)["key"]
            cases.append((k["direction"], k["static_dims"], k["dtypes"]))
    assert len(cases) > 40
    for direction, static, dtypes in cases:
        dims = ssd.DIMS[direction].from_key(static, dtypes)
        assert dims.key_parts() == (dict(static), dict(dtypes)), (direction, static, dtypes)
    plain = ssd.DIMS["state_passing"](nheads=2, headdim=4, dstate=8, chunk_size=8)
    assert "state" not in plain.key_parts()[1]
    with pytest.raises(ValueError, match="states"):
        ssd.DIMS["chunk_scan"](nheads=2, ngroups=1, headdim=4, dstate=8, chunk_size=8, state_dtype="int8")
    scan = dict(nheads=2, ngroups=1, headdim=4, dstate=8, chunk_size=8)  # diag_skip (Mamba-3): off = no key field
    assert "diag_skip" not in ssd.DIMS["chunk_scan"](**scan).key_parts()[0]
    for direction in ("chunk_scan", "chunk_scan_bwd"):  # the backward shares the flag and its check
        assert "diag_skip" not in ssd.DIMS[direction](**scan).key_parts()[0]
        with pytest.raises(ValueError, match="diag_skip"):
            ssd.DIMS[direction](**scan, diag_skip=True)  # needs has_D: D is the per-position skip
        with pytest.raises(ValueError, match="diag_skip"):
            ssd.DIMS[direction](**scan, has_D=True, D_has_hdim=True, diag_skip=True)


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_head_sum_against_torch(out_dtype):
    """dB / dC: per-head partials summed over the heads of each group (in head order), cast to B's dtype."""
    g = torch.Generator().manual_seed(0)
    b, L, heads, groups, n = 2, 13, 6, 2, 24
    per_head = torch.randn(b, L, heads, n, generator=g)
    tdt = getattr(torch, out_dtype)
    out = torch.empty(b, L, groups, n, dtype=tdt)
    _kernel("head_sum", dict(nheads=heads, ngroups=groups, dstate=n), {"out": out_dtype})(per_head, out)
    ref = per_head.double().view(b, L, groups, heads // groups, n).sum(3)
    tol = 1e-6 if out_dtype == "float32" else 1e-2
    torch.testing.assert_close(out.double(), ref.to(tdt).double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("bc_dtype", ["float32", "bfloat16"])
def test_bmm_chunk_against_torch(bc_dtype):
    """cb[b, c, g] = C_chunk @ B_chunk^T per (chunk, group) on and below the diagonal (s <= l), 0 above it, zero
    rows / columns past seqlen (ragged last chunk)."""
    g = torch.Generator().manual_seed(3)
    b, L, groups, n, q = 2, 21, 2, 24, 8
    tdt = getattr(torch, bc_dtype)
    B, C = (torch.randn(b, L, groups, n, generator=g).to(tdt) for _ in range(2))
    nc = -(-L // q)
    cb = torch.full((b, nc, groups, q, q), float("nan"))
    _kernel("bmm_chunk", dict(ngroups=groups, dstate=n, chunk_size=q), {"bc": bc_dtype})(B, C, cb)
    pad = nc * q - L
    Bp, Cp = (torch.nn.functional.pad(t.double(), (0, 0, 0, 0, 0, pad)).view(b, nc, q, groups, n) for t in (B, C))
    ref = torch.einsum("bclgn,bcsgn->bcgls", Cp, Bp).tril()
    torch.testing.assert_close(cb.double(), ref, atol=1e-5, rtol=1e-5)


def test_chunk_cumsum_against_torch():
    g = torch.Generator().manual_seed(0)
    b, L = 2, 19  # ragged: 3 chunks of 8, the last one 3 long
    dt = torch.randn(b, L, H, generator=g)
    bias, A = torch.randn(H, generator=g), -torch.rand(H, generator=g)
    limit = torch.tensor([0.1, 1.5])
    nc = -(-L // Q)
    dt_out, dA_cs = torch.empty(b, H, nc, Q), torch.empty(b, H, nc, Q)
    k = _kernel("chunk_cumsum", dict(nheads=H, chunk_size=Q, has_dt_bias=True, dt_softplus=True, has_dt_limit=True))
    k(dt, bias, A, limit, dt_out, dA_cs)
    ref = process_dt(dt.double(), bias.double(), True, (0.1, 1.5))
    ref = torch.nn.functional.pad(ref, (0, 0, 0, nc * Q - L)).reshape(b, nc, Q, H).permute(0, 3, 1, 2)
    torch.testing.assert_close(dt_out.double(), ref, atol=1e-6, rtol=1e-6)
    assert torch.all(dt_out[:, :, -1, L - (nc - 1) * Q:] == 0)  # past seqlen: dt' = 0
    torch.testing.assert_close(dA_cs.double(), torch.cumsum(ref * A.double()[None, :, None, None], -1),
                               atol=1e-5, rtol=1e-5)


def test_chunk_state_and_state_passing_give_the_recurrence_states():
    """states_in[c] must be the recurrence's state after position c*Q - 1 (computed on the prefix)."""
    g = torch.Generator().manual_seed(1)
    b, L, G = 1, 21, 1
    x, dt = torch.randn(b, L, H, P, generator=g), torch.rand(b, L, H, generator=g)
    A, B = -torch.rand(H, generator=g) - 0.2, torch.randn(b, L, G, N, generator=g)
    init = torch.randn(b, H, P, N, generator=g)
    nc = -(-L // Q)
    dt_out, dA_cs = torch.empty(b, H, nc, Q), torch.empty(b, H, nc, Q)
    _kernel("chunk_cumsum", dict(nheads=H, chunk_size=Q, has_dt_bias=False, dt_softplus=False,
                                 has_dt_limit=False))(dt, torch.zeros(1), A, torch.zeros(1), dt_out, dA_cs)
    states = torch.empty(b, nc, H, P, N)
    _kernel("chunk_state", dict(nheads=H, ngroups=G, headdim=P, dstate=N, chunk_size=Q, has_seq_idx=False),
            {"x": "float32", "bc": "float32"})(x, B, dt_out, dA_cs, torch.zeros(1, 1, dtype=torch.int32), states)
    states_in, final = torch.empty(b, nc, H, P, N), torch.empty(b, H, P, N)
    _kernel("state_passing", dict(nheads=H, headdim=P, dstate=N, chunk_size=Q, has_init=True, has_seq_idx=False))(
        states, dA_cs, init, torch.zeros(1, 1, dtype=torch.int32), states_in, final)
    d = [t.double() for t in (x, dt, A, B, init)]
    for c in range(nc + 1):
        end = min(c * Q, L)
        if end == 0:
            want = d[4]
        else:
            _, want = ssd_recurrence_ref(d[0][:, :end], d[1][:, :end], d[2], d[3][:, :end], d[3][:, :end],
                                         initial_states=d[4], return_final_states=True)
        got = states_in[:, c] if c < nc else final
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=f"chunk {c}")


@pytest.mark.parametrize("x_dtype, has_z, ngroups",
                         [("float32", True, H), ("bfloat16", True, H), ("float32", False, 1)])
def test_chunk_scan_bwd_diag_skip(x_dtype, has_z, ngroups, monkeypatch):
    """ssd_chunk_scan_bwd with diag_skip (Mamba-3): strict causal sums, D and dD per position. Every gradient
    (dx, dB, dC, d dt, d dA_step, dD) against autograd of the float64 strict chunk scan (reference/ssd.py) on
    L = <dy, y> + <dSo, S_out>: batch 2, 21 positions in 3 chunks of 8 (the last ragged). ngroups 1 < nheads:
    the dB / dC sums over 2 parts of one head and over 1 part of both heads (head_parts' task target 64 / 1).
    bf16 x: dx within mamba_ssm's rule (2 x the bf16 reference's drift + atol), the f32 outputs as fp32 (the
    inputs are exact in both)."""
    from tvm_mamba.compute.ssd.dims import ScanBwdDims
    from tvm_mamba.tools.simcheck import ssd as sc

    dims = ScanBwdDims(nheads=H, ngroups=ngroups, headdim=P, dstate=N, chunk_size=Q, has_D=True, has_z=has_z,
                       diag_skip=True, x_dtype=x_dtype)
    t = sc.scan_bwd_inputs(dims, 2, 21)
    ref = sc.scan_bwd_reference(t)
    low = sc.scan_bwd_reference(t, torch.bfloat16)["dx"] if x_dtype == "bfloat16" else None
    for tasks in ((64, 1) if ngroups < H else (64,)):
        monkeypatch.setattr(ssd_dims, "HEAD_PART_TASKS", tasks)
        got = sc.scan_bwd_run(dims, t)
        assert got["dx"].dtype == getattr(torch, x_dtype) and got["dD"].shape == t["D"].shape
        for name, r in ref.items():
            scale = max(r.abs().max().item(), 1.0)
            if name == "dx" and low is not None:
                assert_close_to_ref(got[name], r, low, name=name)
            else:
                assert_close_to_ref(got[name], r, atol=2e-5 * scale, rtol=1e-4, name=f"{name} (tasks {tasks})")


def test_step_group_dims():
    """step_group (Mamba-3 MIMO): left out of the key at 1, in it otherwise; needs diag_skip and to divide
    chunk_size (ValueError naming it)."""
    scan = dict(nheads=2, ngroups=2, headdim=4, dstate=8, chunk_size=8, has_D=True, diag_skip=True)
    for direction in ("chunk_scan", "chunk_scan_bwd"):
        cls = ssd.DIMS[direction]
        assert "step_group" not in cls(**scan).key_parts()[0]
        assert cls(**scan, step_group=4).key_parts()[0]["step_group"] == 4
        for bad in (dict(scan, step_group=3), dict(scan, step_group=0), dict(scan, diag_skip=False, step_group=2)):
            with pytest.raises(ValueError, match="step_group"):
                cls(**bad)


@pytest.mark.parametrize("step_group, ngroups", [(2, H), (4, 1)])
def test_chunk_scan_step_group(step_group, ngroups):
    """ssd_chunk_scan and ssd_chunk_scan_bwd with step_group (Mamba-3 MIMO's flattened (step, rank) positions:
    the causal sum over strictly earlier groups, s // G < l // G), the CPU kernels: y and every gradient (dx,
    dB, dC, d dt, d dA_step, dD) against the float64 grouped strict chunk scan (reference/ssd.py) and its
    autograd; batch 2, 21 positions in 3 chunks of 8 (the last ragged inside a group). G = 2 selects per row
    inside the CPU matmuls' 4-row blocks, G = 4 spans them."""
    from tvm_mamba.compute.ssd.dims import ScanBwdDims, ScanDims
    from tvm_mamba.reference.ssd import ssd_chunk_scan_strict_ref
    from tvm_mamba.tools.simcheck import ssd as sc

    flags = dict(nheads=H, ngroups=ngroups, headdim=P, dstate=N, chunk_size=Q, has_D=True, has_z=True,
                 diag_skip=True, step_group=step_group)
    t = sc.scan_bwd_inputs(ScanBwdDims(**flags), 2, 21)
    y = sc.scan_fwd_run(ScanDims(**flags, has_init=True), t)
    want, _ = ssd_chunk_scan_strict_ref(**{k: t[k].double() for k in sc.SCAN_BWD_GRADS}, z=t["z"].double(),
                                        states_in=t["Sin"].double(), step_group=step_group)
    assert_close_to_ref(y, want, atol=2e-5 * max(want.abs().max().item(), 1.0), rtol=1e-4, name="y")
    plain, _ = ssd_chunk_scan_strict_ref(**{k: t[k].double() for k in sc.SCAN_BWD_GRADS}, z=t["z"].double(),
                                         states_in=t["Sin"].double())
    assert (want - plain).abs().max() > 1e-2  # the grouping matters at these inputs
    got = sc.scan_bwd_run(ScanBwdDims(**flags), t)
    for name, r in sc.scan_bwd_reference(t, step_group=step_group).items():
        assert_close_to_ref(got[name], r, atol=2e-5 * max(r.abs().max().item(), 1.0), rtol=1e-4, name=name)
