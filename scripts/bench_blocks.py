"""Mamba / Mamba2 blocks (forward + backward) and the small LM (prefill, decode) on this machine.

Blocks: tokens/s of forward+backward of one block against the same block composed from the PyTorch
references (tvm_mamba.reference.blocks, float32, autograd for backward; Mamba-1's reference scan is the
step-by-step recurrence, Mamba-2's the chunked einsum algorithm). LM: prefill tokens/s (one forward over
the prompt, states kept) against the LM composed from the references, and decode tokens/s (one ``step``
per token with the decode kernels) against re-running the full forward over the prefix for every token
(what one does without a state cache).
"""
from __future__ import annotations

import functools

import torch
from benchlib import Row, median_ms

from tvm_mamba.modules.lm import InferenceParams, MambaConfig, MambaLMHeadModel
from tvm_mamba.modules.mamba import Mamba
from tvm_mamba.modules.mamba2 import Mamba2
from tvm_mamba.reference.blocks import lm_ref, mamba2_ref, mamba_ref


def _fwd_bwd(fn, x):
    x = x.clone().requires_grad_(True)
    gy = torch.randn_like(x)

    def step():
        x.grad = None
        fn(x).backward(gy)
    return step


def _params(m):
    return {k: v.detach().clone().requires_grad_(True) for k, v in m.named_parameters()}



def _row(case, shape, tokens, t_ms, r_ms, ref_name):
    note = f"{tokens / t_ms * 1e3:,.0f} tok/s vs ref {tokens / r_ms * 1e3:,.0f} tok/s"
    return Row("blocks", case, shape, t_ms, r_ms, ref_name=ref_name, note=note)


def run(quick: bool = False) -> list[Row]:
    torch.manual_seed(0)
    b, L, d = (1, 128, 64) if quick else (2, 512, 256)
    iters = 3 if quick else 10
    x = torch.randn(b, L, d)
    rows = []

    m1 = Mamba(d, d_state=16)
    p1 = _params(m1)
    rows.append(_row("Mamba fwd+bwd", f"b={b}, L={L}, d_model={d}, d_state=16", b * L,
                     median_ms(_fwd_bwd(m1, x), iters=iters),
                     median_ms(_fwd_bwd(lambda u: mamba_ref(p1, u), x), iters=max(2, iters // 3)),
                     "reference block (recurrence scan) + autograd"))

    hd, ds, cs = (32, 32, 64) if quick else (64, 64, 128)
    m2 = Mamba2(d, d_state=ds, headdim=hd, chunk_size=cs)
    p2 = _params(m2)
    ref2 = functools.partial(mamba2_ref, p2, headdim=hd, d_state=ds, scan="chunked", chunk_size=cs)
    rows.append(_row("Mamba2 fwd+bwd", f"b={b}, L={L}, d_model={d}, d_state={ds}, headdim={hd}", b * L,
                     median_ms(_fwd_bwd(m2, x), iters=iters), median_ms(_fwd_bwd(ref2, x), iters=iters),
                     "reference block (chunked einsum SSD) + autograd"))

    # the small LM: Mamba-2 layers, batch 1
    n_layer, vocab, plen, ndec = (2, 256, 64, 8) if quick else (4, 1024, 512, 32)
    cfg = MambaConfig(d_model=d, n_layer=n_layer, vocab_size=vocab,
                      ssm_cfg=dict(layer="Mamba2", d_state=ds, headdim=hd, chunk_size=cs))
    lm = MambaLMHeadModel(cfg).eval()
    ids = torch.randint(0, vocab, (1, plen))
    pl = {k: v.detach() for k, v in lm.named_parameters()}
    pl["lm_head.weight"] = pl["backbone.embedding.weight"]
    mixer = functools.partial(mamba2_ref, headdim=hd, d_state=ds, scan="chunked", chunk_size=cs)

    def prefill():
        params = InferenceParams(max_seqlen=plen + ndec, max_batch_size=1)
        params.key_value_memory_dict = lm.allocate_inference_cache(1, plen + ndec)
        return lm(ids, inference_params=params, num_last_tokens=1), params

    with torch.no_grad():
        t_pre = median_ms(lambda: prefill(), iters=iters)
        r_pre = median_ms(lambda: lm_ref(pl, ids, mixer, n_layer), iters=max(2, iters // 3))
        rows.append(_row("LM prefill", f"d_model={d}, n_layer={n_layer}, prompt {plen}", plen, t_pre, r_pre,
                         "LM composed from the references"))
        _, params = prefill()
        tok = ids[:, -1:]

        def decode():
            for i in range(ndec):
                params.seqlen_offset = plen + i
                lm(tok, inference_params=params, num_last_tokens=1)

        def reforward():
            seq = ids
            for _ in range(ndec):
                lm(seq, num_last_tokens=1)
                seq = torch.cat([seq, tok], dim=1)

        t_dec = median_ms(decode, iters=iters)
        r_dec = median_ms(reforward, warmup=1, iters=max(2, iters // 3))
        rows.append(_row(f"LM decode {ndec} tokens", f"after {plen}, batch 1", ndec, t_dec, r_dec,
                         "our LM re-run over the whole prefix per token"))
    return rows


if __name__ == "__main__":
    from benchlib import format_table

    print(format_table(run()))
