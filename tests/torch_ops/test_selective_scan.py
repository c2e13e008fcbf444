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
    st = torch.randn(2, 4, 1, 16)
    uargs = (st, torch.randn(2, 4, 1), torch.rand(2, 4, 1), -torch.rand(4, 1, 16), torch.randn(2, 1, 16),
             torch.randn(2, 1, 16), None, None, None, False)
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
    (lambda p: p.update(A=torch.randn(4, 16, dtype=torch.complex64)), ValueError, "complex"),
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
        selective_state_update(torch.zeros(3, 4, 16), x, x, A, B, B)
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
