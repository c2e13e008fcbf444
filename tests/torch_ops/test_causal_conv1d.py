"""causal_conv1d_fn / causal_conv1d_update against the float64 reference written from the math."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close_to_ref
from tvm_mamba import causal_conv1d_fn, causal_conv1d_update, causal_conv1d_varlen_states
from tvm_mamba.reference.causal_conv1d import (causal_conv1d_ref, causal_conv1d_update_ref,
                                               causal_conv1d_varlen_states_ref)

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


@pytest.mark.parametrize("seqlen", [1, 5, 16, pytest.param(37, marks=pytest.mark.smoke), 200])
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
                          (x[..., :1].contiguous(), torch.randn(2, DIM, 3), w, b, True, None, None))
    torch.library.opcheck(torch.ops.tvm_mamba.causal_conv1d_update,
                          (x[..., :2].contiguous(), torch.randn(5, DIM, 6), w, b, True,
                           torch.tensor([3, 7], dtype=torch.int32), torch.tensor([4, -1], dtype=torch.int32)))
    torch.library.opcheck(torch.ops.tvm_mamba.causal_conv1d_varlen_states,
                          (torch.randn(9, DIM), torch.tensor([0, 4, 9], dtype=torch.int32), 3))

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


# ---- seq_idx padding (seq_idx < 0), causal_conv1d_update serving arguments, causal_conv1d_varlen_states ----
# check_* functions are shared with tests/cudasim/test_causal_conv1d.py (the same checks on the CUDA kernels)

def padded_seq_idx(batch, seqlen, seed=0):
    """_seq_idx with padding (-1): row 0 starts with 2 padded positions and ends with 5, row 1 has 3 in the
    middle, before a new sequence (whose first tokens must not see the padding), and ends with 1."""
    seq_idx = _seq_idx(batch, seqlen, seed)
    seq_idx[0, :2] = -1
    seq_idx[0, -5:] = -1
    seq_idx[1, seqlen // 2 + 3:] += 100  # a new sequence right after the padding
    seq_idx[1, seqlen // 2:seqlen // 2 + 3] = -1
    seq_idx[1, -1] = -1
    return seq_idx


def check_seq_idx_padding(dtype=torch.float32, with_init=False, seqlen=41):
    """out and every gradient against the float64 reference (upstream's semantics: padding outputs 0,
    padding feeds nothing); padding outputs and dx exactly 0; each real segment equals running it alone."""
    x, w, b = _inputs(batch=2, seqlen=seqlen, dtype=dtype)
    seq_idx = padded_seq_idx(2, seqlen)
    seq_idx[1, :4] = 9  # row 1 starts with a real sequence: the initial states feed it; row 0's go to padding
    init = torch.randn(2, DIM, 3).to(dtype) if with_init else None
    tensors = [t for t in (x, w, b, init) if t is not None]
    leaves = [t.clone().requires_grad_() for t in tensors]
    refs = [t.double().clone().requires_grad_() for t in tensors]
    lows = [t.to(dtype).clone().requires_grad_() for t in tensors]

    def run(fn, a):
        return fn(a[0], a[1], a[2], seq_idx=seq_idx, initial_states=a[3] if with_init else None, activation="silu")

    (out,), grads = _grads(lambda: run(causal_conv1d_fn, leaves), leaves)
    (ref,), rgrads = _grads(lambda: run(causal_conv1d_ref, refs), refs)
    pad = (seq_idx < 0)[:, None, :].expand_as(out)
    assert torch.all(out[pad] == 0) and torch.all(grads[0][pad] == 0)
    names = ("dx", "dweight", "dbias", "dinit")
    if dtype == torch.float32:
        assert_close_to_ref(out, ref)
        for name, gk, gr in zip(names, grads, rgrads):
            assert_close_to_ref(gk, gr, atol=2e-4, name=name)
    else:
        (lo,), lgrads = _grads(lambda: run(causal_conv1d_ref, lows), lows)
        assert_close_to_ref(out, ref, lo)
        for name, gk, gr, gl in zip(names, grads, rgrads, lgrads):
            assert_close_to_ref(gk, gr, gl, atol=1e-2 * max(1.0, gr.abs().max().item()), name=name)
    if with_init:
        assert torch.all(grads[3][0] == 0)  # row 0 starts with padding: its initial states feed only padding
    for bi in range(2):
        for sid in seq_idx[bi][seq_idx[bi] >= 0].unique():
            pos = (seq_idx[bi] == sid).nonzero().flatten()
            if with_init and bi == 1 and sid == 9:
                continue  # continues the initial states: covered by the reference
            seg = x[bi:bi + 1, :, pos[0]:pos[-1] + 1].contiguous()
            alone = causal_conv1d_fn(seg, w, b, activation="silu")
            assert torch.allclose(out[bi:bi + 1, :, pos[0]:pos[-1] + 1].detach(), alone, atol=1e-6)


@pytest.mark.parametrize("dtype,with_init", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)])
def test_seq_idx_padding_outputs_zero_and_feeds_nothing(dtype, with_init):
    check_seq_idx_padding(dtype, with_init)


def test_seq_idx_padding_example():
    """x ones, weight ones (1, 3), seq_idx [[0, 0, -1, -1, 1, 1]]: padding outputs 0, and position 4 (a new
    sequence after padding) sees only itself."""
    out = causal_conv1d_fn(torch.ones(1, 1, 6), torch.ones(1, 3), seq_idx=torch.tensor([[0, 0, -1, -1, 1, 1]],
                                                                                          dtype=torch.int32))
    assert out.tolist() == [[[1.0, 2.0, 0.0, 0.0, 1.0, 2.0]]]


def test_gradcheck_seq_idx_padding():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 2, 9, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, generator=g, dtype=torch.float64, requires_grad=True)
    init = torch.randn(1, 2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    seq_idx = torch.tensor([[0, 0, -1, 1, 1, 1, -1, -1, 2]], dtype=torch.int32)

    def f(x, w, b, init):
        return causal_conv1d_fn(x.float(), w.float(), b.float(), seq_idx=seq_idx, initial_states=init.float(),
                                activation="silu").double()

    assert torch.autograd.gradcheck(f, (x, w, b, init), eps=1e-2, atol=2e-3, rtol=2e-3)


def check_update_serving(dtype=torch.float32, seqlen=3, state_len=6, circular=True, indexed=True, width=4):
    """causal_conv1d_update with cache_seqlens (circular buffer, wrapping past state_len) and/or
    conv_state_indices (a pool of 7 slots, one padding row) against the float64 reference; slots no row
    names stay bit-identical."""
    g = torch.Generator().manual_seed(seqlen * 10 + state_len)
    batch, pool = 4, 7 if indexed else 4
    x = torch.randn(batch, DIM, seqlen, generator=g).to(dtype)
    w = (torch.randn(DIM, width, generator=g) / 2).to(torch.float32)
    b = torch.randn(DIM, generator=g)
    state = torch.randn(pool, DIM, state_len, generator=g).to(dtype)
    idx = torch.tensor([5, -1, 0, 3], dtype=torch.int32) if indexed else None
    cs = torch.tensor([0, 4, 2 * state_len - 1, 1000], dtype=torch.int32) if circular else None
    before = state.clone()
    out = causal_conv1d_update(x, state, w, b, activation="silu", cache_seqlens=cs, conv_state_indices=idx)
    ref, ref_state = causal_conv1d_update_ref(x.double(), before.double(), w.double(), b.double(), "silu", cs, idx)
    lo, _ = causal_conv1d_update_ref(x, before, w.to(dtype), b.to(dtype), "silu", cs, idx)
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert_close_to_ref(out, ref)
    else:
        assert_close_to_ref(out, ref, lo)
    assert torch.equal(state, ref_state.to(dtype))  # copies of inputs: exact
    if indexed:
        assert torch.all(out[1] == 0)
        untouched = [s for s in range(pool) if s not in (5, 0, 3)]
        assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("dtype,seqlen,state_len,circular,indexed", [
    (torch.float32, 1, 3, True, False), (torch.float32, 3, 6, True, True), (torch.float32, 9, 5, True, True),
    (torch.float32, 2, 5, False, True), (torch.bfloat16, 3, 6, True, True)])
def test_update_cache_seqlens_and_state_indices(dtype, seqlen, state_len, circular, indexed):
    check_update_serving(dtype, seqlen, state_len, circular, indexed)


def test_update_circular_steps_match_full_conv():
    """Token by token through a circular buffer (state_len 5 > width-1) equals the full convolution."""
    x, w, b = _inputs(batch=2, seqlen=12)
    full = causal_conv1d_fn(x, w, b, activation="silu")
    state = torch.zeros(2, DIM, 5)
    steps = [causal_conv1d_update(x[..., t], state, w, b, "silu", cache_seqlens=torch.tensor([t, t], dtype=torch.int32))
             for t in range(12)]
    assert torch.allclose(torch.stack(steps, -1), full, atol=1e-5)


def check_varlen_states(dtype=torch.float32, index_dtype=torch.int32):
    """Exact against the reference: sequences longer and shorter than state_len, and an empty one."""
    lens = [7, 2, 0, 4, 1]
    x = torch.randn(sum(lens), DIM).to(dtype)
    cu = torch.tensor([0] + lens, dtype=index_dtype).cumsum(0).to(index_dtype)
    states = causal_conv1d_varlen_states(x, cu, 4)
    assert states.shape == (5, DIM, 4) and states.dtype == dtype and states.stride(1) == 1
    assert torch.equal(states, causal_conv1d_varlen_states_ref(x, cu, 4))
    assert torch.equal(states[1, :, :2], torch.zeros(DIM, 2)) and torch.equal(states[1, :, 2:], x[7:9].T)


@pytest.mark.parametrize("dtype,index_dtype", [(torch.float32, torch.int32), (torch.bfloat16, torch.int64)])
def test_varlen_states(dtype, index_dtype):
    check_varlen_states(dtype, index_dtype)


def test_varlen_states_continue_decoding():
    """The states of a packed batch continue each sequence's decode like running it alone."""
    x, w, b = _inputs(batch=1, seqlen=13)
    lens = [8, 5]
    cu = torch.tensor([0, 8, 13], dtype=torch.int32)
    states = causal_conv1d_varlen_states(x[0].T.contiguous(), cu, 3)
    nxt = torch.randn(2, DIM)
    out = causal_conv1d_update(nxt, states.contiguous(), w, b, "silu")
    for i, (s, n) in enumerate(zip(cu[:-1].tolist(), lens)):
        seq = torch.cat([x[:, :, s:s + n], nxt[i][None, :, None]], -1)
        assert torch.allclose(out[i], causal_conv1d_fn(seq, w, b, activation="silu")[0, :, -1], atol=1e-5)


def test_serving_calls_compile_without_graph_breaks():
    x, w, b = _inputs(batch=2, seqlen=1)

    def step(x, state, idx, cs, packed, cu):
        return causal_conv1d_update(x, state, w, b, "silu", cache_seqlens=cs, conv_state_indices=idx), \
            causal_conv1d_varlen_states(packed, cu, 3)

    args = (x[..., 0], torch.randn(5, DIM, 4), torch.tensor([4, -1], dtype=torch.int32),
            torch.tensor([2, 0], dtype=torch.int32), torch.randn(9, DIM), torch.tensor([0, 4, 9], dtype=torch.int32))
    eager_state = args[1].clone()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    want = step(args[0], eager_state, *args[2:])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(args[1], eager_state)


def _update_call(**kw):
    x, w, _ = _inputs(batch=2, seqlen=1)
    a = dict(x=x[..., 0], conv_state=torch.randn(4, DIM, 3), weight=w)
    a.update(kw)
    return a


@pytest.mark.parametrize("kw,exc,match", [
    (dict(conv_state_indices=torch.tensor([4, 0], dtype=torch.int32)), ValueError, "conv_state_indices: a slot"),
    (dict(conv_state_indices=torch.tensor([1, 1], dtype=torch.int32)), ValueError, "conv_state_indices: two rows"),
    (dict(conv_state_indices=torch.tensor([1, 2])), TypeError, "conv_state_indices: dtype"),
    (dict(conv_state_indices=torch.tensor([1], dtype=torch.int32)), ValueError, "conv_state_indices: expected shape"),
    (dict(conv_state_indices=torch.tensor([0, 1], dtype=torch.int32), cache_seqlens=torch.tensor([3, -1],
          dtype=torch.int32)), ValueError, "cache_seqlens: must be >= 0"),
    (dict(conv_state=torch.randn(2, DIM, 3), cache_seqlens=torch.tensor([0, 1])), TypeError, "cache_seqlens: dtype"),
    (dict(), ValueError, "conv_state: expected"),  # a pool without conv_state_indices
])
def test_update_bad_serving_arguments_leave_state_untouched(kw, exc, match):
    a = _update_call(**kw)
    before = a["conv_state"].clone()
    with pytest.raises(exc, match=match):
        causal_conv1d_update(**a)
    assert torch.equal(a["conv_state"], before)


@pytest.mark.parametrize("cu,exc,match", [
    (torch.tensor([1, 4, 9], dtype=torch.int32), ValueError, "cu_seqlens: must start at 0"),
    (torch.tensor([0, 4, 10], dtype=torch.int32), ValueError, "end at or before total_tokens"),
    (torch.tensor([0, 6, 4, 9], dtype=torch.int32), ValueError, "non-decreasing"),
    (torch.tensor([0, 4, 9], dtype=torch.float32), TypeError, "cu_seqlens: dtype"),
    (torch.zeros(0, dtype=torch.int32), ValueError, "cu_seqlens: expected"),
])
def test_varlen_states_bad_cu_seqlens(cu, exc, match):
    with pytest.raises(exc, match=match):
        causal_conv1d_varlen_states(torch.randn(9, DIM), cu, 3)
    with pytest.raises(ValueError, match="state_len"):
        causal_conv1d_varlen_states(torch.randn(9, DIM), torch.tensor([0, 9]), 0)


def test_update_padding_row_cache_seqlens_is_not_read():
    a = _update_call(conv_state_indices=torch.tensor([-1, 2], dtype=torch.int32),
                     cache_seqlens=torch.tensor([-5, 2], dtype=torch.int32))
    before = a["conv_state"].clone()
    out = causal_conv1d_update(**a)
    ref, ref_state = causal_conv1d_update_ref(a["x"].double(), before.double(), a["weight"].double(),
                                              cache_seqlens=a["cache_seqlens"], conv_state_indices=a["conv_state_indices"])
    assert torch.all(out[0] == 0) and torch.equal(a["conv_state"], ref_state.float())
    assert_close_to_ref(out, ref)
