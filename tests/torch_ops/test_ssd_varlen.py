"""mamba_chunk_scan_combined at mamba_ssm's full signature: the positional order, cu_seqlens +
return_varlen_states (the final state of every packed sequence, ssd_chunk_state_varlen) and state_dtype,
against float64 references written from the math (tvm_mamba/reference/ssd.py)."""
from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import assert_close_to_ref
from tvm_mamba.reference.ssd import ssd_chunked_ref, ssd_recurrence_ref, ssd_varlen_states_ref
from tvm_mamba.torch_ops.ssd import mamba_chunk_scan_combined

H, G, P, N, Q = 4, 2, 8, 16, 16  # as tests/torch_ops/test_ssd.py (shared kernel builds)
# 4 chunks (0-15, 16-31, 32-47, 48-59): sequence 0 ends in chunk 0 (it holds initial_states), 1 spans chunks
# 0-2, 2 is empty, 3 starts inside chunk 2 and ends at its last position, 4 starts at a chunk start (ragged)
CU = [0, 5, 37, 37, 48, 60]
SEQLEN = CU[-1]
FULL = dict(dt_softplus=True, dt_limit=(0.0, 2.0))


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g) * scale

    return dict(x=r(1, SEQLEN, H, P).to(dtype), dt=(r(1, SEQLEN, H) - 1.0).to(dtype),
                A=-(torch.rand(H, generator=g) + 0.5), B=r(1, SEQLEN, G, N, scale=0.5).to(dtype),
                C=r(1, SEQLEN, G, N, scale=0.5).to(dtype), D=r(H, P), z=r(1, SEQLEN, H, P).to(dtype),
                dt_bias=r(H, scale=0.5), initial_states=r(1, H, P, N, scale=0.5))


def _cu(dtype=torch.int32):
    return torch.tensor(CU, dtype=dtype)


def _seq_idx():
    return torch.repeat_interleave(torch.arange(len(CU) - 1, dtype=torch.int32), torch.diff(_cu()))[None]


def _ours(inp, **kw):
    return mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], Q, D=inp["D"], z=inp["z"],
                                     dt_bias=inp["dt_bias"], initial_states=inp["initial_states"], **FULL, **kw)


def _f64(inp):
    return {k: v.double() for k, v in inp.items()}


def _per_sequence_ref(inp):
    """Each packed sequence run alone through the float64 recurrence (initial_states for the first only):
    the state after its last position; zeros for an empty one."""
    d = _f64(inp)
    out = []
    for i, (s, e) in enumerate(zip(CU[:-1], CU[1:])):
        if s == e:
            out.append(torch.zeros(H, P, N, dtype=torch.float64))
            continue
        _, h = ssd_recurrence_ref(d["x"][:, s:e], d["dt"][:, s:e], d["A"], d["B"][:, s:e], d["C"][:, s:e],
                                  dt_bias=d["dt_bias"], initial_states=d["initial_states"] if i == 0 else None,
                                  return_final_states=True, **FULL)
        out.append(h[0])
    return torch.stack(out)


def _varlen_ref(inp, seq_idx, dtype=torch.float64):
    d = {k: v.to(dtype) for k, v in inp.items()}
    return ssd_varlen_states_ref(d["x"], d["dt"], d["A"], d["B"], d["C"], Q, CU, dt_bias=d["dt_bias"],
                                 initial_states=d["initial_states"], seq_idx=seq_idx, **FULL)


def test_positional_call_in_upstream_order():
    """All 17 arguments positionally, in mamba_ssm's order (cu_seqlens 12th ... state_dtype 17th); the
    returned tuple is upstream's: (y, final_states, varlen_states), or (y, varlen_states)."""
    inp = _inputs()
    seq, cu = _seq_idx(), _cu()
    y, f, v = mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], Q, inp["D"], inp["z"],
                                        inp["dt_bias"], inp["initial_states"], seq, cu, True, (0.0, 2.0), True,
                                        True, None)
    kw = _ours(inp, seq_idx=seq, cu_seqlens=cu, return_final_states=True, return_varlen_states=True)
    for a, b in zip((y, f, v), kw):
        assert torch.equal(a, b)
    out = _ours(inp, seq_idx=seq, cu_seqlens=cu, return_varlen_states=True)
    assert isinstance(out, tuple) and len(out) == 2 and torch.equal(out[0], y) and torch.equal(out[1], v)
    assert torch.equal(_ours(inp, seq_idx=seq), y)  # no varlen: y alone, unchanged


def test_varlen_states_fp32_match_each_sequence_alone():
    """With seq_idx consistent with cu_seqlens (as Mamba2 passes them): varlen_states[i] is the final state
    of sequence i run alone (initial_states continue the first one, also when it ends inside chunk 0);
    the empty sequence gets zeros. y / final_states are those of the call without varlen states."""
    inp = _inputs()
    seq = _seq_idx()
    y, f, v = _ours(inp, seq_idx=seq, cu_seqlens=_cu(torch.int64), return_final_states=True,
                    return_varlen_states=True)
    assert v.shape == (len(CU) - 1, H, P, N) and v.dtype == torch.float32
    ref = _per_sequence_ref(inp)
    assert_close_to_ref(v, ref, atol=2e-5 * ref.abs().max().item(), rtol=1e-4, name="varlen_states")
    assert_close_to_ref(v, _varlen_ref(inp, seq), atol=2e-5 * ref.abs().max().item(), rtol=1e-4)
    assert torch.all(v[2] == 0)
    assert_close_to_ref(v[-1], f[0].double(), atol=1e-6, rtol=1e-6, name="last sequence = final_states")
    y2, f2 = _ours(inp, seq_idx=seq, return_final_states=True)
    assert torch.equal(y, y2) and torch.equal(f, f2)


def test_varlen_states_without_seq_idx_follow_upstream():
    """Without seq_idx the scan runs the row as one sequence (y, final_states as without cu_seqlens) and, as
    upstream's chunk_state_varlen, a sequence that began before its last chunk carries that whole running
    state; one that began inside its last chunk starts from zero (ssd_varlen_states_ref)."""
    inp = _inputs(seed=3)
    y, v = _ours(inp, cu_seqlens=_cu(), return_varlen_states=True)
    ref = _varlen_ref(inp, None)
    assert_close_to_ref(v, ref, atol=2e-5 * ref.abs().max().item(), rtol=1e-4, name="varlen_states")
    assert torch.equal(y, _ours(inp))


def test_varlen_states_bf16_within_reference_drift():
    """bf16 x / B / C: varlen_states come in C's dtype (upstream: the chunk states' dtype, C's by default);
    err(kernel) <= 2 err(reference run in bf16) + atol."""
    inp = _inputs(torch.bfloat16, seed=1)
    seq = _seq_idx()
    y, v = _ours(inp, seq_idx=seq, cu_seqlens=_cu(), return_varlen_states=True)
    assert v.dtype == torch.bfloat16 and y.dtype == torch.bfloat16
    assert_close_to_ref(v, _varlen_ref(inp, seq), _varlen_ref(inp, seq, torch.bfloat16), name="varlen_states")


def test_state_dtype():
    """state_dtype=float32 with bf16 inputs: float32 varlen states, y as by default (tvm_mamba's chunk states
    are float32 already); state_dtype=bf16 with fp32 inputs: the states entering each chunk rounded to bf16,
    y as the float64 chunked reference with rounded chunk states; final_states stay float32. Backward always
    uses float32 states: the gradients equal the default's bit for bit (dz: y's pre-gate output differs)."""
    low = _inputs(torch.bfloat16, seed=2)
    seq = _seq_idx()
    y32, f32, v32 = _ours(low, seq_idx=seq, cu_seqlens=_cu(), return_final_states=True, return_varlen_states=True,
                          state_dtype=torch.float32)
    assert v32.dtype == torch.float32 and f32.dtype == torch.float32
    y0, v0 = _ours(low, seq_idx=seq, cu_seqlens=_cu(), return_varlen_states=True)
    assert torch.equal(y32, y0) and torch.equal(v32.to(torch.bfloat16), v0)

    inp = _inputs(seed=2)
    d = _f64(inp)
    kw = dict(D=d["D"], z=d["z"], dt_bias=d["dt_bias"], initial_states=d["initial_states"], **FULL)
    ref = ssd_chunked_ref(d["x"], d["dt"], d["A"], d["B"], d["C"], Q, state_dtype=torch.bfloat16, **kw)
    ref_exact = ssd_chunked_ref(d["x"], d["dt"], d["A"], d["B"], d["C"], Q, **kw)
    leaves = {k: v.clone().requires_grad_() for k, v in inp.items()}
    y, f, v = _ours(leaves, cu_seqlens=_cu(), return_final_states=True, return_varlen_states=True,
                    state_dtype=torch.bfloat16)
    assert v.dtype == torch.bfloat16 and f.dtype == torch.float32 and y.dtype == torch.float32
    rounding = (ref - ref_exact).abs().max().item()
    assert rounding > 1e-4  # the rounding is visible in y
    assert (y.double() - ref).abs().max().item() <= 0.25 * rounding + 1e-5
    assert_close_to_ref(v, _varlen_ref(inp, None), _varlen_ref(inp, None, torch.bfloat16), name="varlen_states")
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    ((y * gy).sum() + f.sum()).backward()
    base = {k: v.clone().requires_grad_() for k, v in inp.items()}
    yb, fb = _ours(base, return_final_states=True)
    ((yb * gy).sum() + fb.sum()).backward()
    for k in leaves:  # dz reads the forward's pre-gate output, which saw the rounded states
        if k != "z":
            assert torch.equal(leaves[k].grad, base[k].grad), k
    torch.testing.assert_close(leaves["z"].grad, base["z"].grad, atol=4 * rounding, rtol=0)


def test_backward_through_y_and_not_through_varlen_states():
    """Gradients of y and final_states flow as without varlen states; a gradient reaching varlen_states is a
    clear error (mamba_ssm: "return_varlen_states is not supported in backward")."""
    inp = _inputs()
    seq = _seq_idx()

    def grads(**kw):
        leaves = {k: v.clone().requires_grad_() for k, v in inp.items()}
        out = _ours(leaves, seq_idx=seq, return_final_states=True, **kw)
        (out[0].sum() + out[1].sum()).backward()
        return {k: t.grad for k, t in leaves.items()}, out

    with_v, out = grads(cu_seqlens=_cu(), return_varlen_states=True)
    without, _ = grads()
    for k in with_v:
        assert torch.equal(with_v[k], without[k]), k
    leaves = {k: v.clone().requires_grad_() for k, v in inp.items()}
    y, v = _ours(leaves, seq_idx=seq, cu_seqlens=_cu(), return_varlen_states=True)
    assert v.requires_grad
    with pytest.raises(NotImplementedError, match="varlen_states"):
        (y.sum() + v.sum()).backward()


def _bad_cu(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


@pytest.mark.parametrize("change, exc, match", [
    (dict(cu_seqlens=None), ValueError, "cu_seqlens: required"),
    (dict(cu_seqlens=_bad_cu([0.0, 60.0], torch.float32)), TypeError, "cu_seqlens"),
    (dict(cu_seqlens=_bad_cu([[0, 60]])), ValueError, "cu_seqlens"),
    (dict(cu_seqlens=_bad_cu([0])), ValueError, "cu_seqlens"),
    (dict(cu_seqlens=_bad_cu([1, 60])), ValueError, "cu_seqlens: must start at 0"),
    (dict(cu_seqlens=_bad_cu([0, 30, 20, 60])), ValueError, "cu_seqlens: must be non-decreasing"),
    (dict(cu_seqlens=_bad_cu([0, 30, 61])), ValueError, "cu_seqlens: must end at seqlen"),
    (dict(cu_seqlens=_bad_cu([0, 30, 60]), seq_idx=True), ValueError, "cu_seqlens: inconsistent with seq_idx"),
    (dict(cu_seqlens=_bad_cu([0, 5, 36, 48, 60]), seq_idx=True), ValueError, "inconsistent with seq_idx"),
    (dict(batch=2), ValueError, "cu_seqlens: packed sequences need batch 1"),
    (dict(state_dtype=torch.int32), TypeError, "state_dtype"),
    (dict(state_dtype="bfloat16"), TypeError, "state_dtype"),
])
def test_bad_varlen_inputs_raise_before_any_kernel(change, exc, match, monkeypatch):
    from tvm_mamba.torch_ops import _dlpack, ssd

    def no_kernel(*a, **k):
        raise AssertionError("a kernel was requested before validation finished")

    monkeypatch.setattr(ssd, "kernel_for", no_kernel)
    monkeypatch.setattr(_dlpack, "kernel_for", no_kernel)
    inp = _inputs()
    change = dict(change)
    if change.pop("batch", 1) == 2:
        inp = {k: torch.cat([v, v]) if v.dim() >= 3 else v for k, v in inp.items()}
    kw = dict(cu_seqlens=_cu(), return_varlen_states=True)
    if change.pop("seq_idx", False):
        kw["seq_idx"] = _seq_idx()
    kw.update(change)
    with pytest.raises(exc, match=match):
        _ours(inp, **kw)


def test_cu_seqlens_ignored_without_return_varlen_states():
    """As upstream (MambaChunkScanCombinedFn drops cu_seqlens unless return_varlen_states): not even read."""
    inp = _inputs()
    y = _ours(inp, cu_seqlens=_bad_cu([3, 1]))
    assert torch.equal(y, _ours(inp))


def test_torch_compile_fullgraph_and_opcheck():
    """No graph break with cu_seqlens / return_varlen_states / state_dtype; the op's fake implementation
    (shapes and dtypes of the varlen states) passes opcheck."""
    inp = _inputs()
    seq, cu = _seq_idx(), _cu()

    def fn(x, dt, B, C):
        return mamba_chunk_scan_combined(x, dt, inp["A"], B, C, Q, None, None, inp["dt_bias"], None, seq, cu, True,
                                         (0.0, math.inf), True, True, torch.bfloat16)

    args = (inp["x"], inp["dt"], inp["B"], inp["C"])
    eager = fn(*args)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
    for a, b in zip(eager, compiled):
        assert a.dtype == b.dtype and torch.equal(a, b)
    op_args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], Q, None, None, inp["dt_bias"], None, seq, True,
               [0.0, math.inf], False, cu, torch.bfloat16)
    torch.library.opcheck(torch.ops.tvm_mamba.ssd_fwd, op_args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
