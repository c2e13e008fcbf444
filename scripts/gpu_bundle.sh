#!/usr/bin/env bash
# Build host (no GPU needed): everything a runtime-only GPU machine needs, into one folder (<= 64 MiB):
#   pack_sm90/   AOT kernel pack (cubins + manifest) for the pack's presets
#   cand_sm90/   a candidate pack for one tuning round (tune --measure there, tune --commit here)
#   site/tvm     the tvm Python package without libtvm_compiler.so (runtime + CUDA sidecar only)
#   wheels/      apache-tvm-ffi for the GPU machine's CPython 3.12
# Usage: bash scripts/gpu_bundle.sh [OUT=gpu_bundle] [ARCH=sm_90]; then run scripts/gpu_check.sh there.
set -euo pipefail
OUT=${1:-gpu_bundle}
ARCH=${2:-sm_90}
PY=${PYTHON:-python}
OPS=${OPS:-}  # comma-separated ops (default: all)
mkdir -p "$OUT"
$PY -m tvm_mamba aot --target cuda --arch "$ARCH" --preset mamba2-130m --seqlens 2048 --batches 2 --ops "$OPS" \
    --out "$OUT/pack_${ARCH/_/}" || echo "gpu_bundle: some kernels failed to build (see above); packing the rest"
$PY -m tvm_mamba tune --emit-candidates 4 --target cuda --arch "$ARCH" --preset mamba2-130m --seqlens 2048 \
    --batches 2 --ops causal_conv1d --out "$OUT/cand_${ARCH/_/}"
if [ -n "${WITH_CPU:-}" ]; then  # a CPU pack too, to rehearse gpu_check.sh on a machine without a GPU
    $PY -m tvm_mamba aot --target cpu --preset mamba2-130m --seqlens 2048 --batches 2 --ops "$OPS" \
        --out "$OUT/pack_cpu" || echo "gpu_bundle: some CPU kernels failed to build"
    $PY -m tvm_mamba tune --emit-candidates 2 --target cpu --preset mamba2-130m --seqlens 2048 --batches 2 \
        --ops causal_conv1d --out "$OUT/cand_cpu"
fi
$PY - "$OUT/site/tvm" <<'PYEOF'
import os, shutil, sys, tvm
src, dst = os.path.dirname(tvm.__file__), sys.argv[1]
shutil.rmtree(dst, ignore_errors=True)
skip = shutil.ignore_patterns("libtvm_compiler.so", "3rdparty", "src", "include", "__pycache__")
shutil.copytree(src, dst, ignore=skip)
PYEOF
mkdir -p "$OUT/wheels"
for pyv in 3.12 $($PY -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")'); do
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version "$pyv" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$OUT/wheels" "apache-tvm-ffi==0.1.14.post1"
done
du -sh "$OUT"
