"""selective_scan_fn / selective_state_update against the float64 step-by-step reference."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close_to_ref
from tvm_mamba.reference.selective_scan import selective_scan_ref, selective_state_update_ref
from tvm_mamba.torch_ops.selective_scan import chunk_for, selective_scan_fn, selective_state_update

# (name, batch, dim, dstate, seqlen, B kind, C kind, D, z, delta_bias, softplus, initial_state)
# kinds: "const" (dim, dstate), "var" (batch, dstate, L), ("grp", g) (batch, g, dstate, L)
CONFIGS = {
    "var_const_all": (2, 4, 16, 150, "var", "const", True, True, True, True, True),  # 4 checkpoint chunks of 48
    "grp_var_bare": (2, 4, 8, 131, ("grp", 2), "var", False, False, False, False, False),
    "const_const_z": (1, 3, 4, 67, "const", "const", False, True, False, True, False),
    # dim % 16 == 0: the CPU forward runs the channels-vectorized layout
    "channels_grp_all": (2, 32, 16, 100, ("grp", 2), "var", True, True, True, True, True),
}


def _bc(kind, batch, dim, dstate, seqlen, dtype, g):
    if kind == "const":
        return torch.randn(dim, dstate, generator=g).to(dtype)
    if kind == "var":
        return torch.randn(batch, dstate, seqlen, generator=g).to(dtype)
    return torch.randn(batch, kind[1], dstate, seqlen, generator=g).to(dtype)


def make_inputs(cfg, dtype=torch.float32, seqlen=None, seed=0):
    batch, dim, dstate, L, bk, ck, hasD, hasz, hasdb, sp, hasinit = cfg
    L = seqlen or L
    g = torch.Generator().manual_seed(seed)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    x = dict(
        u=torch.randn(batch, dim, L, generator=g).to(dtype),
        delta=(0.5 * torch.randn(batch, dim, L, generator=g) - (0 if sp else -0.7)).abs().to(dtype)
        if not sp else (0.5 * torch.randn(batch, dim, L, generator=g)).to(dtype),
        A=(-0.2 - torch.rand(dim, dstate, generator=g)).to(acc),
        B=_bc(bk, batch, dim, dstate, L, dtype, g), C=_bc(ck, batch, dim, dstate, L, dtype, g),
        D=torch.randn(dim, generator=g).to(acc) if hasD else None,
        z=torch.randn(batch, dim, L, generator=g).to(dtype) if hasz else None,
        delta_bias=(0.1 * torch.randn(dim, generator=g)).to(acc) if hasdb else None,
        delta_softplus=sp,
        initial_state=torch.randn(batch, dim, dstate, generator=g).to(acc) if hasinit else None,
    )
    return x


TENSORS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


def run_both(inp, grads=True, seed=1):
    """(kernel out, last, grads) and (reference ...) with random dout and dlast."""
    ours = {k: (v.clone().requires_grad_(grads) if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    ref = {k: (v.double().requires_grad_(grads) if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    out, last = selective_scan_fn(**ours, return_last_state=True)
    rout, rlast = selective_scan_ref(**ref, return_last_state=True)
    res = {"out": (out, rout), "last_state": (last, rlast)}
    if grads:
        g = torch.Generator().manual_seed(seed)
        dout = torch.randn(out.shape, generator=g)
        dlast = torch.randn(last.shape, generator=g)
        torch.autograd.backward([out, last], [dout.to(out.dtype), dlast.to(last.dtype)])
        torch.autograd.backward([rout, rlast], [dout.to(out.dtype).double(), dlast.double()])
        for k in TENSORS:
            if isinstance(ours[k], torch.Tensor):
                res["d" + k] = (ours[k].grad, ref[k].grad)
    return res


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_and_every_gradient_fp32(name):
    res = run_both(make_inputs(CONFIGS[name]))
    assert {"dA", "dB", "dC", "du", "ddelta"} <= set(res)
    for key, (mine, ref) in res.items():
        scale = max(1.0, ref.abs().max().item())
        assert_close_to_ref(mine, ref, atol=2e-5 * scale, rtol=1e-4, name=f"{name}:{key}")


def test_bf16_forward_and_gradients():
    cfg = CONFIGS["var_const_all"]
    inp = make_inputs(cfg, dtype=torch.bfloat16)
    res = run_both(inp)
    # reference run in bf16-rounded inputs but float32 math: the drift of bf16 storage of out/grads
    low = {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    rl_out = selective_scan_ref(**low, dtype=torch.float32).to(torch.bfloat16)
    assert_close_to_ref(res["out"][0], res["out"][1], rl_out, name="out")
    for key in ("du", "ddelta", "dB", "dz", "dA", "dC", "dinitial_state", "last_state"):
        mine, ref = res[key]
        scale = max(1.0, ref.abs().max().item())
        # gradients are stored in bf16 (u/delta/z/B): 2^-8 relative rounding, plus fp32 accumulation
        tol = (1e-2 if mine.dtype == torch.bfloat16 else 1e-4) * scale
        assert (mine.double() - ref).abs().max().item() <= tol, key


def test_backward_is_deterministic():
    inp = make_inputs(CONFIGS["channels_grp_all"], seqlen=40)
    runs = [run_both(inp) for _ in range(2)]
    for key in runs[0]:
        assert torch.equal(runs[0][key][0], runs[1][key][0]), key  # bitwise: fixed-order reductions


@pytest.mark.parametrize("name,seqlen", [("var_const_all", None), ("channels_grp_all", None),
                                         ("var_const_all", 30)])
def test_backward_keeps_no_states_and_rebuilds_them_bitwise(name, seqlen):
    """Autograd keeps the inputs only (no checkpoints: upstream keeps one state per 2048 steps); the backward
    op, given None, rebuilds the checkpoints with the forward kernel: gradients bitwise equal to passing the
    forward's own checkpoints (one chunk, seqlen <= 48: the initial state is the only checkpoint)."""
    inp = make_inputs(CONFIGS[name], seqlen=seqlen)
    leaves = {k: (v.clone().requires_grad_() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        selective_scan_fn(**leaves)
    inputs = {t.data_ptr() for t in leaves.values() if isinstance(t, torch.Tensor)}
    assert saved and all(x.data_ptr() in inputs for x in saved)
    args = tuple(inp[k] for k in TENSORS)
    _, _, ck = torch.ops.tvm_mamba.selective_scan_fwd(*args, inp["delta_softplus"])
    dout, dlast = torch.randn_like(inp["u"]), torch.randn(ck.shape[0], ck.shape[1], ck.shape[3])
    given = torch.ops.tvm_mamba.selective_scan_bwd(*args, ck, dout, dlast, inp["delta_softplus"])
    rebuilt = torch.ops.tvm_mamba.selective_scan_bwd(*args, None, dout, dlast, inp["delta_softplus"])
    for a, b in zip(given, rebuilt):
        assert torch.equal(a, b)


def test_chaining_with_initial_state_equals_whole():
    cfg = CONFIGS["var_const_all"]
    inp = make_inputs(cfg, seqlen=150)
    whole, last = selective_scan_fn(**inp, return_last_state=True)
    cut = 77  # odd split, not a chunk boundary

    def part(sl, init):
        p = dict(inp)
        for k in ("u", "delta", "z"):
            p[k] = inp[k][..., sl].contiguous()
        p["B"] = inp["B"][..., sl].contiguous()
        p["initial_state"] = init
        return selective_scan_fn(**p, return_last_state=True)

    o1, s1 = part(slice(0, cut), inp["initial_state"])
    o2, s2 = part(slice(cut, None), s1)
    torch.testing.assert_close(torch.cat([o1, o2], -1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s2, last, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seqlen", [1, 48, 49])
def test_short_and_chunk_edge_lengths(seqlen):
    res = run_both(make_inputs(CONFIGS["var_const_all"], seqlen=seqlen))
    for key, (mine, ref) in res.items():
        assert_close_to_ref(mine, ref, atol=2e-5 * max(1.0, ref.abs().max().item()), name=key)


def test_gradcheck_float64():
    cfg = (1, 2, 4, 11, ("grp", 2), "var", True, True, True, True, True)
    inp = make_inputs(cfg, dtype=torch.float64)
    assert chunk_for(4) < 11 or True
    names = [k for k in TENSORS if inp[k] is not None]

    def fn(*ts):
        kw = dict(inp, **dict(zip(names, ts)))
        out, last = selective_scan_fn(**kw, return_last_state=True)
        return out, last

    ts = [inp[k].clone().requires_grad_() for k in names]
    assert torch.autograd.gradcheck(fn, ts, eps=1e-6, atol=1e-6)


def test_opcheck_custom_ops():
    inp = make_inputs(CONFIGS["grp_var_bare"], seqlen=20)
    args = (inp["u"], inp["delta"], inp["A"], inp["B"], inp["C"], None, None, None, None, False)
    torch.library.opcheck(torch.ops.tvm_mamba.selective_scan_fwd, args)
    inp2 = make_inputs(CONFIGS["var_const_all"], seqlen=20)
    args2 = tuple(inp2[k] for k in TENSORS) + (True,)
    a2 = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args2]
    torch.library.opcheck(torch.ops.tvm_mamba.selective_scan_fwd, tuple(a2))
    _, _, ck = torch.ops.tvm_mamba.selective_scan_fwd(*args2)
    bargs = tuple(inp2[k] for k in TENSORS) + (ck, torch.randn_like(inp2["u"]), None, True)
    torch.library.opcheck(torch.ops.tvm_mamba.selective_scan_bwd, bargs)
    torch.library.opcheck(torch.ops.tvm_mamba.selective_scan_bwd, bargs[:9] + (None,) + bargs[10:])
    st = torch.randn(2, 4, 1, 16)
    uargs = (st, torch.randn(2, 4, 1), torch.rand(2, 4, 1), -torch.rand(4, 1, 16), torch.randn(2, 1, 16),
             torch.randn(2, 1, 16), None, None, None, False, None)
    torch.library.opcheck(torch.ops.tvm_mamba.selective_state_update, uargs,
                          test_utils=("test_schema", "test_faketensor"))


def test_decode_steps_match_full_scan_mamba1():
    cfg = CONFIGS["var_const_all"]
    inp = make_inputs(cfg, seqlen=6)
    inp["C"] = torch.randn(2, 16, 6)  # time-varying C as in Mamba-1 decode
    full, last = selective_scan_fn(**inp, return_last_state=True)
    state = inp["initial_state"].clone()
    for t in range(6):
        y = selective_state_update(state, inp["u"][..., t], inp["delta"][..., t], inp["A"],
                                   inp["B"][..., t], inp["C"][..., t], inp["D"], inp["z"][..., t],
                                   inp["delta_bias"], True)
        torch.testing.assert_close(y, full[..., t], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, last, atol=1e-5, rtol=1e-5)


def test_decode_step_mamba2_heads_groups():
    g = torch.Generator().manual_seed(3)
    batch, nheads, headdim, dstate, ngroups = 2, 4, 3, 8, 2
    state = torch.randn(batch, nheads, headdim, dstate, generator=g)
    x, dt, z = (torch.randn(batch, nheads, headdim, generator=g) for _ in range(3))
    A = -torch.rand(nheads, headdim, dstate, generator=g)
    B, C = (torch.randn(batch, ngroups, dstate, generator=g) for _ in range(2))
    D, dtb = (torch.randn(nheads, headdim, generator=g) for _ in range(2))
    ref_out, ref_state = selective_state_update_ref(state, x, dt, A, B, C, D, z, dtb, True)
    st = state.clone()
    out = selective_state_update(st, x, dt, A, B, C, D, z, dtb, True)
    assert_close_to_ref(out, ref_out, name="out")
    assert_close_to_ref(st, ref_state, name="state")


def test_long_sequence_65536_is_stable():
    cfg = (1, 2, 4, 65536, "const", "const", False, False, False, True, False)
    inp = make_inputs(cfg)
    out, last = selective_scan_fn(**inp, return_last_state=True)
    assert torch.isfinite(out).all() and torch.isfinite(last).all()
    rout, rlast = selective_scan_ref(**{k: (v.double() if isinstance(v, torch.Tensor) else v)
                                        for k, v in inp.items()}, return_last_state=True)
    assert_close_to_ref(out, rout, atol=1e-4 * max(1.0, rout.abs().max().item()), name="out")
    assert_close_to_ref(last, rlast, atol=1e-4 * max(1.0, rlast.abs().max().item()), name="last")


def test_dstate_512_slow_path_correct():
    cfg = (1, 2, 512, 20, "var", "const", True, False, False, True, False)
    assert chunk_for(512) == 8  # more, smaller chunks keep the backward's per-lane state buffer bounded
    res = run_both(make_inputs(cfg))
    for key, (mine, ref) in res.items():
        assert_close_to_ref(mine, ref, atol=2e-5 * max(1.0, ref.abs().max().item()), name=key)


def _good():
    return make_inputs(CONFIGS["var_const_all"], seqlen=8)


@pytest.mark.parametrize("mutate,exc,arg", [
    (lambda p: p.update(delta=p["delta"].double()), TypeError, "delta"),
    (lambda p: p.update(u=p["u"][0]), ValueError, "u"),
    (lambda p: p.update(z=p["z"][..., :4]), ValueError, "z"),
    (lambda p: p.update(A=torch.randn(5, 16)), ValueError, "A"),
    (lambda p: p.update(A=torch.randn(4, 16, dtype=torch.complex64)), ValueError, "B"),  # B: (.., 2 seqlen)
    (lambda p: p.update(B=torch.randn(2, 3, 16, 8)), ValueError, "B"),
    (lambda p: p.update(C=torch.randn(2, 16, 7)), ValueError, "C"),
    (lambda p: p.update(D=torch.randn(3)), ValueError, "D"),
    (lambda p: p.update(delta_bias=torch.randn(4, dtype=torch.float16)), TypeError, "delta_bias"),
    (lambda p: p.update(initial_state=torch.randn(2, 4, 8)), ValueError, "initial_state"),
    (lambda p: p.update(B=[1, 2]), TypeError, "B"),
])
def test_bad_inputs_name_the_argument(mutate, exc, arg, monkeypatch):
    import tvm_mamba.torch_ops._dlpack as dl

    monkeypatch.setattr(dl, "build_and_load", lambda key: pytest.fail("kernel built before validation"))
    p = _good()
    mutate(p)
    with pytest.raises(exc, match=arg):
        selective_scan_fn(**p)


def test_bad_state_update_inputs():
    state = torch.zeros(2, 4, 16)
    x = torch.randn(2, 4)
    A = -torch.rand(4, 16)
    B = torch.randn(2, 16)
    with pytest.raises(ValueError, match="state"):
        selective_state_update(torch.zeros(1, 4, 16), x, x, A, B, B)
    with pytest.raises(ValueError, match="groups"):
        selective_state_update(state, x, x, A, torch.randn(2, 3, 16), torch.randn(2, 3, 16))
    with pytest.raises(TypeError, match="state"):
        selective_state_update(state.double(), x, x, A, B, B)


# --- chunked (parallel-in-time) forward -------------------------------------------------------------------
def test_forward_algorithm_dispatch_by_shape():
    from tvm_mamba.torch_ops.selective_scan import fwd_direction

    assert fwd_direction(1, 16, 4096, 48, "cpu", cores=2) == "fwd"  # 2 cores: the chunked scan never pays
    assert fwd_direction(1, 16, 4096, 48, "cpu", cores=64) == "fwd_chunked"  # 1 channel-lane, 64 cores
    assert fwd_direction(1, 4, 4096, 48, "cpu", cores=2) == "fwd"  # 4 dstate-lanes fill 2 cores
    assert fwd_direction(8, 256, 4096, 48, "cpu", cores=64) == "fwd"  # 128 channel-lanes keep 64 cores busy
    assert fwd_direction(1, 16, 100, 48, "cpu", cores=64) == "fwd"  # too short to split
    assert fwd_direction(1, 16, 4096, 48, "cuda", cores=64) == "fwd"


@pytest.mark.parametrize("name", ["var_const_all", "grp_var_bare"])
def test_chunked_forward_matches_reference_with_every_gradient(name, monkeypatch):
    """Force the chunked path (as on a many-core host) and check forward, last state and every gradient
    (the backward recomputes from the checkpoints the chunked carry pass wrote)."""
    import tvm_mamba
    from tvm_mamba.torch_ops import selective_scan as ops

    monkeypatch.setattr(ops, "_cores", lambda: 64)
    inp = make_inputs(CONFIGS[name], seqlen=301)  # 7 chunks of 48, the last one partial
    batch, dim = inp["u"].shape[:2]
    assert ops.fwd_direction(batch, dim, 301, chunk_for(inp["A"].shape[1]), "cpu") == "fwd_chunked"
    res = run_both(inp)
    for key, (mine, ref) in res.items():
        scale = max(1.0, ref.abs().max().item())
        assert_close_to_ref(mine, ref, atol=2e-5 * scale, rtol=1e-4, name=f"chunked {name}:{key}")
    args = {k: v for k, v in inp.items()}
    assert "selective_scan.fwd_chunked" in tvm_mamba.explain(selective_scan_fn, **args)


def test_chunked_forward_long_sequence_stable(monkeypatch):
    from tvm_mamba.torch_ops import selective_scan as ops

    monkeypatch.setattr(ops, "_cores", lambda: 64)
    inp = make_inputs(CONFIGS["const_const_z"], seqlen=16384)
    out, last = selective_scan_fn(**inp, return_last_state=True)
    ref = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    rout, rlast = selective_scan_ref(**ref, return_last_state=True)
    assert torch.isfinite(out).all() and torch.isfinite(last).all()
    assert (out.double() - rout).abs().max().item() < 1e-3 * max(1.0, rout.abs().max().item())
    assert (last.double() - rlast).abs().max().item() < 1e-3 * max(1.0, rlast.abs().max().item())


# --- selective_state_update: state pools (state_batch_indices), 16-bit states, mixed dtypes ----------------
def _update_args(heads: bool, batch: int, nslots: int, seed: int = 0, state_dtype=torch.float32):
    """(state pool, kwargs) for selective_state_update: Mamba-2 heads (4 heads x 3, 2 groups) or Mamba-1
    (dim 5, B/C (batch, dstate)); dstate 8."""
    g = torch.Generator().manual_seed(seed)
    lead = (4, 3) if heads else (5,)
    bc = (batch, 2, 8) if heads else (batch, 8)
    state = torch.randn(nslots, *lead, 8, generator=g).to(state_dtype)
    kw = dict(x=torch.randn(batch, *lead, generator=g), dt=0.5 * torch.randn(batch, *lead, generator=g),
              A=-0.2 - torch.rand(*lead, 8, generator=g), B=torch.randn(*bc, generator=g),
              C=torch.randn(*bc, generator=g), D=torch.randn(*lead, generator=g),
              z=torch.randn(batch, *lead, generator=g), dt_bias=0.1 * torch.randn(*lead, generator=g),
              dt_softplus=True)
    return state, kw


@pytest.mark.parametrize("heads,idx_dtype", [(True, torch.int32), (False, torch.int64)])
def test_state_batch_indices_pick_slots_of_a_pool(heads, idx_dtype):
    """mamba_ssm 2.3.2: row b updates slot idx[b]; a negative index is a padding row (out 0, nothing written);
    slots no row names stay bitwise untouched."""
    state, kw = _update_args(heads, batch=4, nslots=7)
    idx = torch.tensor([5, -1, 0, 3], dtype=idx_dtype)
    before = state.clone()
    ref_out, ref_pool = selective_state_update_ref(before, **kw, state_batch_indices=idx)
    out = selective_state_update(state, **kw, state_batch_indices=idx)
    assert_close_to_ref(out, ref_out, name="out")
    assert_close_to_ref(state, ref_pool, name="pool")
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(state[[1, 2, 4, 6]], before[[1, 2, 4, 6]])
    plain = before[[5, 0, 0, 3]].clone()  # the same rows without a pool give the same outputs
    out_plain = selective_state_update(plain, **kw)
    torch.testing.assert_close(out[[0, 2, 3]], out_plain[[0, 2, 3]], rtol=0, atol=0)


def test_state_batch_indices_tied_heads_mamba2():
    """Mamba2.step's call: A, dt, dt_bias, D expanded per head (stride-0 views), as upstream's TIE_HDIM path."""
    g = torch.Generator().manual_seed(5)
    nh, p, n = 3, 4, 8
    state = torch.randn(6, nh, p, n, generator=g)
    A = (-torch.rand(nh, generator=g))[:, None, None].expand(nh, p, n)
    dt = torch.randn(2, nh, generator=g)[:, :, None].expand(2, nh, p)
    dtb = torch.randn(nh, generator=g)[:, None].expand(nh, p)
    D = torch.randn(nh, generator=g)[:, None].expand(nh, p)
    x, z = torch.randn(2, nh, p, generator=g), torch.randn(2, nh, p, generator=g)
    B, C = torch.randn(2, 1, n, generator=g), torch.randn(2, 1, n, generator=g)
    idx = torch.tensor([4, 1], dtype=torch.int32)
    ref_out, ref_pool = selective_state_update_ref(state, x, dt, A, B, C, D, z, dtb, True, state_batch_indices=idx)
    out = selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dtb, dt_softplus=True,
                                 state_batch_indices=idx)
    assert_close_to_ref(out, ref_out, name="out")
    assert_close_to_ref(state, ref_pool, name="pool")


@pytest.mark.parametrize("bad,exc,match", [
    (torch.tensor([0, 7, 1]), ValueError, "state_batch_indices: index 7 is out of range"),
    (torch.tensor([2, -1, 2]), ValueError, "state_batch_indices: two rows"),
    (torch.tensor([0, 1]), ValueError, "state_batch_indices"),
    (torch.tensor([0.0, 1.0, 2.0]), TypeError, "state_batch_indices"),
])
def test_bad_state_batch_indices_refused_before_anything_runs(bad, exc, match, monkeypatch):
    import tvm_mamba.torch_ops._dlpack as dl

    state, kw = _update_args(True, batch=3, nslots=7)
    before = state.clone()
    monkeypatch.setattr(dl, "build_and_load", lambda key: pytest.fail("kernel built before validation"))
    with pytest.raises(exc, match=match):
        selective_state_update(state, **kw, state_batch_indices=bad)
    assert torch.equal(state, before)


def test_larger_state_without_indices_uses_its_first_rows():
    """mamba_ssm's Triton kernel indexes the state by the row number: rows >= batch stay untouched."""
    state, kw = _update_args(True, batch=3, nslots=5, seed=8)
    before = state.clone()
    ref_out, ref_state = selective_state_update_ref(before[:3], **kw)
    out = selective_state_update(state, **kw)
    assert_close_to_ref(out, ref_out, name="out")
    assert_close_to_ref(state[:3], ref_state, name="state")
    assert torch.equal(state[3:], before[3:])
    with pytest.raises(ValueError, match="state: expected at least 3 rows"):
        selective_state_update(state[:2], **kw)


@pytest.mark.parametrize("state_dtype,heads", [(torch.bfloat16, True), (torch.float16, False)])
def test_16bit_state_kept_in_its_dtype(state_dtype, heads):
    """8 decode steps on a 16-bit state (math in fp32, rounded once per step): error against the float64
    unrounded recurrence <= 2x that of the reference that rounds its state the same way + atol."""
    state, kw = _update_args(heads, batch=3, nslots=3, seed=2, state_dtype=state_dtype)
    ref64, ref_low = state.double(), state.double()
    for step in range(8):
        kw["x"] = torch.randn_like(kw["x"])
        out = selective_state_update(state, **kw)
        o64, ref64 = selective_state_update_ref(ref64, **kw)
        olow, ref_low = selective_state_update_ref(ref_low, **kw, state_dtype=state_dtype)
        assert_close_to_ref(out, o64, olow, atol=1e-5, name=f"out[{step}]")
    assert state.dtype == state_dtype
    assert_close_to_ref(state, ref64, ref_low, atol=1e-5, name="state")
    assert (state.double() - ref_low).abs().max().item() <= 2 ** -7 * ref_low.abs().max().item()


def test_mixed_input_dtypes_as_upstream_allows():
    """mamba_ssm's Triton kernel widens every input to fp32: x bf16, dt fp32, z fp16, B bf16, C fp32, A fp16,
    D bf16 and dt_bias fp32 together (out in x's dtype), with a bf16 state pool."""
    state, kw = _update_args(True, batch=2, nslots=4, seed=4, state_dtype=torch.bfloat16)
    kw.update(x=kw["x"].bfloat16(), z=kw["z"].half(), B=kw["B"].bfloat16(), A=kw["A"].half(),
              D=kw["D"].bfloat16())
    idx = torch.tensor([3, 0])
    before = state.clone()
    out = selective_state_update(state, **kw, state_batch_indices=idx)
    o64, pool64 = selective_state_update_ref(before, **kw, state_batch_indices=idx)
    olow, pool_low = selective_state_update_ref(before, **kw, state_batch_indices=idx, state_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert_close_to_ref(out, o64, o64.to(torch.bfloat16), name="out")
    assert_close_to_ref(state, pool64, pool_low, atol=1e-5, name="pool")


def test_state_update_with_indices_opcheck_and_compile():
    state, kw = _update_args(True, batch=2, nslots=3, seed=6, state_dtype=torch.bfloat16)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    args = (state, kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["dt_bias"], True, idx)
    torch.library.opcheck(torch.ops.tvm_mamba.selective_state_update, args,
                          test_utils=("test_schema", "test_faketensor"))
    eager_state, comp_state = state.clone(), state.clone()
    want = selective_state_update(eager_state, **kw, state_batch_indices=idx)
    fn = torch.compile(selective_state_update, fullgraph=True, backend="aot_eager")
    got = fn(comp_state, **kw, state_batch_indices=idx)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(comp_state, eager_state, rtol=0, atol=0)


# --- selective_state_update: tied per-head A / dt / D / dt_bias (mamba_ssm's TIE_HDIM) ---------------------
def _tied_args(batch: int, dtype, seed: int = 9, nh: int = 4, p: int = 3, n: int = 16):
    """(state, kwargs) as Mamba2.step passes them: A, dt, D, dt_bias one value per head, expanded stride-0
    views over headdim (and dstate for A); x, z, B, C in ``dtype``; 2 groups."""
    g = torch.Generator().manual_seed(seed)
    state = torch.randn(batch, nh, p, n, generator=g)
    kw = dict(x=torch.randn(batch, nh, p, generator=g).to(dtype),
              dt=(0.5 * torch.randn(batch, nh, generator=g)).to(dtype)[:, :, None].expand(batch, nh, p),
              A=(-0.2 - torch.rand(nh, generator=g))[:, None, None].expand(nh, p, n),
              B=torch.randn(batch, 2, n, generator=g).to(dtype), C=torch.randn(batch, 2, n, generator=g).to(dtype),
              D=torch.randn(nh, generator=g)[:, None].expand(nh, p), z=torch.randn(batch, nh, p, generator=g).to(dtype),
              dt_bias=(0.1 * torch.randn(nh, generator=g))[:, None].expand(nh, p), dt_softplus=True)
    return state, kw


def _update_keys(state, kw):
    from tvm_mamba.tools.simcheck import recording

    with recording() as keys:
        out = selective_state_update(state, **kw)
    return out, [k for k in keys if k.direction == "update"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_heads_run_the_tied_kernel(dtype):
    """3 decode steps through the tie_hdim kernel against the float64 reference (bf16: within 2x the drift
    of the reference run on bf16-rounded inputs, fp32 math)."""
    state, kw = _tied_args(batch=3, dtype=dtype)
    ref64 = state.double()
    for step in range(3):
        kw["x"] = torch.randn_like(kw["x"])
        out, keys = _update_keys(state, kw)
        assert keys and all(k.static.get("tie_hdim") is True for k in keys)
        o64, ref64 = selective_state_update_ref(ref64, **kw)
        if dtype == torch.float32:
            assert_close_to_ref(out, o64, name=f"out[{step}]")
        else:  # the inputs are bf16 values already: the reference's own bf16 error is the output rounding
            assert_close_to_ref(out, o64, o64.to(dtype), atol=1e-5, name=f"out[{step}]")
    assert_close_to_ref(state, ref64, name="state")


@pytest.mark.parametrize("absent", ["D", "dt_bias", "both"])
def test_tied_heads_without_D_or_dt_bias(absent):
    """The tied kernel with D and / or dt_bias absent (Mamba2.step with a binding dt_limit passes no dt_bias):
    its placeholders have the kernel's rank (this failed with 'Mismatched dtb.ndim'), same results as the
    float64 reference."""
    state, kw = _tied_args(batch=2, dtype=torch.float32, seed=14)
    for name in (("D", "dt_bias") if absent == "both" else (absent,)):
        kw[name] = None
    before = state.clone()
    out, keys = _update_keys(state, kw)
    assert keys and all(k.static.get("tie_hdim") is True for k in keys)
    o64, s64 = selective_state_update_ref(before, **kw)
    assert_close_to_ref(out, o64, name="out")
    assert_close_to_ref(state, s64, name="state")


@pytest.mark.parametrize("untie", ["D", "dt", "A"])
def test_partly_tied_heads_run_the_general_kernel(untie):
    """A call where only some per-head tensors are tied (Mamba2 D_has_hdim's D (nheads, headdim), a full dt
    or A) runs the untied kernel, with the same results."""
    state, kw = _tied_args(batch=2, dtype=torch.float32, seed=11)
    if untie == "D":
        kw["D"] = torch.randn(4, 3)
    elif untie == "dt":
        kw["dt"] = kw["dt"] + 0.1 * torch.randn(2, 4, 3)
    else:
        kw["A"] = kw["A"] - torch.rand(4, 3, 16)
    before = state.clone()
    out, keys = _update_keys(state, kw)
    assert keys and all("tie_hdim" not in k.static for k in keys)
    o64, s64 = selective_state_update_ref(before, **kw)
    assert_close_to_ref(out, o64, name="out")
    assert_close_to_ref(state, s64, name="state")


def test_tied_heads_call_copies_nothing():
    """The tied call reads A / dt / D / dt_bias in place: no aten::copy_ / clone in the call (before the tied
    kernel, prepare() materialised each expanded view: 4 copies per step). x, z, B, C are compact here."""
    state, kw = _tied_args(batch=2, dtype=torch.float32, seed=12)
    selective_state_update(state, **kw)  # build / load the kernel outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        selective_state_update(state, **kw)
    copies = [e.name for e in prof.events() if e.name in ("aten::copy_", "aten::clone", "aten::contiguous")]
    assert copies == [], copies


def test_tied_heads_opcheck_and_compile():
    """The op's tied form (1-D A, (batch, nheads) dt, (nheads,) D / dt_bias) passes opcheck; the public call
    on stride-0 views compiles without a graph break and matches eager bitwise."""
    state, kw = _tied_args(batch=2, dtype=torch.float32, seed=13)
    args = (state.clone(), kw["x"], kw["dt"][:, :, 0], kw["A"][:, 0, 0], kw["B"], kw["C"], kw["D"][:, 0], kw["z"],
            kw["dt_bias"][:, 0], True, None)
    torch.library.opcheck(torch.ops.tvm_mamba.selective_state_update, args,
                          test_utils=("test_schema", "test_faketensor"))
    eager_state, comp_state = state.clone(), state.clone()
    want = selective_state_update(eager_state, **kw)
    got = torch.compile(selective_state_update, fullgraph=True, backend="aot_eager")(comp_state, **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(comp_state, eager_state, rtol=0, atol=0)
