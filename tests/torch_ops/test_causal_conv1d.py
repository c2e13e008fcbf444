"""causal_conv1d_fn / causal_conv1d_update against the float64 reference written from the math."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close_to_ref
from tvm_mamba import causal_conv1d_fn, causal_conv1d_update
from tvm_mamba.reference.causal_conv1d import causal_conv1d_ref, causal_conv1d_update_ref

DIM = 24  # one static dim for most tests: every distinct (dim, width, flags, dtype) is one compile


def _inputs(batch=2, dim=DIM, seqlen=37, width=4, dtype=torch.float32, wdtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, dim, seqlen, generator=g).to(dtype)
    w = (torch.randn(dim, width, generator=g) / width ** 0.5).to(wdtype)
    b = torch.randn(dim, generator=g).to(wdtype) if bias else None
    return x, w, b


def _seq_idx(batch, seqlen, seed=0):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randint(0, 4, (batch, seqlen), generator=g) == 0
    return torch.cumsum(cuts.to(torch.int32), dim=1).to(torch.int32)


def _grads(out_fn, tensors, seed=1):
    for t in tensors:
        if t is not None:
            t.grad = None
    outs = out_fn()
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum() for o in outs)
    loss.backward()
    return outs, [t.grad if t is not None else None for t in tensors]


@pytest.mark.parametrize("seqlen", [1, 5, 16, 37, 200])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_forward_backward_fp32(seqlen, activation):
    x, w, b = _inputs(seqlen=seqlen)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    refs = [t.double().clone().requires_grad_() for t in (x, w, b)]
    (out,), grads = _grads(lambda: causal_conv1d_fn(*leaves, activation=activation), leaves)
    (ref,), rgrads = _grads(lambda: causal_conv1d_ref(*refs, activation=activation), refs)
    assert_close_to_ref(out, ref, name="out")
    for name, gk, gr in zip(("dx", "dweight", "dbias"), grads, rgrads):
        assert_close_to_ref(gk, gr, atol=2e-4, rtol=1e-4, name=name)


@pytest.mark.parametrize("width", [2, 3, 8])
def test_widths(width):
    x, w, b = _inputs(width=width, seqlen=29)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    refs = [t.double().clone().requires_grad_() for t in (x, w, b)]
    (out,), grads = _grads(lambda: causal_conv1d_fn(*leaves, activation="silu"), leaves)
    (ref,), rgrads = _grads(lambda: causal_conv1d_ref(*refs, activation="silu"), refs)
    assert_close_to_ref(out, ref)
    for gk, gr in zip(grads, rgrads):
        assert_close_to_ref(gk, gr, atol=2e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_against_reference_drift(dtype):
    """mamba_ssm's rule: err(kernel) <= 2 * err(reference run in the low precision) + atol."""
    x, w, b = _inputs(seqlen=64, dtype=dtype, wdtype=torch.float32)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    refs64 = [t.double().clone().requires_grad_() for t in (x, w, b)]
    refs_lo = [x.clone().requires_grad_(), w.to(dtype).clone().requires_grad_(), b.to(dtype).clone().requires_grad_()]
    (out,), grads = _grads(lambda: causal_conv1d_fn(*leaves, activation="silu"), leaves)
    (ref,), rgrads = _grads(lambda: causal_conv1d_ref(*refs64, activation="silu"), refs64)
    (lo,), lgrads = _grads(lambda: causal_conv1d_ref(*refs_lo, activation="silu"), refs_lo)
    assert out.dtype == dtype
    assert_close_to_ref(out, ref, lo, name="out")
    assert_close_to_ref(grads[0], rgrads[0], lgrads[0], name="dx")
    # dweight/dbias are fp32 sums over batch*seqlen: compare relative to their magnitude
    for name, gk, gr in zip(("dweight", "dbias"), grads[1:], rgrads[1:]):
        assert_close_to_ref(gk, gr, atol=3e-2 * gr.abs().max().item(), rtol=0, name=name)


def test_bf16_weight_in_x_dtype():
    x, w, b = _inputs(seqlen=40, dtype=torch.bfloat16, wdtype=torch.bfloat16)
    out = causal_conv1d_fn(x, w, b, activation="silu")
    ref = causal_conv1d_ref(x.double(), w.double(), b.double(), activation="silu")
    lo = causal_conv1d_ref(x, w, b, activation="silu")
    assert_close_to_ref(out, ref, lo)


def test_initial_and_final_states_with_gradients():
    x, w, b = _inputs(seqlen=23)
    init = torch.randn(2, DIM, 3)
    leaves = [t.clone().requires_grad_() for t in (x, w, b, init)]
    refs = [t.double().clone().requires_grad_() for t in (x, w, b, init)]

    def run(x_, w_, b_, i_, fn):
        return fn(x_, w_, b_, initial_states=i_, return_final_states=True, activation="silu")

    outs, grads = _grads(lambda: run(*leaves, causal_conv1d_fn), leaves)
    routs, rgrads = _grads(lambda: run(*refs, causal_conv1d_ref), refs)
    for o, r in zip(outs, routs):
        assert_close_to_ref(o, r)
    for name, gk, gr in zip(("dx", "dweight", "dbias", "dinit"), grads, rgrads):
        assert_close_to_ref(gk, gr, atol=2e-4, name=name)


def test_final_states_shorter_than_window_and_out_param():
    x, w, b = _inputs(seqlen=2, width=5)
    init = torch.randn(2, DIM, 4)
    final_out = torch.empty(2, DIM, 4)
    out, final = causal_conv1d_fn(x, w, b, initial_states=init, return_final_states=True,
                                  final_states_out=final_out)
    assert final.data_ptr() == final_out.data_ptr()
    _, rfinal = causal_conv1d_ref(x.double(), w.double(), b.double(), initial_states=init.double(),
                                  return_final_states=True)
    assert torch.equal(final, rfinal.float())  # a pure copy of inputs: exact


def test_chaining_with_states_equals_whole():
    x, w, b = _inputs(seqlen=50)
    whole = causal_conv1d_fn(x, w, b, activation="silu")
    first, state = causal_conv1d_fn(x[..., :21].contiguous(), w, b, return_final_states=True, activation="silu")
    second = causal_conv1d_fn(x[..., 21:].contiguous(), w, b, initial_states=state, activation="silu")
    assert torch.allclose(torch.cat([first, second], -1), whole, atol=1e-6)


def test_seq_idx_matches_separate_runs_and_gradients():
    x, w, b = _inputs(batch=2, seqlen=45)
    seq_idx = _seq_idx(2, 45)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    refs = [t.double().clone().requires_grad_() for t in (x, w, b)]
    (out,), grads = _grads(lambda: causal_conv1d_fn(*leaves, seq_idx=seq_idx, activation="silu"), leaves)
    (ref,), rgrads = _grads(lambda: causal_conv1d_ref(*refs, seq_idx=seq_idx, activation="silu"), refs)
    assert_close_to_ref(out, ref)
    for gk, gr in zip(grads, rgrads):
        assert_close_to_ref(gk, gr, atol=2e-4)
    # against running each segment on its own (independent of the reference's masking)
    for bi in range(2):
        for sid in seq_idx[bi].unique():
            pos = (seq_idx[bi] == sid).nonzero().flatten()
            seg = x[bi:bi + 1, :, pos[0]:pos[-1] + 1].contiguous()
            alone = causal_conv1d_fn(seg, w, b, activation="silu")
            assert torch.allclose(out[bi:bi + 1, :, pos[0]:pos[-1] + 1], alone, atol=1e-6)


def test_channel_last_and_noncontiguous_inputs():
    x, w, b = _inputs(seqlen=33)
    x_cl = x.transpose(1, 2).contiguous().transpose(1, 2)  # (batch, dim, seqlen) with stride(1) == 1
    assert x_cl.stride(1) == 1 and not x_cl.is_contiguous()
    xg = x_cl.clone().requires_grad_()
    out = causal_conv1d_fn(xg, w, b, activation="silu")
    ref = causal_conv1d_ref(x.double(), w.double(), b.double(), activation="silu")
    assert_close_to_ref(out, ref)
    out.sum().backward()
    assert xg.grad.shape == x.shape
    w_nc = torch.randn(4, DIM).t()  # non-contiguous weight
    assert_close_to_ref(causal_conv1d_fn(x, w_nc), causal_conv1d_ref(x.double(), w_nc.double()))


def test_unaligned_view_is_handled():
    big = torch.randn(2 * DIM * 40 + 3)
    x = big[3:].view(2, DIM, 40)  # data_ptr 12 bytes past an aligned block
    assert x.data_ptr() % 64 != 0
    w = torch.randn(DIM, 4)
    assert_close_to_ref(causal_conv1d_fn(x, w), causal_conv1d_ref(x.double(), w.double()))


def test_empty_sequences():
    x = torch.randn(2, DIM, 0, requires_grad=True)
    w = torch.randn(DIM, 4, requires_grad=True)
    init = torch.randn(2, DIM, 3)
    out, final = causal_conv1d_fn(x, w, initial_states=init, return_final_states=True)
    assert out.shape == (2, DIM, 0) and torch.equal(final, init)
    out.sum().backward()
    assert x.grad.shape == (2, DIM, 0) and torch.equal(w.grad, torch.zeros_like(w))


def test_nan_poisons_only_its_windows():
    x, w, b = _inputs(batch=1, seqlen=40)
    x[0, 3, 17] = float("nan")
    out = causal_conv1d_fn(x, w, b, activation="silu")
    bad = torch.isnan(out)
    expected = torch.zeros_like(bad)
    expected[0, 3, 17:21] = True  # width 4: positions 17..20 see x[17]
    assert torch.equal(bad, expected)


def test_backward_is_deterministic():
    x, w, b = _inputs(batch=3, seqlen=300)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        causal_conv1d_fn(*leaves, activation="silu").pow(2).sum().backward()
        runs.append([t.grad for t in leaves])
    for g1, g2 in zip(*runs):
        assert torch.equal(g1, g2)


def test_gradcheck_tiny():
    """gradcheck on float64 leaves; the kernels compute in float32, so eps/tolerances are set for that."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    init = torch.randn(1, 3, 2, generator=g, dtype=torch.float64, requires_grad=True)

    def f(x, w, b, init):
        out, final = causal_conv1d_fn(x.float(), w.float(), b.float(), initial_states=init.float(),
                                      return_final_states=True, activation="silu")
        return out.double(), final.double()

    assert torch.autograd.gradcheck(f, (x, w, b, init), eps=1e-2, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_update_steps_match_full_conv(activation):
    x, w, b = _inputs(batch=2, seqlen=12)
    full = causal_conv1d_fn(x, w, b, activation=activation)
    state = torch.zeros(2, DIM, 3)
    steps = [causal_conv1d_update(x[..., t].contiguous(), state, w, b, activation=activation) for t in range(12)]
    assert torch.allclose(torch.stack(steps, -1), full, atol=1e-5)
    assert torch.equal(state, x[..., -3:])
    # several tokens at once and a longer state, against the update reference
    state2 = torch.randn(2, DIM, 6)
    ref_out, ref_state = causal_conv1d_update_ref(x[..., :5].double(), state2.double(), w.double(), b.double(),
                                                  activation=activation)
    out = causal_conv1d_update(x[..., :5], state2, w, b, activation=activation)
    assert_close_to_ref(out, ref_out)
    assert_close_to_ref(state2, ref_state)


def test_kernel_writes_callers_storage_zero_copy():
    from tvm_mamba.torch_ops._dlpack import kernel_for

    x, w, b = _inputs(seqlen=32)
    out = torch.full_like(x, 7.0)
    final = torch.empty(1, 1, 1)
    kern = kernel_for("causal_conv1d", "fwd", x.device, {"x": "float32", "weight": "float32"},
                      dict(dim=DIM, width=4, activation="none", has_bias=True, has_seq_idx=False,
                           has_init=False, return_final=False), seqlen=32)
    ptr = out.data_ptr()
    kern(x, w, b, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, 1), out, final)
    assert out.data_ptr() == ptr
    assert_close_to_ref(out, causal_conv1d_ref(x.double(), w.double(), b.double()))


def test_opcheck_and_compile():
    x, w, b = _inputs(seqlen=20)
    init = torch.randn(2, DIM, 3)
    torch.library.opcheck(torch.ops.tvm_mamba.causal_conv1d_fwd, (x, w, b, None, init, True, True))
    dout = torch.randn_like(x)
    torch.library.opcheck(torch.ops.tvm_mamba.causal_conv1d_bwd, (x, w, b, None, init, dout, None, True))
    torch.library.opcheck(torch.ops.tvm_mamba.causal_conv1d_update,
                          (x[..., :1].contiguous(), torch.randn(2, DIM, 3), w, b, True))

    def block(x, w, b):
        return causal_conv1d_fn(x, w, b, activation="silu").square().mean()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    eager_leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    compiled(*leaves).backward()
    block(*eager_leaves).backward()
    for a, e in zip(leaves, eager_leaves):
        assert torch.allclose(a.grad, e.grad, atol=1e-6)


@pytest.mark.parametrize("call,match", [
    (lambda x, w, b: causal_conv1d_fn(x.double(), w, b), "x: dtype"),
    (lambda x, w, b: causal_conv1d_fn(x[0], w, b), "x: expected a 3-D"),
    (lambda x, w, b: causal_conv1d_fn(x, w[:5], b), "weight: expected"),
    (lambda x, w, b: causal_conv1d_fn(x, torch.randn(DIM, 9), b), "weight: width"),
    (lambda x, w, b: causal_conv1d_fn(x, w, b[:3]), "bias: expected shape"),
    (lambda x, w, b: causal_conv1d_fn(x, w, b.double()), "bias: dtype"),
    (lambda x, w, b: causal_conv1d_fn(x, w, b, activation="relu"), "activation"),
    (lambda x, w, b: causal_conv1d_fn(x, w, b, seq_idx=torch.zeros(2, 37, dtype=torch.int64)), "seq_idx: dtype"),
    (lambda x, w, b: causal_conv1d_fn(x, w, b, seq_idx=torch.zeros(2, 36, dtype=torch.int32)), "seq_idx: expected shape"),
    (lambda x, w, b: causal_conv1d_fn(x, w, b, initial_states=torch.zeros(2, DIM, 2)), "initial_states: expected shape"),
    (lambda x, w, b: causal_conv1d_fn(x, w, b, initial_states=torch.zeros(2, DIM, 3, dtype=torch.bfloat16)), "initial_states: dtype"),
    (lambda x, w, b: causal_conv1d_fn(x, w, b, initial_states=torch.zeros(2, DIM, 3, device="meta")), "initial_states: expected a tensor on"),
    (lambda x, w, b: causal_conv1d_fn("x", w, b), "x: expected a torch.Tensor"),
    (lambda x, w, b: causal_conv1d_update(x[..., 0], torch.zeros(2, DIM, 2), w, b), "conv_state"),
    (lambda x, w, b: causal_conv1d_update(x[..., 0], torch.zeros(3, DIM, 3), w, b), "conv_state"),
])
def test_bad_input_raises_before_any_kernel(call, match):
    x, w, b = _inputs()
    with pytest.raises((ValueError, TypeError), match=match):
        call(x, w, b)


def test_tensors_reach_the_kernel_as_torch_tensors(monkeypatch):
    """tvm_ffi runs a kernel on torch's current CUDA stream when it is handed torch tensors (it asks torch
    for the stream per call); check our glue hands it torch tensors, not copies or TVM arrays."""
    from tvm_mamba.runtime import cache

    seen = []
    real_call = cache.Kernel.__call__

    def spy(self, *args):
        seen.append([type(a) for a in args])
        return real_call(self, *args)

    monkeypatch.setattr(cache.Kernel, "__call__", spy)
    x, w, b = _inputs(seqlen=20)
    causal_conv1d_fn(x, w, b, activation="silu")
    assert seen and all(t is torch.Tensor for t in seen[0])


def test_eager_calls_skip_the_dispatcher_only_when_nothing_needs_it(monkeypatch):
    """No-grad eager calls run the op's implementation directly (same kernel, bitwise-equal result); calls that
    need autograd, a dispatch mode (fake tensors) or compilation go through the registered op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tvm_mamba.torch_ops import causal_conv1d as cc
    from tvm_mamba.torch_ops._dlpack import eager_direct

    x, w, b = _inputs(seqlen=40)
    direct = []
    real = cc.causal_conv1d_fwd._init_fn
    monkeypatch.setattr(cc.causal_conv1d_fwd, "_init_fn", lambda *a: direct.append(1) or real(*a))
    out_direct = causal_conv1d_fn(x, w, b, activation="silu")
    assert direct == [1]
    out_op = torch.ops.tvm_mamba.causal_conv1d_fwd(x, w, b, None, None, False, True)[0]
    assert torch.equal(out_direct, out_op)
    xg = x.clone().requires_grad_()
    causal_conv1d_fn(xg, w, b, activation="silu").sum().backward()  # autograd: through the op
    assert direct == [1] and xg.grad is not None
    with torch.no_grad():
        causal_conv1d_fn(xg, w, b, activation="silu")  # no grad needed: direct again
    assert direct == [1, 1]
    assert eager_direct(x, None, w) and not eager_direct(xg, w)
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        assert not eager_direct(fx)
        assert causal_conv1d_fn(fx, mode.from_tensor(w), mode.from_tensor(b)).shape == x.shape  # the fake impl
    assert direct == [1, 1]
