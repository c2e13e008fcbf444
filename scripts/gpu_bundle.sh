#!/usr/bin/env bash
# Build host (no GPU needed): everything the runtime-only GPU machine needs for scripts/gpu_check.sh, in one
# gitignored folder that travels as the device call's `carry` (docs/gpu.md):
#   configs_sm90.json  gpu_check.py's cases and the kernel configurations they hit (`gpu_check.py configs`)
#   pack_sm90/     AOT CUDA pack of exactly those (python -m tvm_mamba aot --configs; the cases travel inside)
#   cand_sm90/     a candidate pack for one tuning round (tune --measure there, tune --commit here)
#   estimates.json the roofline report's estimate per kernel (gpu_check.py estimates), printed beside timings
#   site/tvm       the tvm Python package without libtvm_compiler.so (runtime + CUDA sidecar only)
#   wheels/        apache-tvm-ffi for CPython 3.12 (the GPU machine) and this Python
#   upstream/mamba_ssm-2.3.2.post1/mamba_ssm   upstream's pure-Python package (its Triton kernels), from the
#                  sdist (never committed); its CUDA extensions are not built (docs/gpu.md: no time there)
# Usage: bash scripts/gpu_bundle.sh [OUT=gpu_bundle] [ARCH=sm_90]
#   GPU_BUNDLE_TARGETS="cuda" (default) | "cpu" | "cuda cpu": which packs; the CPU pack (pack_cpu/, cand_cpu/,
#   built from the --small configs) rehearses gpu_check.sh here (GPU_CHECK_DEVICE=cpu). PYTHON=python.
#   GPU_CHECK_OPS=op,op: only those ops' cases (default all; gpu_check.sh takes the same variable).
#   GPU_BUNDLE_ESTIMATES=0 leaves the roofline estimates out (the run then prints no estimate column).
# Exit non-zero (after building everything else) if any kernel failed to build, or the bundle plus this
# checkout exceed the device call's 64 MiB.
set -euo pipefail
OUT=${1:-gpu_bundle}
ARCH=${2:-sm_90}
PY=${PYTHON:-python}
TARGETS=${GPU_BUNDLE_TARGETS-cuda}  # "" : no packs (the runtime and upstream only)
REPO=$(cd "$(dirname "$0")/.." && pwd)
MAMBA_SSM=mamba-ssm==2.3.2.post1
LIMIT_MIB=64
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
FAILED=()
T0=$SECONDS
took() { echo "gpu_bundle: $1 took $((SECONDS - ${2}))s"; }

for target in $TARGETS; do
    t=$SECONDS
    if [ "$target" = cuda ]; then  # every case (presets, ragged, small, LMs): run and run --small
        suffix=${ARCH/_/} tflags=(--target cuda --arch "$ARCH") cflags=(--device cuda --arch "$ARCH")
    else  # the rehearsal: the small cases only
        suffix=cpu tflags=(--target cpu) cflags=(--device cpu --small)
    fi
    pack="$OUT/pack_$suffix" cand="$OUT/cand_$suffix" configs="$OUT/configs_$suffix.json"
    rm -rf "$pack" "$cand"
    "$PY" "$REPO/scripts/gpu_check.py" configs "${cflags[@]}" ${GPU_CHECK_OPS:+--ops "$GPU_CHECK_OPS"} --out "$configs"
    "$PY" -m tvm_mamba aot "${tflags[@]}" --configs "$configs" --out "$pack" || FAILED+=("$target pack (aot, above)")
    took "$target pack" $t
    t=$SECONDS
    "$PY" -m tvm_mamba tune --emit-candidates 2 "${tflags[@]}" --preset mamba2-130m --seqlens 2048 --batches 2 \
        --ops causal_conv1d --out "$cand" || FAILED+=("$target candidate pack")
    took "$target candidate pack" $t
done

if [ "${GPU_BUNDLE_ESTIMATES:-1}" = 1 ]; then
    t=$SECONDS
    "$PY" "$REPO/scripts/gpu_check.py" estimates --arch "$ARCH" --out "$OUT/estimates.json" || FAILED+=("estimates")
    took estimates $t
fi

# the runtime: tvm without its compiler, tvm-ffi wheels (3.12 for the GPU machine, this Python for rehearsals)
"$PY" - "$OUT/site/tvm" <<'PYEOF'
import os, shutil, sys, tvm
src, dst = os.path.dirname(tvm.__file__), sys.argv[1]
shutil.rmtree(dst, ignore_errors=True)
skip = shutil.ignore_patterns("libtvm_compiler.so", "3rdparty", "src", "include", "__pycache__")
shutil.copytree(src, dst, ignore=skip)
PYEOF
mkdir -p "$OUT/wheels"
for pyv in 3.12 $("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")'); do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyv" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$OUT/wheels" "apache-tvm-ffi==0.1.14.post1"
done

# upstream's pure-Python package, from its sdist (CUDA extensions skipped; no build isolation: no torch download)
t=$SECONDS
"$PY" -c 'import setuptools, wheel, packaging, torch' 2>/dev/null || { echo "gpu_bundle: FATAL: downloading" \
    "$MAMBA_SSM's sdist runs its setup.py here: pip install setuptools wheel packaging (torch too)" >&2; exit 1; }
dl=$(mktemp -d)
MAMBA_SKIP_CUDA_BUILD=TRUE "$PY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d "$dl" "$MAMBA_SSM"
tar -xzf "$dl"/mamba_ssm-*.tar.gz -C "$dl"
src=$(ls -d "$dl"/mamba_ssm-*/ | head -1)
rm -rf "$OUT/upstream"
mkdir -p "$OUT/upstream/$(basename "$src")"
cp -r "$src/mamba_ssm" "$OUT/upstream/$(basename "$src")/"
find "$OUT/upstream" -name __pycache__ -prune -exec rm -rf {} +
rm -rf "$dl"
took "upstream $MAMBA_SSM" $t

# size: the bundle plus what the checkout sends (tracked and untracked-not-ignored files) under 64 MiB
bundle=$(du -sb "$OUT" | cut -f1)
tree=$(cd "$REPO" && git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
echo "gpu_bundle: bundle $((bundle / 1024)) KiB + checkout $((tree / 1024)) KiB = $(((bundle + tree) / 1048576)) MiB" \
     "of the device call's ${LIMIT_MIB} MiB; built in $((SECONDS - T0))s"
[ $((bundle + tree)) -lt $((LIMIT_MIB * 1048576)) ] || FAILED+=("size: over ${LIMIT_MIB} MiB")
if [ ${#FAILED[@]} -gt 0 ]; then
    printf 'gpu_bundle: FAILED: %s\n' "${FAILED[@]}" >&2
    exit 1
fi
echo "gpu_bundle: ok: $OUT"
