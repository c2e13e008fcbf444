"""Accuracy cost of weight-only bf16 / int8 weights (``tvm_mamba.quantize_weights``) on the benchmark models:
random-weight Mamba-1 / Mamba-2 at the 130M shape (bench_lm.py's models: seed 0, mamba_ssm's init).

    python scripts/quantize_accuracy.py [--models mamba1-130m,mamba2-130m] [--tokens 32] [--prompt 8]

Per model and weight dtype, against the same model at fp32:
- logits: the fp32 model greedily extends a ``--prompt``-token prompt by ``--tokens`` tokens; both models then
  run the whole sequence through the cached (decode-state-filling) path and their logits at the generated
  positions are compared: max and mean |diff|, and max |diff| relative to max |fp32 logit|;
- greedy agreement, teacher-forced: the fraction of those positions where the quantized model's argmax is
  the fp32 model's token;
- greedy agreement, free-running: the quantized model generates ``--tokens`` tokens on its own; the fraction
  of positions equal to the fp32 tokens, and the first position where they differ (none: "-").
"""
from __future__ import annotations

import argparse
import copy
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _logits(model, ids):
    from tvm_mamba.modules.lm import InferenceParams

    params = InferenceParams(max_seqlen=ids.shape[1] + 1, max_batch_size=ids.shape[0])
    return model(ids, inference_params=params).logits


def compare(name: str, tokens: int, prompt: int) -> list[dict]:
    import torch

    from bench_lm import MODELS, build_models
    from tvm_mamba import quantize_weights

    fp32, _ = build_models(name, hf=False)
    vocab = MODELS[name][3]
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(7))
    out = []
    with torch.inference_mode():
        seq = fp32.generate(ids, max_length=prompt + tokens)
        want = _logits(fp32, seq)[:, prompt - 1:-1, :vocab]  # the logits that chose each generated token
        for dtype in ("bfloat16", "int8"):
            quant = quantize_weights(copy.deepcopy(fp32), dtype)
            got = _logits(quant, seq)[:, prompt - 1:-1, :vocab]
            diff = (got - want).abs()
            forced = (got.argmax(-1) == seq[:, prompt:]).float().mean().item()
            free = quant.generate(ids, max_length=prompt + tokens)[:, prompt:]
            same = (free == seq[:, prompt:])[0]
            first = "-" if bool(same.all()) else int((~same).nonzero()[0])
            out.append(dict(model=name, weights=dtype, max_abs=diff.max().item(), mean_abs=diff.mean().item(),
                            rel=diff.max().item() / want.abs().max().item(), forced=forced,
                            free=same.float().mean().item(), first_diff=first))
            del quant
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mamba1-130m,mamba2-130m")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=8)
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.prompt < 1:
        raise SystemExit("quantize_accuracy.py: --tokens and --prompt must be >= 1")
    from bench_lm import machine

    mach = machine()
    print(f"quantize_accuracy: {mach['cpu']} ({mach['arch']}, {mach['cores']} cores); {args.tokens} greedy tokens "
          f"after a {args.prompt}-token prompt, vs the fp32 model")
    print(f"{'model':<13} {'weights':<9} {'max|dlogit|':>11} {'mean|dlogit|':>12} {'rel max':>8} "
          f"{'forced agree':>12} {'free agree':>10} {'1st diff':>8}")
    for name in (m for m in args.models.split(",") if m):
        for r in compare(name, args.tokens, args.prompt):
            print(f"{r['model']:<13} {r['weights']:<9} {r['max_abs']:>11.3g} {r['mean_abs']:>12.3g} {r['rel']:>8.2e} "
                  f"{r['forced']:>12.1%} {r['free']:>10.1%} {str(r['first_diff']):>8}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
