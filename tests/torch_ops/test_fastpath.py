"""torch_ops/_fastpath.py: a repeated decode-step call runs its prepared launch, bitwise equal to the full path,
checking index values every time; anything the recipe cannot stand for takes the full path."""
from __future__ import annotations

import contextlib

import pytest
import torch

import tvm_mamba
from tvm_mamba.reference.causal_conv1d import causal_conv1d_update_ref
from tvm_mamba.reference.selective_scan import selective_state_update_ref
from tvm_mamba.runtime import dispatch
from tvm_mamba.torch_ops import causal_conv1d as conv_ops
from tvm_mamba.torch_ops import selective_scan as scan_ops
from tvm_mamba.torch_ops._dlpack import capture_launches


@pytest.fixture
def full_calls(monkeypatch):
    """Counts the full-path calls of both ops (a recipe call makes none)."""
    calls = []
    for fast in (scan_ops._SSU_FAST, conv_ops._UPDATE_FAST):
        fast.clear()
        full = fast.full
        monkeypatch.setattr(fast, "full", lambda *a, _full=full: calls.append(_full) or _full(*a))
    yield calls
    for fast in (scan_ops._SSU_FAST, conv_ops._UPDATE_FAST):
        fast.clear()


def _ssu_inputs(batch=3, pool=5, H=2, P=4, N=8, G=1, dtype=torch.float32, tied=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    state = r(pool, H, P, N).to(dtype)
    x, z, B, C = r(batch, H, P).to(dtype), r(batch, H, P).to(dtype), r(batch, G, N).to(dtype), r(batch, G, N).to(dtype)
    if tied:
        dt = torch.rand(batch, H, generator=g).to(dtype)[:, :, None].expand(-1, -1, P)
        A = (-torch.rand(H, generator=g))[:, None, None].expand(-1, P, N)
        D, dt_bias = r(H)[:, None].expand(-1, P), r(H)[:, None].expand(-1, P)
    else:
        dt, A = torch.rand(batch, H, P, generator=g).to(dtype), -torch.rand(H, P, N, generator=g)
        D, dt_bias = r(H, P), r(H, P)
    idx = torch.tensor([4, -1, 1][:batch], dtype=torch.int32)
    return state, (x, dt, A, B, C, D, z, dt_bias)


def _ssu(state, rest, idx, **kw):
    x, dt, A, B, C, D, z, dt_bias = rest
    return tvm_mamba.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus=True,
                                            state_batch_indices=idx, **kw)


@pytest.mark.parametrize("dtype, tied", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_selective_state_update_recipe_equals_the_full_path(full_calls, dtype, tied):
    state, rest = _ssu_inputs(dtype=dtype, tied=tied)
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    states, outs = [], []
    for _ in range(3):  # the first call watched, the next two from the recipe
        s = state.clone()
        outs.append(_ssu(s, rest, idx))
        states.append(s)
    assert len(full_calls) == 1
    for s, o in zip(states[1:], outs[1:]):
        assert torch.equal(s, states[0]) and torch.equal(o, outs[0])
    want_out, want_state = selective_state_update_ref(state.double(), *[t.double() for t in rest[:3]],
                                                      *[t.double() for t in rest[3:5]], rest[5].double(),
                                                      rest[6].double(), rest[7].double(), dt_softplus=True,
                                                      state_batch_indices=idx)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1].double(), want_out, **tol)
    torch.testing.assert_close(states[1].double(), want_state, **tol)
    assert torch.equal(outs[1][1], torch.zeros_like(outs[1][1]))  # the padding row
    assert torch.equal(states[1][[0, 2, 3]], state[[0, 2, 3]])  # slots no row names: untouched


def test_mamba1_layout_returns_a_view_of_the_fresh_output(full_calls):
    g = torch.Generator().manual_seed(1)
    state, x, dt = torch.randn(2, 6, 4, generator=g), torch.randn(2, 6, generator=g), torch.rand(2, 6, generator=g)
    A, B, C, D = -torch.rand(6, 4, generator=g), torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g), \
        torch.randn(6, generator=g)
    first, s1 = tvm_mamba.selective_state_update(s0 := state.clone(), x, dt, A, B, C, D), None
    s1 = state.clone()
    second = tvm_mamba.selective_state_update(s1, x, dt, A, B, C, D)
    assert len(full_calls) == 1 and second.shape == (2, 6) and torch.equal(first, second) and torch.equal(s0, s1)
    assert second.data_ptr() != first.data_ptr()  # a fresh output per call


def test_index_values_are_checked_on_every_recipe_call(full_calls):
    state, rest = _ssu_inputs()
    _ssu(state.clone(), rest, torch.tensor([4, -1, 1], dtype=torch.int32))
    for bad, match in ((torch.tensor([5, -1, 1], dtype=torch.int32), "out of range"),
                       (torch.tensor([1, -1, 1], dtype=torch.int32), "same state slot")):
        s = state.clone()
        with pytest.raises(ValueError, match=match):
            _ssu(s, rest, bad)
        assert torch.equal(s, state)  # refused before the kernel ran
    assert len(full_calls) == 1


@pytest.mark.parametrize("sim", [False, True], ids=["cpu", "cudasim"])
def test_cpu_recipes_leave_the_value_checks_to_their_kernel(full_calls, monkeypatch, sim):
    """A CPU kernel refuses bad slots itself (compute/strategy.py slot_checks), so a recipe of CPU launches
    reads no index in Python unless the kernel refused the call (then the checks name the value); a CUDA
    kernel (here the CPU harness's) cannot raise: its recipe checks first, every call."""
    checks = []
    for fast in (scan_ops._SSU_FAST, conv_ops._UPDATE_FAST):
        monkeypatch.setattr(fast, "checks", lambda *a, _c=fast.checks: checks.append(1) or _c(*a))
    state, rest = _ssu_inputs()
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    conv = (torch.randn(3, 6), torch.randn(5, 6, 3), torch.randn(6, 4), None, "silu", None, idx)
    with (tvm_mamba.simulate_cuda("sm_90") if sim else contextlib.nullcontext()):
        for _ in range(3):
            _ssu(state.clone(), rest, idx)
            tvm_mamba.causal_conv1d_update(conv[0], conv[1].clone(), *conv[2:])
        assert len(full_calls) == 2 and len(checks) == (4 if sim else 0)
        s = state.clone()
        with pytest.raises(ValueError, match="index 5 is out of range"):  # the Python check's words either way
            _ssu(s, rest, torch.tensor([4, -1, 5], dtype=torch.int32))
        assert torch.equal(s, state) and len(full_calls) == 2


def test_strided_inputs_are_copied_by_the_recipe_a_copied_pool_takes_the_full_path(full_calls):
    """A server's activations are row slices of a projection's output: the op copies them compact, and so does
    its recipe (bitwise the full path's result). A pool the op must copy and write back keeps the full path."""
    state, rest = _ssu_inputs()
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    wide = torch.randn(3, 2, 8)
    x_strided = wide[:, :, ::2]
    want_state = state.clone()
    want = scan_ops._selective_state_update(want_state, x_strided, *rest[1:], dt_softplus=True,
                                            state_batch_indices=idx)
    for _ in range(3):
        got_state = state.clone()
        got = _ssu(got_state, (x_strided,) + rest[1:], idx)
        assert torch.equal(got, want) and torch.equal(got_state, want_state)
        wide.add_(0)  # same values: the recipe reads the input anew each call
    assert len(full_calls) == 1
    x_new = torch.randn(3, 2, 8)
    got = _ssu(state.clone(), (x_new[:, :, ::2],) + rest[1:], idx)  # new values through the same recipe
    assert len(full_calls) == 1
    assert torch.equal(got, scan_ops._selective_state_update(state.clone(), x_new[:, :, ::2], *rest[1:],
                                                             dt_softplus=True, state_batch_indices=idx))
    full_calls.clear()
    loose = torch.randn(5, 2, 8, 8)[:, :, ::2]  # slots not compact: copied, updated, written back
    for _ in range(2):
        _ssu(loose, rest, idx)
    assert len(full_calls) == 2
    full_calls.clear()


def test_autograd_and_new_contexts_take_the_full_path(full_calls):
    state, rest = _ssu_inputs()
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    _ssu(state.clone(), rest, idx)
    dispatch.invalidate()  # what picks kernels changed: watched again
    _ssu(state.clone(), rest, idx)
    with tvm_mamba.simulate_cuda("sm_90"):  # another target for CPU tensors
        _ssu(state.clone(), rest, idx)
    assert len(full_calls) == 3
    full_calls.clear()
    leaf = rest[0].clone().requires_grad_()
    with torch.no_grad():
        _ssu(state.clone(), (leaf,) + rest[1:], idx)
    _ssu(state.clone(), (leaf,) + rest[1:], idx)  # a gradient may be needed: the dispatcher's path
    assert len(full_calls) == 2


def test_launches_are_captured_from_recipes_too(full_calls):
    """modules/_decode.py records a step's launches with capture_launches: recipe calls must show up."""
    state, rest = _ssu_inputs()
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    for _ in range(2):
        with capture_launches() as launches:
            _ssu(state.clone(), rest, idx)
        assert len(launches) == 1 and launches[0].kernel.key.op == "selective_scan"
    assert len(full_calls) == 1


@pytest.mark.parametrize("squeeze", [True, False])
def test_conv_update_recipe_equals_the_full_path_and_checks_values(full_calls, squeeze):
    g = torch.Generator().manual_seed(2)
    pool, batch, dim, width = 5, 3, 8, 4
    x = torch.randn(batch, dim, *(() if squeeze else (2,)), generator=g)
    state, w, b = torch.randn(pool, dim, width - 1, generator=g), torch.randn(dim, width, generator=g), \
        torch.randn(dim, generator=g)
    idx = torch.tensor([3, -1, 0], dtype=torch.int32)
    seqlens = torch.tensor([2, -7, 5], dtype=torch.int32)  # a padding row's value is never read
    runs = []
    for _ in range(3):
        s = state.clone()
        runs.append((tvm_mamba.causal_conv1d_update(x, s, w, b, "silu", seqlens, idx), s))
    assert len(full_calls) == 1
    for out, s in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(s, runs[0][1])
    want_out, want_state = causal_conv1d_update_ref(x.double(), state.double(), w.double(), b.double(), "silu",
                                                    seqlens, idx)
    torch.testing.assert_close(runs[1][0].double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runs[1][1].double(), want_state, rtol=1e-5, atol=1e-5)
    for bad_idx, bad_len, match in ((torch.tensor([3, -1, 5], dtype=torch.int32), seqlens, "must be < conv_state"),
                                    (torch.tensor([3, -1, 3], dtype=torch.int32), seqlens, "same conv_state slot"),
                                    (idx, torch.tensor([2, 0, -1], dtype=torch.int32), "must be >= 0")):
        s = state.clone()
        with pytest.raises(ValueError, match=match):
            tvm_mamba.causal_conv1d_update(x, s, w, b, "silu", bad_len, bad_idx)
        assert torch.equal(s, state)
    assert len(full_calls) == 1


def test_a_servers_call_strided_rows_and_parameters_gets_a_recipe(full_calls):
    """As vLLM's Mamba-2 layer calls the conv step: x a row slice of the projection's output, the weight a view
    of a Parameter, the bias a Parameter (inference, no gradient); the result written back into x."""
    g = torch.Generator().manual_seed(3)
    proj = torch.randn(3, 40, generator=g)
    conv = torch.nn.Conv1d(16, 16, 4, groups=16)
    state = torch.randn(5, 16, 3, generator=g)
    idx = torch.tensor([3, 0, 1], dtype=torch.int32)
    with torch.inference_mode():
        runs = []
        for _ in range(3):
            s = state.clone()
            runs.append((tvm_mamba.causal_conv1d_update(proj[:, 8:24], s, conv.weight.view(16, 4), conv.bias,
                                                        "silu", None, idx), s))
    assert len(full_calls) == 1
    for out, s in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(s, runs[0][1])
    want_out, want_state = causal_conv1d_update_ref(proj[:, 8:24].double(), state.double(),
                                                    conv.weight.view(16, 4).double(), conv.bias.double(), "silu",
                                                    None, idx)
    torch.testing.assert_close(runs[2][0].double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runs[2][1].double(), want_state, rtol=1e-5, atol=1e-5)


def test_inputs_sharing_memory_make_no_recipe_the_next_separate_call_does(full_calls):
    """B and C one tensor: which input the op passed where cannot be told from memory, so nothing is kept; a
    call with separate B and C makes the recipe, which then serves shared ones correctly too."""
    state, rest = _ssu_inputs()
    x, dt, A, B, C, D, z, dt_bias = rest
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    shared = (x, dt, A, B, B, D, z, dt_bias)
    for _ in range(2):
        _ssu(state.clone(), shared, idx)
    assert len(full_calls) == 2 and not scan_ops._SSU_FAST._recipes
    s_sep, s_shared = state.clone(), state.clone()
    sep_out = _ssu(s_sep, rest, idx)  # watched: the recipe
    shared_out = _ssu(s_shared, shared, idx)  # from the recipe, C's argument from C's position
    assert len(full_calls) == 3
    want, _ = selective_state_update_ref(state.double(), x.double(), dt.double(), A.double(), B.double(),
                                         B.double(), D.double(), z.double(), dt_bias.double(), True, idx)
    torch.testing.assert_close(shared_out.double(), want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(sep_out, shared_out)


def _fresh_tied_call(state, A_h, D_h, dtb_h, g, batch=3, H=2, P=4, N=8):
    """One decode step's call as vLLM's Mamba-2 layer makes it: new activations, A / D / dt_bias new expanded
    views of the same parameters."""
    x, B, C = torch.randn(batch, H, P, generator=g), torch.randn(batch, 1, N, generator=g), \
        torch.randn(batch, 1, N, generator=g)
    dt = torch.rand(batch, H, generator=g)[:, :, None].expand(-1, -1, P)
    return (x, dt, A_h[:, None, None].expand(-1, P, N), B, C, D_h[:, None].expand(-1, P), None,
            dtb_h[:, None].expand(-1, P))


def test_a_repeated_signature_is_served_by_its_guard_and_fresh_views_read_the_new_call(full_calls, monkeypatch):
    """The guard serves a repeated signature without building it; each call's views are of that call's
    tensors (activations at new addresses), parameters' views are reused, and every result is the full
    path's on the same inputs."""
    from tvm_mamba.torch_ops import _fastpath

    g = torch.Generator().manual_seed(4)
    state = torch.randn(5, 2, 4, 8, generator=g)
    A_h, D_h, dtb_h = -torch.rand(2, generator=g), torch.randn(2, generator=g), torch.randn(2, generator=g)
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    _ssu(state.clone(), _fresh_tied_call(state, A_h, D_h, dtb_h, g), idx)  # watched
    built = []
    signature = _fastpath.signature
    monkeypatch.setattr(_fastpath, "signature", lambda *a: built.append(1) or signature(*a))
    for _ in range(4):
        rest = _fresh_tied_call(state, A_h, D_h, dtb_h, g)
        got_state, want_state = state.clone(), state.clone()
        got = _ssu(got_state, rest, idx)
        want = scan_ops._selective_state_update(want_state, *rest, True, idx)
        assert torch.equal(got, want) and torch.equal(got_state, want_state)
    assert not built and len(full_calls) == 1
    monkeypatch.setattr(_fastpath, "signature", signature)


@pytest.mark.parametrize("change", ["stride", "dtype", "none", "alignment", "grad"])
def test_a_call_the_guard_does_not_cover_takes_its_own_path(full_calls, change):
    """A different signature never runs another signature's recipe: a transposed state, another dtype, an
    argument given where it was None, an address of another alignment, a tensor needing a gradient."""
    state, rest = _ssu_inputs()
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    _ssu(state.clone(), rest, idx)
    x, dt, A, B, C, D, z, dt_bias = rest
    s = state.clone()
    if change == "stride":
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    elif change == "dtype":
        x = x.to(torch.bfloat16)
    elif change == "none":
        z = None
    elif change == "alignment":
        x = torch.empty(x.numel() + 1)[1:].view(x.shape).copy_(x)
    else:
        x = x.clone().requires_grad_()
    got = _ssu(s, (x, dt, A, B, C, D, z, dt_bias), idx)
    assert len(full_calls) == 2
    want_state = state.clone()
    with torch.no_grad():
        want = scan_ops._selective_state_update(want_state, x, dt, A, B, C, D, z, dt_bias, True, idx)
    assert torch.equal(got.detach(), want) and torch.equal(s, want_state)


def test_recipes_of_several_signatures_serve_in_turn(full_calls):
    """Batch sizes alternate in a server: each signature's recipe serves its calls, the others' guards say no."""
    runs = {}
    for _ in range(3):
        for batch in (1, 2, 3):
            state, rest = _ssu_inputs(batch=batch)
            idx = torch.tensor([4, -1, 1][:batch], dtype=torch.int32)
            s = state.clone()
            runs.setdefault(batch, []).append((_ssu(s, rest, idx), s))
    assert len(full_calls) == 3
    for batch, results in runs.items():
        assert all(torch.equal(o, results[0][0]) and torch.equal(s, results[0][1]) for o, s in results[1:])


@pytest.mark.parametrize("n", [8, 300])
def test_slot_stats_small_and_large(n):
    """slot_stats' list path (decode batches) and numpy path (longer) agree with a plain reading."""
    from tvm_mamba.torch_ops._dlpack import slot_stats

    g = torch.Generator().manual_seed(n)
    for dup in (False, True):
        idx = torch.randperm(2 * n, generator=g)[:n].to(torch.int32)
        idx[::3] = -1
        if dup:
            idx[1] = idx[2] = 7
        used = [v for v in idx.tolist() if v >= 0]
        assert slot_stats(idx) == (max(idx.tolist()), len(set(used)) != len(used))


def test_bad_arguments_after_a_recipe_get_the_full_paths_errors(full_calls):
    """A guard that cannot read an argument (no tensor where a recipe had one) leaves the call to the full
    path, which names the argument."""
    state, rest = _ssu_inputs()
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    _ssu(state.clone(), rest, idx)
    with pytest.raises(TypeError, match="x"):
        _ssu(state.clone(), (rest[0].tolist(),) + rest[1:], idx)
    with pytest.raises((TypeError, ValueError), match="dt"):
        _ssu(state.clone(), (rest[0], "dt") + rest[2:], idx)
