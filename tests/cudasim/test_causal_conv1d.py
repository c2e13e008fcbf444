"""causal_conv1d_fn / causal_conv1d_update with the CUDA kernels run on the CPU by the execution harness
(tvm_mamba.simulate_cuda), against the float64 reference written from the math. Mirrors
tests/torch_ops/test_causal_conv1d.py at small model dims (every distinct static-dim set is one ~1 s compile).

The CUDA schedule runs a block per (batch, channel) row and tile of 1024 time steps (x and the other window
inputs staged in shared memory): seqlen 1100 crosses a tile edge (the staged halo, the ring's wrap) and the
other seqlens end in a ragged tile. Smaller tiles (more edges) run in
tests/schedules/test_causal_conv1d.py::test_cuda_small_tiles_in_the_harness.
"""
from __future__ import annotations

import pytest
import torch

import tvm_mamba
from tests.conftest import assert_close_to_ref
from tvm_mamba import causal_conv1d_fn, causal_conv1d_update
from tvm_mamba.compute.causal_conv1d import build_check_configs
from tvm_mamba.reference.causal_conv1d import causal_conv1d_ref, causal_conv1d_update_ref
from tests.torch_ops.test_causal_conv1d import (_grads, _inputs, _seq_idx, check_seq_idx_padding,
                                                check_update_serving, check_varlen_states)

DIM = 24


pytestmark = pytest.mark.usefixtures("sim")


def _leaves(*tensors, dtype=None):
    return [t.detach().to(dtype or t.dtype).clone().requires_grad_() if t is not None else None for t in tensors]


def _assert_fwd_bwd(leaves, refs, activation="silu"):
    """out and (dx, dweight, dbias) of the kernel on ``leaves`` against the float64 reference on ``refs``."""
    (out,), grads = _grads(lambda: causal_conv1d_fn(*leaves, activation=activation), leaves)
    (ref,), rgrads = _grads(lambda: causal_conv1d_ref(*refs, activation=activation), refs)
    assert_close_to_ref(out, ref)
    for name, gk, gr in zip(("dx", "dweight", "dbias"), grads, rgrads):
        assert_close_to_ref(gk, gr, atol=2e-4, name=name)


@pytest.mark.parametrize("seqlen", [1, 5, 37, 200, 1100])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_forward_backward_fp32(seqlen, activation):
    x, w, b = _inputs(seqlen=seqlen)
    leaves, refs = _leaves(x, w, b), _leaves(x, w, b, dtype=torch.float64)
    (out,), grads = _grads(lambda: causal_conv1d_fn(*leaves, activation=activation), leaves)
    (ref,), rgrads = _grads(lambda: causal_conv1d_ref(*refs, activation=activation), refs)
    assert_close_to_ref(out, ref, name="out")
    for name, gk, gr in zip(("dx", "dweight", "dbias"), grads, rgrads):
        assert_close_to_ref(gk, gr, atol=2e-4, rtol=1e-4, name=name)


@pytest.mark.parametrize("width", [2, 3, 8])
def test_widths(width):
    x, w, b = _inputs(width=width, seqlen=29)
    leaves, refs = _leaves(x, w, b), _leaves(x, w, b, dtype=torch.float64)
    _assert_fwd_bwd(leaves, refs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_against_reference_drift(dtype):
    """mamba_ssm's rule: err(kernel) <= 2 * err(reference run in the low precision) + atol; fp32 weight."""
    x, w, b = _inputs(seqlen=45, dtype=dtype, wdtype=torch.float32)
    leaves, refs64 = _leaves(x, w, b), _leaves(x, w, b, dtype=torch.float64)
    refs_lo = _leaves(x, w, b, dtype=dtype)
    (out,), grads = _grads(lambda: causal_conv1d_fn(*leaves, activation="silu"), leaves)
    (ref,), rgrads = _grads(lambda: causal_conv1d_ref(*refs64, activation="silu"), refs64)
    (lo,), lgrads = _grads(lambda: causal_conv1d_ref(*refs_lo, activation="silu"), refs_lo)
    assert out.dtype == dtype and grads[0].dtype == dtype
    assert_close_to_ref(out, ref, lo, name="out")
    assert_close_to_ref(grads[0], rgrads[0], lgrads[0], name="dx")
    # dweight/dbias are fp32 sums over batch*seqlen: compare relative to their magnitude
    for name, gk, gr in zip(("dweight", "dbias"), grads[1:], rgrads[1:]):
        assert gk.dtype == torch.float32
        assert_close_to_ref(gk, gr, atol=3e-2 * gr.abs().max().item(), rtol=0, name=name)


def test_bf16_weight_in_x_dtype():
    x, w, b = _inputs(seqlen=40, dtype=torch.bfloat16, wdtype=torch.bfloat16)
    out = causal_conv1d_fn(x, w, b, activation="silu")
    ref = causal_conv1d_ref(x.double(), w.double(), b.double(), activation="silu")
    lo = causal_conv1d_ref(x, w, b, activation="silu")
    assert_close_to_ref(out, ref, lo)


def test_initial_and_final_states_with_gradients():
    """dinitial_states and the gradient flowing in through final_states (dfinal), seqlen 23 > width."""
    x, w, b = _inputs(seqlen=23)
    init = torch.randn(2, DIM, 3)
    leaves, refs = _leaves(x, w, b, init), _leaves(x, w, b, init, dtype=torch.float64)

    def run(x_, w_, b_, i_, fn):
        return fn(x_, w_, b_, initial_states=i_, return_final_states=True, activation="silu")

    outs, grads = _grads(lambda: run(*leaves, causal_conv1d_fn), leaves)
    routs, rgrads = _grads(lambda: run(*refs, causal_conv1d_ref), refs)
    for name, o, r in zip(("out", "final_states"), outs, routs):
        assert_close_to_ref(o, r, name=name)
    for name, gk, gr in zip(("dx", "dweight", "dbias", "dinit"), grads, rgrads):
        assert_close_to_ref(gk, gr, atol=2e-4, name=name)


def test_final_states_shorter_than_window_with_gradients():
    """seqlen 2 < width-1 = 4: final_states mixes initial states and x, and dfinal flows to both."""
    x, w, b = _inputs(seqlen=2, width=5)
    init = torch.randn(2, DIM, 4)
    leaves, refs = _leaves(x, w, b, init), _leaves(x, w, b, init, dtype=torch.float64)
    run = lambda fn, a: fn(a[0], a[1], a[2], initial_states=a[3], return_final_states=True)  # noqa: E731
    outs, grads = _grads(lambda: run(causal_conv1d_fn, leaves), leaves)
    routs, rgrads = _grads(lambda: run(causal_conv1d_ref, refs), refs)
    assert torch.equal(outs[1], routs[1].float())  # a pure copy of inputs: exact
    assert_close_to_ref(outs[0], routs[0])
    for name, gk, gr in zip(("dx", "dweight", "dbias", "dinit"), grads, rgrads):
        assert_close_to_ref(gk, gr, atol=2e-4, name=name)


def test_final_states_out_param():
    x, w, b = _inputs(seqlen=9)
    final_out = torch.empty(2, DIM, 3)
    out, final = causal_conv1d_fn(x, w, b, return_final_states=True, final_states_out=final_out, activation="silu")
    assert final.data_ptr() == final_out.data_ptr() and torch.equal(final, x[..., -3:])
    assert_close_to_ref(out, causal_conv1d_ref(x.double(), w.double(), b.double(), activation="silu"))


def test_chaining_with_states_equals_whole():
    x, w, b = _inputs(seqlen=50)
    whole = causal_conv1d_fn(x, w, b, activation="silu")
    first, state = causal_conv1d_fn(x[..., :21].contiguous(), w, b, return_final_states=True, activation="silu")
    second, state2 = causal_conv1d_fn(x[..., 21:].contiguous(), w, b, initial_states=state,
                                      return_final_states=True, activation="silu")
    assert torch.allclose(torch.cat([first, second], -1), whole, atol=1e-6)
    assert torch.equal(state, x[..., 18:21]) and torch.equal(state2, x[..., -3:])


def test_seq_idx_matches_separate_runs_and_gradients():
    x, w, b = _inputs(batch=2, seqlen=45)
    seq_idx = _seq_idx(2, 45)
    leaves, refs = _leaves(x, w, b), _leaves(x, w, b, dtype=torch.float64)
    (out,), grads = _grads(lambda: causal_conv1d_fn(*leaves, seq_idx=seq_idx, activation="silu"), leaves)
    (ref,), rgrads = _grads(lambda: causal_conv1d_ref(*refs, seq_idx=seq_idx, activation="silu"), refs)
    assert_close_to_ref(out, ref)
    for name, gk, gr in zip(("dx", "dweight", "dbias"), grads, rgrads):
        assert_close_to_ref(gk, gr, atol=2e-4, name=name)
    # against running each segment on its own (independent of the reference's masking)
    for bi in range(2):
        for sid in seq_idx[bi].unique():
            pos = (seq_idx[bi] == sid).nonzero().flatten()
            seg = x[bi:bi + 1, :, pos[0]:pos[-1] + 1].contiguous()
            alone = causal_conv1d_fn(seg, w, b, activation="silu")
            assert torch.allclose(out[bi:bi + 1, :, pos[0]:pos[-1] + 1].detach(), alone, atol=1e-6)


def _ref_seq_idx_init(x, w, b, init, seq_idx, activation):
    """Reference for seq_idx with initial_states (causal_conv1d_fn's documented extension: the initial
    states continue each row's first sequence). causal_conv1d_ref masks every tap before t=0 when seq_idx
    is given, so the initial states go in as leading positions carrying the id of position 0."""
    lead = init.shape[-1]
    xp = torch.cat([init, x], dim=-1)
    sp = torch.cat([seq_idx[:, :1].expand(-1, lead), seq_idx], dim=-1).contiguous()
    out, final = causal_conv1d_ref(xp, w, b, seq_idx=sp, return_final_states=True, activation=activation)
    return out[..., lead:], final


@pytest.mark.parametrize("first_cut", [1, 2, 5])
def test_seq_idx_with_initial_and_final_states(first_cut):
    """Regression: with seq_idx and initial_states together, the forward (ConvMath.xx in
    compute/causal_conv1d/taps.py) added the initial-state taps to every output t < width-1, also to those of a
    sequence starting at t = 1 or 2, while the backward's dinit only took gradient from the first sequence.
    first_cut is where the second sequence of row 0 starts (1, 2: inside the initial-state window)."""
    x, w, b = _inputs(batch=2, seqlen=19)
    seq_idx = _seq_idx(2, 19, seed=2)
    seq_idx[0] = (torch.arange(19) >= first_cut).to(torch.int32) + 7 * (torch.arange(19) >= 11)
    init = torch.randn(2, DIM, 3)
    leaves, refs = _leaves(x, w, b, init), _leaves(x, w, b, init, dtype=torch.float64)
    run = lambda a: causal_conv1d_fn(a[0], a[1], a[2], seq_idx=seq_idx, initial_states=a[3],  # noqa: E731
                                     return_final_states=True, activation="silu")
    outs, grads = _grads(lambda: run(leaves), leaves)
    routs, rgrads = _grads(lambda: _ref_seq_idx_init(*refs, seq_idx, "silu"), refs)
    for name, o, r in zip(("out", "final_states"), outs, routs):
        assert_close_to_ref(o, r, name=name)
    for name, gk, gr in zip(("dx", "dweight", "dbias", "dinit"), grads, rgrads):
        assert_close_to_ref(gk, gr, atol=2e-4, name=name)
    # independent of any reference: row 0's second sequence alone, without initial states
    seg = x[:1, :, first_cut:11].contiguous()
    alone = causal_conv1d_fn(seg, w, b, activation="silu")
    assert torch.allclose(outs[0][:1, :, first_cut:11].detach(), alone, atol=1e-6)


def test_channel_last_and_noncontiguous_inputs():
    x, w, b = _inputs(seqlen=33)
    x_cl = x.transpose(1, 2).contiguous().transpose(1, 2)  # (batch, dim, seqlen) with stride(1) == 1
    assert x_cl.stride(1) == 1 and not x_cl.is_contiguous()
    leaves, refs = _leaves(x_cl, w, b), _leaves(x, w, b, dtype=torch.float64)
    _assert_fwd_bwd(leaves, refs)
    w_nc = torch.randn(4, DIM).t()  # non-contiguous weight
    assert_close_to_ref(causal_conv1d_fn(x, w_nc), causal_conv1d_ref(x.double(), w_nc.double()))


def test_unaligned_view_is_handled():
    big = torch.randn(2 * DIM * 40 + 3)
    x = big[3:].view(2, DIM, 40)  # data_ptr 12 bytes past an aligned block
    assert x.data_ptr() % 64 != 0
    w = torch.randn(DIM, 4)
    assert_close_to_ref(causal_conv1d_fn(x, w), causal_conv1d_ref(x.double(), w.double()))


def test_empty_sequences(sim):
    x = torch.randn(2, DIM, 0, requires_grad=True)
    w = torch.randn(DIM, 4, requires_grad=True)
    init = torch.randn(2, DIM, 3)
    out, final = causal_conv1d_fn(x, w, initial_states=init, return_final_states=True)
    assert out.shape == (2, DIM, 0) and torch.equal(final, init)
    out.sum().backward()
    assert x.grad.shape == (2, DIM, 0) and torch.equal(w.grad, torch.zeros_like(w))
    assert not sim  # no kernel for an empty sequence


def test_nan_poisons_only_its_windows():
    x, w, b = _inputs(batch=1, seqlen=40)
    x[0, 3, 17] = float("nan")
    out = causal_conv1d_fn(x, w, b, activation="silu")
    expected = torch.zeros_like(out, dtype=torch.bool)
    expected[0, 3, 17:21] = True  # width 4: positions 17..20 see x[17]
    assert torch.equal(torch.isnan(out), expected)


def test_backward_is_deterministic():
    """Two backward passes (the harness runs each in two different thread / block orders) give the same bits."""
    x, w, b = _inputs(batch=3, seqlen=300)
    runs = []
    for _ in range(2):
        leaves = _leaves(x, w, b)
        causal_conv1d_fn(*leaves, activation="silu").pow(2).sum().backward()
        runs.append([t.grad for t in leaves])
    for g1, g2 in zip(*runs):
        assert torch.equal(g1, g2)


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
    assert torch.equal(state2, ref_state.float())  # a shift of inputs: exact


def test_update_bf16_without_bias():
    x, w, _ = _inputs(batch=3, seqlen=4, dtype=torch.bfloat16, bias=False)
    state = torch.randn(3, DIM, 5).to(torch.bfloat16)
    ref_out, ref_state = causal_conv1d_update_ref(x.double(), state.double(), w.double(), activation="silu")
    lo_out, _ = causal_conv1d_update_ref(x, state, w.to(torch.bfloat16), activation="silu")
    out = causal_conv1d_update(x, state, w, activation="silu")
    assert out.dtype == torch.bfloat16
    assert_close_to_ref(out, ref_out, lo_out)
    assert torch.equal(state, ref_state.to(torch.bfloat16))


def test_sm80_forward_backward(sim):
    """The sm_80 source (a separate build) through forward and backward, with seq_idx."""
    x, w, b = _inputs(seqlen=33)
    seq_idx = _seq_idx(2, 33, seed=4)
    leaves, refs = _leaves(x, w, b), _leaves(x, w, b, dtype=torch.float64)
    with tvm_mamba.simulate_cuda("sm_80"):
        (out,), grads = _grads(lambda: causal_conv1d_fn(*leaves, seq_idx=seq_idx, activation="silu"), leaves)
    (ref,), rgrads = _grads(lambda: causal_conv1d_ref(*refs, seq_idx=seq_idx, activation="silu"), refs)
    assert {k.target for k, _ in sim} == {"cudasim-sm_80"}
    assert_close_to_ref(out, ref)
    for name, gk, gr in zip(("dx", "dweight", "dbias"), grads, rgrads):
        assert_close_to_ref(gk, gr, atol=2e-4, name=name)


def test_explain_names_the_simulated_target():
    x, w, b = _inputs(seqlen=16)
    assert "cudasim-sm_90" in tvm_mamba.explain(causal_conv1d_fn, x, w, b)


def _config_id(config):
    direction, static, _ = config
    size = f"w{static['width']}" if "width" in static else f"s{static['state_len']}"
    return "-".join([direction, size] + [k[4:] for k, v in static.items() if k.startswith("has_") and v])


@pytest.mark.parametrize("config", [c for c in build_check_configs() if c[2]["x"] == "float32"], ids=_config_id)
def test_simcheck_build_check_configs_fp32(config):
    """sim-check's own check on every fp32 build-check configuration (dim 1536)."""
    from tvm_mamba.tools.simcheck import causal_conv1d as simcheck

    direction, static, dtypes = config
    simcheck.check(direction, static, dtypes, "sm_90")


@pytest.mark.parametrize("dtype,with_init", [(torch.float32, True), (torch.bfloat16, False)])
def test_seq_idx_padding(dtype, with_init):
    """seq_idx < 0 (padding): out and dx 0 there, padding feeds nothing; every gradient vs the reference."""
    check_seq_idx_padding(dtype, with_init, seqlen=37)


@pytest.mark.parametrize("dtype,seqlen,state_len,circular,indexed", [
    (torch.float32, 1, 3, False, True), (torch.float32, 9, 5, True, True), (torch.bfloat16, 3, 6, True, False)])
def test_update_cache_seqlens_and_state_indices(dtype, seqlen, state_len, circular, indexed):
    """The update kernel (one thread per row, in place on the pool): circular buffer, slot pool, padding row."""
    check_update_serving(dtype, seqlen, state_len, circular, indexed)


def test_varlen_states(sim):
    check_varlen_states(torch.bfloat16, torch.int64)
    assert {k.direction for k, _ in sim} == {"varlen_states"}
