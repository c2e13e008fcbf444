"""A 130M model's first ``generate`` from an empty kernel cache, in fresh processes: seconds, and how many kernels
the process compiled itself.

    python scripts/cold_start.py                 # Mamba-1 and Mamba-2 130M shapes (random weights), 2 runs each
    python scripts/cold_start.py --models mamba2 --runs 3
    python scripts/cold_start.py --size tiny --runs 1      # a smoke run (tests/test_scripts.py)

Per model and run, three fresh processes on a new cache folder:
- ``empty``: the cache and the model's kernel set are empty: every kernel compiled by the process, in order;
- ``upgrade``: the version folder removed (what an upgrade leaves) but the kernel set kept: ``generate`` starts
  worker processes on the set while it compiles from the front (runtime/kernel_sets.py);
- ``warm``: everything cached: loading only.
Timed: the ``generate`` call (prompt 16 tokens, 8 new), not the import or the model's construction.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time, torch
from tvm_mamba.modules.lm import MambaConfig, MambaLMHeadModel
from tvm_mamba.runtime import cache
torch.manual_seed(0)
layer, d_model, n_layer, vocab = sys.argv[1], *map(int, sys.argv[2:5])
model = MambaLMHeadModel(MambaConfig(d_model=d_model, n_layer=n_layer, vocab_size=vocab,
                                     ssm_cfg={"layer": layer})).eval()
ids = torch.randint(0, vocab, (1, 16))
t0 = time.perf_counter()
with torch.no_grad():
    model.generate(ids, max_new_tokens=8)
print("COLD_START " + json.dumps({"seconds": time.perf_counter() - t0, "builds": cache.stats["builds"]}))
"""
LAYERS = {"mamba1": "Mamba1", "mamba2": "Mamba2"}
SIZES = {"130m": (768, 24, 50277), "tiny": (64, 2, 512)}  # d_model, n_layer, vocab_size


def _child(layer: str, size: str, cache_dir: str) -> dict:
    env = dict(os.environ, TVM_MAMBA_CACHE_DIR=cache_dir, TVM_MAMBA_QUIET="1")
    run = subprocess.run([sys.executable, "-c", CHILD, layer, *map(str, SIZES[size])], env=env, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        raise RuntimeError(run.stderr[-3000:])
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("COLD_START ")][-1]
    return json.loads(line.split(" ", 1)[1])


def one_run(layer: str, size: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="tvm_mamba_cold_") as cache_dir:
        empty = _child(layer, size, cache_dir)
        for folder in os.listdir(cache_dir):
            if folder.startswith("tvm_mamba-"):
                shutil.rmtree(os.path.join(cache_dir, folder))
        upgrade = _child(layer, size, cache_dir)
        warm = _child(layer, size, cache_dir)
    return {"empty": empty, "upgrade": upgrade, "warm": warm}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mamba1,mamba2", help="comma-separated: mamba1, mamba2")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--size", default="130m", choices=sorted(SIZES), help="130m, or tiny (a smoke run)")
    args = ap.parse_args(argv)
    print(f"{'model':<8} {'case':<8} {'generate s (median)':>20} {'runs':>24} {'compiled here':>14}")
    for name in args.models.split(","):
        runs = [one_run(LAYERS[name], args.size) for _ in range(args.runs)]
        for case in ("empty", "upgrade", "warm"):
            secs = [r[case]["seconds"] for r in runs]
            builds = sorted({r[case]["builds"] for r in runs})
            print(f"{name:<8} {case:<8} {statistics.median(secs):>20.2f} "
                  f"{' / '.join(f'{s:.2f}' for s in secs):>24} {'/'.join(map(str, builds)):>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
