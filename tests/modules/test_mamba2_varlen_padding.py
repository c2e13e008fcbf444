"""Mamba2 / MambaLMHeadModel with packed sequences followed by padding (cu_seqlens[-1] < seqlen), the scenario
of mamba_ssm 2.3.2.post1's test_generation_varlen_with_padding at a small size: three prompts packed in one
row, the row padded at the end, the padding also an empty fourth sequence (cu_seqlens[-1] = cu_seqlens[-2])
whose seq_idx id fills the padding, a varlen prefill into the inference cache, then decode steps.

Each packed sequence must give what it gives run alone (outputs, cache rows, decode continuation, training
gradients); the padding gets no cache row (the empty sequence's row is zero) and its own output is that of
the padding run alone (its own id) or 0 (ids < 0: the conv's padding marker zeroes it)."""
from __future__ import annotations

import pytest
import torch

from tests.modules._util import assert_rel_close
from tvm_mamba.modules.generation import InferenceParams
from tvm_mamba.modules.lm import MambaConfig, MambaLMHeadModel
from tvm_mamba.modules.mamba2 import Mamba2

CFG = dict(d_state=16, headdim=16, chunk_size=8)  # as test_mamba2.py (shared kernel builds)
D_MODEL = 32
LENS = [5, 2, 9]  # one shorter than d_conv; chunk boundaries at 8 and 16 fall inside / at the end of sequences
PAD = 6
CU = [0, 5, 7, 16]
SEQLEN = CU[-1] + PAD
# how the padding is given: upstream's test (an empty 4th sequence, its id 3 over the padding: the test's
# `seq_idx[a:b] = -1` indexes the batch axis and changes nothing), seq_idx derived from cu_seqlens alone
# (the padding gets id 3, a sequence of its own), and the padding marked -1
LAYOUTS = {
    "upstream": (CU + [CU[-1]], [3] * PAD),
    "derived": (CU, None),
    "negative": (CU, [-1] * PAD),
}


def _block(**kw):
    torch.manual_seed(0)
    return Mamba2(D_MODEL, **CFG, layer_idx=0, **kw)


def _packed(layout):
    """-> cu_seqlens (int32), seq_idx (1, SEQLEN) int32 or None."""
    cu, tail = LAYOUTS[layout]
    if tail is None:
        return torch.tensor(cu, dtype=torch.int32), None
    ids = [i for i, n in enumerate(LENS) for _ in range(n)] + tail
    return torch.tensor(cu, dtype=torch.int32), torch.tensor([ids], dtype=torch.int32)


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(1, n, D_MODEL, generator=g) for n in LENS]
    return xs, torch.randn(1, PAD, D_MODEL, generator=g)


def _padding_out(m, pad, layout):
    """What the padding positions give: the padding run alone (a sequence of its own), or 0 where marked -1."""
    return torch.zeros(1, PAD, D_MODEL) if layout == "negative" else m(pad)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_varlen_prefill_with_padding_then_decode(layout):
    """Prefill (inference_params: the unfused path, causal_conv1d_varlen_states + return_varlen_states): each
    sequence's output and cache rows equal it run alone, the empty sequence's rows are zero, the padding's
    output is its own; a decode step from the cache continues every sequence."""
    m = _block()
    xs, pad = _inputs()
    cu, seq_idx = _packed(layout)
    nseq = cu.numel() - 1
    nxt = torch.randn(nseq, 1, D_MODEL, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        alone = [m(x, return_final_states=True) for x in xs]
        params = InferenceParams(max_seqlen=SEQLEN + 4, max_batch_size=nseq)
        out = m(torch.cat(xs + [pad], 1), seq_idx=seq_idx, cu_seqlens=cu, inference_params=params)
        conv_state, ssm_state = (s.clone() for s in params.key_value_memory_dict[0])
        for i, (s, e) in enumerate(zip(CU[:-1], CU[1:])):
            assert_rel_close(out[:, s:e], alone[i][0], 1e-5, f"out of sequence {i}")
            assert_rel_close(conv_state[i], alone[i][1][0], 1e-6, f"conv_state {i}")
            assert_rel_close(ssm_state[i], alone[i][2][0], 1e-5, f"ssm_state {i}")
        assert conv_state.shape[0] == ssm_state.shape[0] == nseq
        if nseq > len(LENS):  # upstream's empty 4th sequence: zero states, nothing of the padding
            assert torch.all(conv_state[3] == 0) and torch.all(ssm_state[3] == 0)
        assert_rel_close(out[:, CU[-1]:], _padding_out(m, pad, layout), 1e-5, "out of the padding")
        params.seqlen_offset = SEQLEN
        step = m(nxt, inference_params=params)
        for i, x in enumerate(xs):
            assert_rel_close(step[i], m(torch.cat([x, nxt[i:i + 1]], 1))[0, -1:], 1e-5, f"step of sequence {i}")


@pytest.mark.parametrize("mem_eff", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("layout", ["upstream", "negative"])
def test_training_with_padding_equals_sequences_alone(layout, mem_eff):
    """Training on a padded packed row (no inference_params; mamba_split_conv1d_scan_combined when mem_eff):
    a loss over the real positions has the gradients of the sequences' losses run alone, summed; the padding's
    inputs get no gradient."""
    m = _block(use_mem_eff_path=mem_eff)
    xs, pad = _inputs(seed=3)
    cu, seq_idx = _packed(layout)
    g = torch.Generator().manual_seed(4)
    w = [torch.randn(1, n, D_MODEL, generator=g) for n in LENS]

    def grads(fn):
        m.zero_grad()
        fn().backward()
        return {k: p.grad.clone() for k, p in m.named_parameters()}

    u = torch.cat(xs + [pad], 1).requires_grad_()
    packed = grads(lambda: (m(u, seq_idx=seq_idx, cu_seqlens=cu)[:, :CU[-1]] * torch.cat(w, 1)).sum())
    alone_x = [x.clone().requires_grad_() for x in xs]
    alone = grads(lambda: sum((m(x) * wi).sum() for x, wi in zip(alone_x, w)))
    for k in packed:
        assert_rel_close(packed[k], alone[k], 1e-5, f"grad {k}")
    assert_rel_close(u.grad[:, :CU[-1]], torch.cat([x.grad for x in alone_x], 1), 1e-5, "grad of the inputs")
    assert torch.all(u.grad[:, CU[-1]:] == 0), "the padding's inputs got a gradient"


@pytest.mark.parametrize("cu,seq_idx,exc,match", [
    ([1, 5, 16], None, ValueError, "cu_seqlens: must start at 0"),
    ([0, 7, 5, 16], None, ValueError, "cu_seqlens: must start at 0, be nondecreasing"),
    ([0, 5, SEQLEN + 1], None, ValueError, f"end at seqlen={SEQLEN} or before it"),
    ([0.0, 5.0, 16.0], None, ValueError, "cu_seqlens: expected a 1-D int32"),
    (CU, [0] * 5 + [1] * 2 + [1] * 9 + [3] * PAD, ValueError, "seq_idx: does not match cu_seqlens"),
    (CU, [0] * 5 + [1] * 2 + [2] * 9 + [0] * PAD, ValueError, "seq_idx: must be nondecreasing"),
])
def test_bad_cu_seqlens_refused_before_anything_runs(monkeypatch, cu, seq_idx, exc, match):
    """Truly bad cu_seqlens (and a seq_idx contradicting it before the padding, or a padding id that breaks
    seq_idx's rule) are refused naming the argument; no kernel ran and the cache is untouched."""
    from tvm_mamba.torch_ops import _dlpack, causal_conv1d, linear, rmsnorm_gated, ssd

    m = _block()
    xs, pad = _inputs()
    params = InferenceParams(max_seqlen=SEQLEN, max_batch_size=len(cu) - 1)
    states = [s.clone() for s in m.allocate_inference_cache(len(cu) - 1, SEQLEN)]
    params.key_value_memory_dict[0] = tuple(s.clone() for s in states)

    def refuse(*a, **k):
        raise AssertionError("a kernel was requested before validation finished")

    for module in (_dlpack, causal_conv1d, linear, rmsnorm_gated, ssd):
        monkeypatch.setattr(module, "kernel_for", refuse)
    cu = torch.tensor(cu, dtype=torch.float32 if isinstance(cu[0], float) else torch.int32)
    seq = torch.tensor([seq_idx], dtype=torch.int32) if seq_idx is not None else None
    with torch.no_grad(), pytest.raises(exc, match=match):
        m(torch.cat(xs + [pad], 1), seq_idx=seq, cu_seqlens=cu, inference_params=params)
    for got, before in zip(params.key_value_memory_dict[0], states):
        assert torch.equal(got, before)


def test_lm_varlen_generation_with_padding():
    """upstream's test flow on MambaLMHeadModel: reference logits from a forward over the unpadded packed row
    with seq_idx, then varlen generation (prefill of the padded prompts with seq_idx and cu_seqlens, teacher
    tokens decoded for every row, num_last_tokens=1): every real sequence's scores equal the reference."""
    torch.manual_seed(0)
    model = MambaLMHeadModel(MambaConfig(d_model=D_MODEL, n_layer=2, vocab_size=50, ssm_cfg=dict(layer="Mamba2", **CFG)))
    genlen, lens = 3, [l + 3 for l in LENS] + [PAD + 3]  # the last: the padding (and its teacher tokens)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randint(0, 50, (1, n), generator=g) for n in lens]
    cu = torch.tensor([0] + lens[:-1]).cumsum(0).to(torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), torch.tensor(lens[:-1]))[None]
    with torch.no_grad():
        ref = model(torch.cat(xs[:-1], 1), seq_idx=seq_idx).logits
        ref = torch.cat([ref[:, e - genlen - 1:e - 1] for e in cu[1:].tolist()])  # (3, genlen, vocab)
        prompt = torch.cat([x[:, :-genlen] for x in xs], 1)
        cu_p, seq_p = _packed("upstream")
        params = InferenceParams(max_seqlen=64, max_batch_size=4)
        logits = model(prompt, inference_params=params, seq_idx=seq_p, cu_seqlens=cu_p).logits
        scores = [logits[0, cu_p[1:].long() - 1][:, None]]
        for i in range(1, genlen):
            params.seqlen_offset += 1
            tokens = torch.stack([x[0, -genlen + i - 1] for x in xs])[:, None]
            scores.append(model(tokens, inference_params=params, num_last_tokens=1).logits)
    got = torch.cat(scores, 1)
    assert got.shape == (4, genlen, ref.shape[-1])
    assert_rel_close(got[:3], ref, 1e-5, "varlen generation scores")
