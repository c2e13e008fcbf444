"""Cold build vs warm load time per kernel (fresh cache directory, then a new process loading from disk).

    python scripts/build_times.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
from tvm_mamba.runtime import KernelKey, build_and_load, cpu_target, target_key
from tvm_mamba.compute.causal_conv1d import build_check_configs
rows = []
for direction, static, dtypes in build_check_configs()[:5]:
    key = KernelKey.make("causal_conv1d", direction, dtypes, static, target_key(cpu_target()))
    t0 = time.perf_counter(); k = build_and_load(key); total = time.perf_counter() - t0
    rows.append([str(key.direction) + " " + ",".join(f"{a}={b}" for a, b in static.items() if b not in (False,)),
                 k.build_seconds, total])
print(json.dumps(rows))
"""


def main() -> int:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TVM_MAMBA_CACHE_DIR=cache)
        runs = [json.loads(subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                                          check=True).stdout.strip().splitlines()[-1]) for _ in range(2)]
    print(f"{'kernel (causal_conv1d, fp32, llvm)':<90} {'cold build s':>12} {'warm load ms':>12}")
    for cold, warm in zip(*runs):
        print(f"{cold[0]:<90} {cold[2]:12.2f} {1e3 * warm[2]:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
