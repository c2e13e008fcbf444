"""mamba_chunk_scan_combined against the float64 step-by-step recurrence written from the math."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close_to_ref
from tvm_mamba.reference.ssd import ssd_chunked_ref, ssd_recurrence_ref
from tvm_mamba.torch_ops.ssd import mamba_chunk_scan_combined

# One set of static dims for most tests: every distinct (dims, flags, dtypes) is a compile of 4-8 kernels.
H, G, P, N, Q = 4, 2, 8, 16, 16
NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def _inputs(batch=2, seqlen=37, d_hdim=True, dtype=torch.float32, seed=0, nheads=H, ngroups=G, headdim=P,
            dstate=N):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g) * scale

    x = r(batch, seqlen, nheads, headdim).to(dtype)
    dt = (r(batch, seqlen, nheads) - 1.0).to(dtype)
    A = -(torch.rand(nheads, generator=g) + 0.5)
    B = r(batch, seqlen, ngroups, dstate, scale=0.5).to(dtype)
    C = r(batch, seqlen, ngroups, dstate, scale=0.5).to(dtype)
    D = r(nheads, headdim) if d_hdim else r(nheads)
    z = r(batch, seqlen, nheads, headdim).to(dtype)
    dt_bias = r(nheads, scale=0.5)
    init = r(batch, nheads, headdim, dstate, scale=0.5)
    return dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, initial_states=init)


def _seq_idx(batch, seqlen, seed=0, p=0.08):
    g = torch.Generator().manual_seed(seed)
    return torch.cumsum((torch.rand(batch, seqlen, generator=g) < p).to(torch.int32), dim=1).to(torch.int32)


def _run(fn, inputs, grads_of, seed=1, **kw):
    """Forward (y, final) and the gradients of a random linear loss w.r.t. ``grads_of``."""
    leaves = {k: v.clone().requires_grad_(k in grads_of) if v is not None else None for k, v in inputs.items()}
    y, final = fn(**leaves, return_final_states=True, **kw)
    g = torch.Generator().manual_seed(seed)
    loss = ((y.double() * torch.randn(y.shape, generator=g, dtype=torch.float64)).sum()
            + (final.double() * torch.randn(final.shape, generator=g, dtype=torch.float64)).sum())
    loss.backward()
    return y, final, {k: leaves[k].grad for k in grads_of}


def _ours(chunk_size=Q, **kw):
    def fn(x, dt, A, B, C, **rest):
        return mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, **rest, **kw)
    return fn


def _ref(**kw):
    def fn(x, dt, A, B, C, **rest):
        return ssd_recurrence_ref(x, dt, A, B, C, **rest, **kw)
    return fn


def _f64(inputs):
    return {k: v.double() if v is not None else None for k, v in inputs.items()}


FULL = dict(dt_softplus=True, dt_limit=(0.0, 2.0))


@pytest.mark.parametrize("keep", [False, True])
def test_forward_backward_all_features_fp32(keep):
    """Ragged seqlen (37 = 2*16 + 5), D (nheads, headdim), z, dt_bias, softplus, dt_limit, initial_states,
    a gradient flowing in through final_states; both backward memory modes."""
    inp = _inputs()
    y, f, grads = _run(_ours(keep_chunk_states=keep, **FULL), inp, NAMES)
    yr, fr, rgrads = _run(_ref(**FULL), _f64(inp), NAMES)
    assert y.dtype == torch.float32 and f.dtype == torch.float32
    assert_close_to_ref(y, yr, atol=1e-4, rtol=1e-4, name="y")
    assert_close_to_ref(f, fr, atol=1e-4, rtol=1e-4, name="final_states")
    for k in NAMES:
        scale = rgrads[k].abs().max().item()
        assert_close_to_ref(grads[k], rgrads[k], atol=2e-5 * max(scale, 1.0), rtol=1e-4, name="d" + k)


def test_memory_modes_agree_bitwise():
    inp = _inputs(seqlen=40)
    _, _, g1 = _run(_ours(keep_chunk_states=False, **FULL), inp, NAMES)
    _, _, g2 = _run(_ours(keep_chunk_states=True, **FULL), inp, NAMES)
    for k in NAMES:
        assert torch.equal(g1[k], g2[k]), k


def test_deterministic():
    inp = _inputs(seqlen=50)
    y1, f1, g1 = _run(_ours(**FULL), inp, NAMES)
    y2, f2, g2 = _run(_ours(**FULL), inp, NAMES)
    assert torch.equal(y1, y2) and torch.equal(f1, f2)
    for k in NAMES:
        assert torch.equal(g1[k], g2[k]), k


@pytest.mark.parametrize("tasks", [1, 24, 64])
def test_head_parts_of_the_dB_dC_sums(tasks, monkeypatch):
    """chunk_scan_bwd sums dB / dC over the heads of each part of a group (compute.ssd.head_parts): 2 x 3
    (batch, chunk) x 2 groups = 12 tasks per part, so task targets 1 / 24 / 64 give 1, 2 and 4 parts of the
    4 heads per group (1: no partials, the kernel writes dB / dC; 4: one partial per head)."""
    from tvm_mamba.compute.ssd import dims as compute_ssd

    monkeypatch.setattr(compute_ssd, "HEAD_PART_TASKS", tasks)
    assert compute_ssd.head_parts(2, 3, 8, 2) == {1: 1, 24: 2, 64: 4}[tasks]
    inp = _inputs(nheads=8)
    kw = dict(FULL, seq_idx=_seq_idx(2, 37))
    y, f, grads = _run(_ours(**kw), inp, NAMES)
    yr, fr, rgrads = _run(_ref(**kw), _f64(inp), NAMES)
    assert_close_to_ref(y, yr, atol=1e-4, rtol=1e-4, name="y")
    for k in NAMES:
        scale = rgrads[k].abs().max().item()
        assert_close_to_ref(grads[k], rgrads[k], atol=2e-5 * max(scale, 1.0), rtol=1e-4, name="d" + k)


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64])
def test_chunk_sizes_agree(chunk_size):
    """seqlen 37 is ragged for every chunk size here; 64 > seqlen is a single partial chunk."""
    inp = _inputs()
    kw = dict(dt_softplus=True)
    y, f = mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk_size,
                                     D=inp["D"], initial_states=inp["initial_states"], return_final_states=True,
                                     **kw)
    base = _f64(inp)
    yr, fr = ssd_recurrence_ref(base["x"], base["dt"], base["A"], base["B"], base["C"], D=base["D"],
                                initial_states=base["initial_states"], return_final_states=True, **kw)
    assert_close_to_ref(y, yr, atol=1e-4, rtol=1e-4)
    assert_close_to_ref(f, fr, atol=1e-4, rtol=1e-4)


def test_chunked_reference_matches_recurrence():
    inp = _f64(_inputs())
    del inp["z"]
    for cs in (8, 64):
        y1, f1 = ssd_chunked_ref(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], cs, D=inp["D"],
                                 dt_bias=inp["dt_bias"], initial_states=inp["initial_states"], dt_softplus=True,
                                 return_final_states=True)
        y2, f2 = ssd_recurrence_ref(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], D=inp["D"],
                                    dt_bias=inp["dt_bias"], initial_states=inp["initial_states"],
                                    dt_softplus=True, return_final_states=True)
        assert (y1 - y2).abs().max() < 1e-10 and (f1 - f2).abs().max() < 1e-10
    y1 = ssd_chunked_ref(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 16, dt_softplus=True)
    y2 = ssd_recurrence_ref(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], dt_softplus=True)
    assert (y1 - y2).abs().max() < 1e-10


def test_D_per_head_no_z_no_bias_no_softplus():
    """D of shape (nheads,), z off, raw dt (no softplus) clamped by dt_limit (negative dt -> 0.05)."""
    inp = _inputs(d_hdim=False)
    inp["dt"] = inp["dt"].abs() * 0.5
    inp["dt"][0, :5] = -1.0  # clamped to the low limit: zero gradient there
    for k in ("z", "dt_bias", "initial_states"):
        inp[k] = None
    names = ("x", "dt", "A", "B", "C", "D")
    kw = dict(dt_limit=(0.05, 0.8))
    y, f, grads = _run(_ours(**kw), inp, names)
    yr, fr, rgrads = _run(_ref(**kw), _f64(inp), names)
    assert_close_to_ref(y, yr, atol=1e-4, rtol=1e-4)
    assert_close_to_ref(f, fr, atol=1e-4, rtol=1e-4)
    assert torch.all(grads["dt"][0, :5] == 0)
    for k in names:
        scale = rgrads[k].abs().max().item()
        assert_close_to_ref(grads[k], rgrads[k], atol=2e-5 * max(scale, 1.0), rtol=1e-4, name="d" + k)


def test_seq_idx_matches_recurrence_and_separate_runs():
    inp = _inputs(batch=2, seqlen=45)
    seq_idx = _seq_idx(2, 45)
    y, f, grads = _run(_ours(seq_idx=seq_idx, **FULL), inp, NAMES)
    yr, fr, rgrads = _run(_ref(seq_idx=seq_idx, **FULL), _f64(inp), NAMES)
    assert_close_to_ref(y, yr, atol=1e-4, rtol=1e-4)
    assert_close_to_ref(f, fr, atol=1e-4, rtol=1e-4)
    for k in NAMES:
        scale = rgrads[k].abs().max().item()
        assert_close_to_ref(grads[k], rgrads[k], atol=2e-5 * max(scale, 1.0), rtol=1e-4, name="d" + k)
    # separate runs of the kernel on each segment of row 0 (initial state only for the first, id 0)
    ids = seq_idx[0]
    for sid in ids.unique().tolist():
        sl = (ids == sid).nonzero().flatten()
        a, b = sl[0].item(), sl[-1].item() + 1
        part = {k: (v[:1, a:b] if k in ("x", "dt", "B", "C", "z") else v) for k, v in inp.items()}
        part["initial_states"] = inp["initial_states"][:1] if sid == 0 else None
        ys = mamba_chunk_scan_combined(part.pop("x"), part.pop("dt"), part.pop("A"), part.pop("B"),
                                       part.pop("C"), Q, **part, **FULL)
        assert_close_to_ref(y[:1, a:b].detach(), ys.double(), atol=1e-4, rtol=1e-4, name=f"segment {sid}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_reference_drift(dtype):
    """mamba_ssm's rule: err(kernel) <= 2 * err(reference run in bf16/fp16) + atol (states fp32)."""
    inp = _inputs(dtype=dtype, seqlen=64)
    y, f, grads = _run(_ours(**FULL), inp, NAMES)
    yr, fr, rgrads = _run(_ref(**FULL), _f64(inp), NAMES)
    lo = {k: (v.to(dtype) if v is not None else None) for k, v in inp.items()}
    yl, fl, lgrads = _run(_ref(**FULL), lo, NAMES)
    assert y.dtype == dtype and f.dtype == torch.float32
    assert_close_to_ref(y, yr, yl, name="y")
    assert_close_to_ref(f, fr, fl.float(), name="final_states")
    for k in ("x", "z", "B", "C", "dt"):
        assert_close_to_ref(grads[k], rgrads[k], lgrads[k], name="d" + k)
    for k in ("A", "D", "dt_bias", "initial_states"):  # fp32 sums: relative to their magnitude
        assert_close_to_ref(grads[k], rgrads[k], atol=2e-2 * rgrads[k].abs().max().item(), rtol=0, name="d" + k)


def test_long_sequence_bf16_finite():
    """seqlen 16,384 in bf16 with strong decay (dt ~ 4, dt*A ~ -6 per step, so chunk cumsums reach
    ~ -100: exp(cumsum) underflows to 0 and a ratio of exponentials would be 0/0): no overflow/NaN."""
    inp = _inputs(batch=1, seqlen=16384, dtype=torch.bfloat16, seed=3)
    inp["dt"] = (inp["dt"].float() + 5.0).to(torch.bfloat16)  # large dt -> large |dA| segment sums
    y, f, grads = _run(_ours(dt_softplus=True), inp, NAMES)
    assert torch.isfinite(y).all() and torch.isfinite(f).all()
    for k in NAMES:
        assert torch.isfinite(grads[k]).all(), k


def test_gradcheck_fp32_kernels():
    """Kernels are float32-only (states and accumulation are fp32 by design), so gradcheck runs the fp32
    op on tiny shapes with finite-difference step 1e-2 and tolerances sized for fp32 rounding."""
    g = torch.Generator().manual_seed(5)
    b, L, h, gr, p, n = 1, 6, 2, 1, 2, 3
    x = torch.randn(b, L, h, p, generator=g)
    dt = torch.randn(b, L, h, generator=g) * 0.3
    A = -torch.rand(h, generator=g) - 0.5
    B, C = torch.randn(b, L, gr, n, generator=g), torch.randn(b, L, gr, n, generator=g)
    D, z = torch.randn(h, generator=g), torch.randn(b, L, h, p, generator=g)
    bias, init = torch.randn(h, generator=g) * 0.1, torch.randn(b, h, p, n, generator=g)
    leaves = [t.requires_grad_() for t in (x, dt, A, B, C, D, z, bias, init)]

    def fn(x, dt, A, B, C, D, z, bias, init):
        y, f = mamba_chunk_scan_combined(x, dt, A, B, C, 4, D=D, z=z, dt_bias=bias, initial_states=init,
                                         dt_softplus=True, return_final_states=True)
        return y, f

    with pytest.warns(UserWarning):  # "not a double precision floating point" is expected here
        assert torch.autograd.gradcheck(fn, leaves, eps=1e-2, atol=2e-2, rtol=2e-2, nondet_tol=0.0)


def test_opcheck():
    inp = _inputs(batch=1, seqlen=20)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], Q, inp["D"], inp["z"], inp["dt_bias"],
            inp["initial_states"], None, True, [0.0, 2.0], False)
    torch.library.opcheck(torch.ops.tvm_mamba.ssd_fwd, args)
    y, f, dt_out, dA_cs, _, y_pre, _ = torch.ops.tvm_mamba.ssd_fwd(*args)
    bargs = (torch.randn_like(y), torch.randn_like(f), *args[:13], dt_out, dA_cs, None, y_pre)
    torch.library.opcheck(torch.ops.tvm_mamba.ssd_bwd, bargs,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("change, exc, match", [
    (dict(x=torch.zeros(2, 37, 4)), ValueError, "x"),
    (dict(x=torch.zeros(2, 37, 4, 8, dtype=torch.int32)), TypeError, "x"),
    (dict(dt=torch.zeros(2, 36, 4)), ValueError, "dt"),
    (dict(A=torch.zeros(3)), ValueError, "A"),
    (dict(B=torch.zeros(2, 37, 3, 16), C=torch.zeros(2, 37, 3, 16)), ValueError, "ngroups"),
    (dict(C=torch.zeros(2, 37, 2, 8)), ValueError, "C"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(chunk_size=2.0), TypeError, "chunk_size"),
    (dict(D=torch.zeros(4, 3)), ValueError, "D"),
    (dict(z=torch.zeros(2, 37, 4, 7)), ValueError, "z"),
    (dict(dt_bias=torch.zeros(5)), ValueError, "dt_bias"),
    (dict(initial_states=torch.zeros(2, 4, 8, 15)), ValueError, "initial_states"),
    (dict(seq_idx=torch.zeros(2, 37, dtype=torch.int64)), TypeError, "seq_idx"),
    (dict(seq_idx=torch.zeros(2, 36, dtype=torch.int32)), ValueError, "seq_idx"),
    (dict(dt_limit=(1.0, 0.5)), ValueError, "dt_limit"),
    (dict(dt_limit=(float("nan"), 1.0)), ValueError, "dt_limit"),
    (dict(dt_limit=3.0), TypeError, "dt_limit"),
])
def test_bad_inputs_raise_before_any_kernel(change, exc, match, monkeypatch):
    from tvm_mamba.torch_ops import _dlpack, ssd

    def no_kernel(*a, **k):
        raise AssertionError("a kernel was requested before validation finished")

    monkeypatch.setattr(ssd, "kernel_for", no_kernel)
    monkeypatch.setattr(_dlpack, "kernel_for", no_kernel)
    inp = _inputs()
    args = dict(x=inp["x"], dt=inp["dt"], A=inp["A"], B=inp["B"], C=inp["C"], chunk_size=Q, D=inp["D"],
                z=inp["z"], dt_bias=inp["dt_bias"], initial_states=inp["initial_states"])
    args.update(change)
    with pytest.raises(exc, match=match):
        mamba_chunk_scan_combined(**args)


def test_final_states_only_gradient():
    """A loss on final_states alone still reaches x, dt, B and initial_states (y's gradient is None)."""
    inp = _inputs(seqlen=33)
    leaves = {k: v.clone().requires_grad_() for k, v in inp.items()}
    _, f = mamba_chunk_scan_combined(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], Q,
                                     D=leaves["D"], z=leaves["z"], dt_bias=leaves["dt_bias"],
                                     initial_states=leaves["initial_states"], return_final_states=True, **FULL)
    f.sum().backward()
    ref = {k: v.double().clone().requires_grad_() for k, v in inp.items()}
    _, fr = ssd_recurrence_ref(**ref, return_final_states=True, **FULL)
    fr.sum().backward()
    for k in ("x", "dt", "B", "initial_states", "A"):
        scale = ref[k].grad.abs().max().item()
        assert_close_to_ref(leaves[k].grad, ref[k].grad, atol=2e-5 * max(scale, 1.0), rtol=1e-4, name="d" + k)
    assert torch.all(leaves["C"].grad == 0) and torch.all(leaves["z"].grad == 0)  # y is not used
