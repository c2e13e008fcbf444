"""Mamba2 (mamba2.Mamba2 semantics) on the TVM kernels against the block composed from the float64
references: names/shapes/init, forward and every parameter gradient, prefill + decode, bf16 autocast,
torch.compile, DDP (2 processes, gloo), bad input."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from tests.modules._util import assert_rel_close, compare_grads, params64, weighted_loss
from tvm_mamba.modules.mamba2 import Mamba2
from tvm_mamba.reference.blocks import mamba2_ref

# one static config shared by the tests and test_lm.py: d_inner 64, nheads 4, conv_dim 96, chunk 8
D_MODEL, D_STATE, HEADDIM, CHUNK, BATCH, SEQLEN = 32, 16, 16, 8, 2, 12
CFG = dict(d_state=D_STATE, headdim=HEADDIM, chunk_size=CHUNK)
# a second config: 2 groups, D per channel, a binding dt_limit (the decode step clamps in torch)
CFG2 = dict(CFG, ngroups=2, D_has_hdim=True, dt_limit=(0.0, 0.05))

# mamba_ssm 2.3.x Mamba2(d_model=32, d_state=16, headdim=16).state_dict(): d_inner 64, nheads 4,
# d_in_proj = 2*64 + 2*1*16 + 4 = 164, conv_dim = 64 + 2*16 = 96; own parameters first.
EXPECTED_STATE_DICT = [
    ("dt_bias", (4,)), ("A_log", (4,)), ("D", (4,)), ("in_proj.weight", (164, 32)), ("conv1d.weight", (96, 1, 4)),
    ("conv1d.bias", (96,)), ("norm.weight", (64,)), ("out_proj.weight", (32, 64)),
]


def _block(seed=0, cfg=CFG, **kw):
    torch.manual_seed(seed)
    return Mamba2(D_MODEL, **cfg, **kw)


def _input(batch=BATCH, seqlen=SEQLEN, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seqlen, D_MODEL, generator=g)


def _ref_kw(m):
    return dict(headdim=m.headdim, d_state=m.d_state, ngroups=m.ngroups, dt_limit=m.dt_limit)


def test_state_dict_names_and_shapes():
    assert [(k, tuple(v.shape)) for k, v in _block().state_dict().items()] == EXPECTED_STATE_DICT
    sd = _block(cfg=CFG2).state_dict()  # ngroups 2: in_proj 2*64 + 2*2*16 + 4 = 196, conv_dim 64 + 64 = 128
    assert tuple(sd["in_proj.weight"].shape) == (196, 32) and tuple(sd["conv1d.weight"].shape) == (128, 1, 4)
    assert tuple(sd["D"].shape) == (64,)
    sd = _block(d_ssm=32).state_dict()  # d_mlp = (2*64 - 2*32)/2 = 32 gated-MLP channels beside the SSM
    assert tuple(sd["in_proj.weight"].shape) == (2 * 64 + 2 * 16 + 2, 32) and tuple(sd["norm.weight"].shape) == (32,)
    assert "norm.weight" not in _block(rmsnorm=False).state_dict()


def test_init_matches_mamba2():
    m = _block(A_init_range=(2, 8), dt_min=0.002, dt_max=0.05)
    A = torch.exp(m.A_log)
    assert A.min() >= 2 - 1e-5 and A.max() <= 8 + 1e-5
    dt = F.softplus(m.dt_bias.double())
    assert dt.min() >= 0.002 * (1 - 1e-5) and dt.max() <= 0.05 * (1 + 1e-5)
    assert torch.equal(m.D, torch.ones(4)) and torch.equal(m.norm.weight, torch.ones(64))
    assert m.norm.group_size == 64 and not m.norm.norm_before_gate and m.norm.eps == 1e-5
    assert _block(cfg=CFG2).norm.group_size == 32


def test_state_dict_round_trip():
    a, b = _block(seed=0), _block(seed=5)
    x = _input()
    b.load_state_dict(a.state_dict(), strict=True)
    torch.testing.assert_close(b(x), a(x), rtol=0, atol=0)


def _randomize(m):
    with torch.no_grad():
        m.D.uniform_(0.5, 1.5)
        m.conv1d.bias.uniform_(-0.3, 0.3)
        m.norm.weight.uniform_(0.5, 1.5)


@pytest.mark.parametrize("cfg", [CFG, CFG2, dict(CFG, use_mem_eff_path=False)],
                         ids=["default", "groups2_Dhdim_dtlimit", "unfused"])
def test_forward_and_every_gradient_vs_reference(cfg):
    m = _block(cfg=cfg)  # use_mem_eff_path (default): mamba_split_conv1d_scan_combined, else conv + SSD + norm
    _randomize(m)
    x = _input().requires_grad_(True)
    out = m(x)
    weighted_loss(out).backward()
    p64 = params64(m)
    x64 = x.detach().double().requires_grad_(True)
    ref = mamba2_ref(p64, x64, **_ref_kw(m))
    weighted_loss(ref).backward()
    assert_rel_close(out, ref, 5e-5, "out")
    assert_rel_close(x.grad, x64.grad, 1e-4, "grad u")
    compare_grads(m, p64, rel=2e-4)


@pytest.mark.parametrize("cfg", [CFG, CFG2], ids=["default", "groups2_Dhdim_dtlimit"])
def test_prefill_then_decode_reproduces_forward(cfg):
    m = _block(cfg=cfg)
    _randomize(m)
    x = _input()
    with torch.no_grad():
        full = m(x)
        p = 9  # crosses a chunk boundary (chunk 8)
        out_p, conv_state, ssm_state = m(x[:, :p], return_final_states=True)
        _, conv_ref, ssm_ref = mamba2_ref(params64(m), x[:, :p].double(), return_final_states=True, **_ref_kw(m))
        assert_rel_close(conv_state, conv_ref, 1e-6, "prefill conv_state")
        assert_rel_close(ssm_state, ssm_ref, 5e-5, "prefill ssm_state")
        steps = [out_p]
        for t in range(p, SEQLEN):
            steps.append(m.step(x[:, t:t + 1], conv_state, ssm_state)[0])
        assert_rel_close(torch.cat(steps, dim=1), full, 2e-5, "decode vs forward")


def test_16bit_ssm_state_cache_decodes_like_float32():
    """A cache with a bf16 ssm_state (upstream allocates it in the model's dtype) is accepted: the decode kernel
    keeps it in bf16 with fp32 math, close to the float32 cache."""
    m = _block()
    x = _input()
    with torch.no_grad():
        _, conv32, ssm32 = m(x[:, :9], return_final_states=True)
        conv16, ssm16 = conv32.clone(), ssm32.to(torch.bfloat16)
        for t in range(9, SEQLEN):
            y32 = m.step(x[:, t:t + 1], conv32, ssm32)[0]
            y16 = m.step(x[:, t:t + 1], conv16, ssm16)[0]
            assert_rel_close(y16, y32.double(), 2e-2, f"bf16-state step {t}")
    assert ssm16.dtype == torch.bfloat16
    assert_rel_close(ssm16.float(), ssm32.double(), 2e-2, "bf16 state")


def test_seq_idx_and_flattened_input():
    m = _block()
    x = _input()
    seq_idx = torch.tensor([[0] * 5 + [1] * 7, [0] * 12], dtype=torch.int32)
    with torch.no_grad():
        out = m(x, seq_idx=seq_idx)
        # the second sequence of row 0 restarts: it equals the block run on it alone
        assert_rel_close(out[0, 5:], m(x[:1, 5:])[0], 2e-5, "seq_idx restart")
        assert_rel_close(out[1], m(x[1:])[0], 2e-5, "seq_idx single sequence")
        flat = m(x.reshape(-1, D_MODEL), seqlen=SEQLEN)
        torch.testing.assert_close(flat, m(x).reshape(-1, D_MODEL), rtol=0, atol=0)


def test_cu_seqlens_varlen_prefill_then_decode():
    """cu_seqlens packs 3 sequences in one row: the output equals each sequence run alone (seq_idx derived),
    the varlen prefill writes each sequence's final (conv_state, ssm_state) into cache rows 0..2, and decode
    steps from there reproduce each sequence's continuation."""
    from tvm_mamba.modules.generation import InferenceParams

    m = _block(layer_idx=0)
    lens = [5, 2, 9]  # one shorter than d_conv: its conv state is zero-padded on the left
    xs = [_input(batch=1, seqlen=n, seed=10 + i) for i, n in enumerate(lens)]
    nxt = _input(batch=3, seqlen=1, seed=20)
    cu = torch.tensor([0, 5, 7, 16], dtype=torch.int32)
    with torch.no_grad():
        alone = [m(x, return_final_states=True) for x in xs]
        params = InferenceParams(max_seqlen=20, max_batch_size=3)
        out = m(torch.cat(xs, 1), cu_seqlens=cu, inference_params=params)
        assert_rel_close(out, torch.cat([a[0] for a in alone], 1), 1e-5, "packed out")
        conv_state, ssm_state = params.key_value_memory_dict[0]
        for i, (_, conv, ssm) in enumerate(alone):
            assert_rel_close(conv_state[i], conv[0], 1e-6, f"conv_state {i}")
            assert_rel_close(ssm_state[i], ssm[0], 1e-5, f"ssm_state {i}")
        params.seqlen_offset = 16
        step = m(nxt, inference_params=params)
        for i, x in enumerate(xs):
            full = m(torch.cat([x, nxt[i:i + 1]], 1))
            assert_rel_close(step[i], full[0, -1:], 1e-5, f"step after varlen prefill {i}")
        seq_idx = torch.tensor([[0] * 5 + [1] * 2 + [2] * 9], dtype=torch.int32)
        assert torch.equal(m(torch.cat(xs, 1), seq_idx=seq_idx, cu_seqlens=cu), out)  # upstream passes both
    with pytest.raises(ValueError, match="seq_idx: does not match cu_seqlens"):
        m(torch.cat(xs, 1), seq_idx=torch.zeros(1, 16, dtype=torch.int32), cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens: must start at 0"):
        m(torch.cat(xs, 1), cu_seqlens=torch.tensor([0, 5, 17], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens: must start at 0"):
        m(torch.cat(xs, 1), cu_seqlens=torch.tensor([0, 9, 5, 16], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens: expected a 1-D int32"):
        m(torch.cat(xs, 1), cu_seqlens=cu.float())


def test_bf16_autocast_training_step():
    m = _block()
    x = _input()
    ref = m(x).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() <= 0.05 * ref.abs().max()
    (out.float() ** 2).mean().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name
    torch.optim.AdamW(m.parameters(), lr=1e-3).step()


def test_torch_compile_fullgraph_matches_eager():
    # backend="aot_eager": forward and backward traced with fullgraph through the custom ops' fake kernels;
    # inductor's C++ compile of the surrounding glue costs minutes here and tests nothing of ours.
    m = _block()
    x = _input()
    weighted_loss(m(x)).backward()
    grads_e = {k: p.grad.clone() for k, p in m.named_parameters()}
    out_e = m(x).detach()
    m.zero_grad()
    torch._dynamo.reset()
    out_c = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
    weighted_loss(out_c).backward()
    torch.testing.assert_close(out_c, out_e, rtol=1e-6, atol=1e-6)
    for k, p in m.named_parameters():
        torch.testing.assert_close(p.grad, grads_e[k], rtol=1e-5, atol=1e-6, msg=k)


# ---------------------------------------------------------------------------------------------------------
# DDP: 2 processes, gloo, CPU. Each rank gets half of the batch; DDP's all-reduced (averaged) gradients must
# equal the single-process gradients of the mean loss over the whole batch.
def _ddp_worker(rank, world, port, x, state, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        m = Mamba2(D_MODEL, **CFG)
        m.load_state_dict(state)
        ddp = torch.nn.parallel.DistributedDataParallel(m)
        part = x.chunk(world)[rank]
        (ddp(part) ** 2).mean().backward()
        if rank == 0:
            torch.save({k: p.grad for k, p in m.named_parameters()}, out_path)
        # both ranks leave together: a rank tearing gloo down while its peer still works aborted the peer once
        # ("terminate called without an active exception", loaded machine)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_gloo_two_processes_match_single_process(tmp_path):
    m = _block()
    x = _input(batch=4)
    (m(x) ** 2).mean().backward()
    out_path = str(tmp_path / "grads.pt")
    mp.start_processes(_ddp_worker, args=(2, _free_port(), x, m.state_dict(), out_path), nprocs=2,
                       join=True, start_method="spawn")
    grads = torch.load(out_path)
    for k, p in m.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-5, atol=1e-7, msg=k)


def test_bad_inputs_name_the_argument():
    m = _block()
    with pytest.raises(ValueError, match="u: expected .*d_model=32"):
        m(torch.randn(2, 5, 30))
    conv_state, ssm_state = m.allocate_inference_cache(2, 16)
    assert tuple(conv_state.shape) == (2, 96, 4) and tuple(ssm_state.shape) == (2, 4, 16, 16)
    tok = torch.randn(2, 1, 32)
    with pytest.raises(ValueError, match="hidden_states.*d_model=32"):
        m.step(torch.randn(2, 1, 16), conv_state, ssm_state)
    with pytest.raises(ValueError, match="conv_state: expected shape"):
        m.step(tok, torch.zeros(2, 64, 4), ssm_state)
    with pytest.raises(ValueError, match="ssm_state: expected shape"):
        m.step(tok, conv_state, torch.zeros(2, 4, 16, 8))
    with pytest.raises(TypeError, match="ssm_state: dtype"):
        m.step(tok, conv_state, ssm_state.double())
    with pytest.raises(ValueError, match="ssm_state: allocated for batch 1, but the input has batch 2"):
        m.step(tok, conv_state, ssm_state[:1])
    with pytest.raises(TypeError, match="conv_state: expected a torch.Tensor"):
        m.step(tok, None, ssm_state)
    assert conv_state.abs().sum() == 0 and ssm_state.abs().sum() == 0  # nothing ran
    with pytest.raises(ValueError, match="headdim"):
        Mamba2(32, headdim=24)
    with pytest.raises(ValueError, match="ngroups"):
        Mamba2(32, headdim=16, ngroups=3)
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(_input(), cu_seqlens=torch.tensor([0, 12]))
