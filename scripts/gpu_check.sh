#!/usr/bin/env bash
# On a GPU machine with torch but no TVM: install the carried TVM runtime, check every packed CUDA kernel
# against the PyTorch references on the GPU, time them (CUDA events), run one tuning measure round, and
# write everything under $OUT (or the first argument). Budget: well under 8 minutes.
# Needs the bundle from scripts/gpu_bundle.sh ($BUNDLE, default gpu_bundle) and this repository.
# GPU_CHECK_DEVICE=cpu (with a CPU pack in $BUNDLE/pack_cpu) exercises every step on a machine without a GPU.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-${OUT:-$REPO/gpu_out}}
BUNDLE=${BUNDLE:-$REPO/gpu_bundle}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# 1. the runtime: tvm without its compiler, tvm-ffi from the carried wheel
PYV=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
$PY -m pip install -q --no-index --no-deps --target "$WORK/ffi" "$BUNDLE"/wheels/apache_tvm_ffi-*-"$PYV"-*.whl
export PYTHONPATH="$BUNDLE/site:$WORK/ffi:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TVM_USE_RUNTIME_LIB=1
if [ "$DEVICE" = cuda ]; then PACK=$(ls -d "$BUNDLE"/pack_sm* | head -1); CAND=$(ls -d "$BUNDLE"/cand_sm* | head -1)
else PACK="$BUNDLE/pack_cpu"; CAND="$BUNDLE/cand_cpu"; fi
export TVM_MAMBA_KERNEL_PACK="$PACK"
$PY -c 'import tvm.base, tvm_ffi; assert tvm.base._RUNTIME_ONLY; print("tvm runtime only, tvm-ffi", tvm_ffi.__version__)' | tee "$OUT/env.txt"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
# 2. correctness and timings against the references
rc=0
timeout 300 $PY "$REPO/scripts/gpu_check.py" --out "$OUT" --device "$DEVICE" || rc=$?
# 3. one tuning measure round (bring timings.json back and run `python -m tvm_mamba tune --commit` on a build host)
timeout 150 $PY -m tvm_mamba tune --measure "$CAND" --timings "$OUT/timings.json" || rc=$?
echo "gpu_check.sh: exit $rc; results in $OUT"
exit $rc
