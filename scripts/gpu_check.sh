#!/usr/bin/env bash
# The one GPU call (docs/gpu.md): on a machine with torch but no TVM, from the bundle of scripts/gpu_bundle.sh:
#   1. the environment into OUT/env.txt and stdout (first, so any failure is diagnosable from the output alone);
#   2. the TVM runtime (carried) installed, libcudart.so.13 located and put on LD_LIBRARY_PATH; then
#      scripts/gpu_env.py verify STOPS the run (exit 3/4) unless TVM's CUDA sidecar loaded, tvm.cuda(0) exists
#      and every file of both kernel packs loads (all failures listed);
#   3. every kernel checked and timed (gpu_check.py run), upstream mamba_ssm beside it where Triton imports;
#   4. every kernel once at a small shape under compute-sanitizer memcheck, racecheck and synccheck (skipped,
#      with the reason, where the sanitizer does not work, e.g. gVisor), into OUT/sanitizer.txt;
#   5. one tuning measure round (OUT/timings.json; `python -m tvm_mamba tune --commit` on a build host).
# Every step runs under `timeout`, inside one budget (GPU_CHECK_BUDGET_S, default 330 s on CUDA): a step that
# would start with too little budget left is skipped with a line saying so. OUT gets at most 7 files: env.txt,
# log.txt (everything printed), gpu_check.json, gpu_check.md, sanitizer.txt, timings.json (+ what run writes).
#   bash scripts/gpu_check.sh [OUT]        (BUNDLE=gpu_bundle, PYTHON=python3, GPU_CHECK_DEVICE=cuda|cpu,
#                                           GPU_CHECK_OPS=op,op: only those ops, e.g. a rerun of the failed ones)
# GPU_CHECK_DEVICE=cpu rehearses every step here with the bundle's CPU pack (tests/test_gpu_rehearsal.py).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-${OUT:-$REPO/gpu_out}}
BUNDLE=$(cd "${BUNDLE:-$REPO/gpu_bundle}" 2>/dev/null && pwd) || { echo "gpu_check.sh: FATAL: no bundle at ${BUNDLE:-$REPO/gpu_bundle} (bash scripts/gpu_bundle.sh)" >&2; exit 3; }
DEVICE=${GPU_CHECK_DEVICE:-cuda}
PY=${PYTHON:-python3}
export PYTHON=$PY
# the caps below are the GPU's; a CPU rehearsal (2 shared cores) gets 4x each and a larger budget
if [ "$DEVICE" = cuda ]; then BUDGET=${GPU_CHECK_BUDGET_S:-330} SCALE=1; else BUDGET=${GPU_CHECK_BUDGET_S:-1500} SCALE=4; fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/log.txt") 2>&1
TEE=$!
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"; exec >&- 2>&-; wait $TEE 2>/dev/null' EXIT  # tee's last lines reach log.txt
T0=$SECONDS
STEPS=""

# step NAME CAP CMD...: CMD under `timeout` for min(CAP * SCALE, budget left) seconds; its exit status is returned
# (99: skipped, too little budget left; 124: timed out) and a line goes into the summary.
step() {
    local name=$1 cap=$(($2 * SCALE)) left t t0 rc
    shift 2
    left=$((BUDGET - (SECONDS - T0)))
    t=$((left < cap ? left : cap))
    if [ "$t" -lt 10 ]; then
        echo "gpu_check.sh: SKIPPED $name: ${left}s of the ${BUDGET}s budget left"
        STEPS+="  $name: skipped (budget spent)"$'\n'
        return 99
    fi
    echo "=== $name (timeout ${t}s, $((SECONDS - T0))s into the run) ==="
    t0=$SECONDS
    timeout -k 10 "$t" "$@"
    rc=$?
    [ "$rc" -eq 124 ] && echo "gpu_check.sh: $name TIMED OUT after ${t}s"
    STEPS+="  $name: exit $rc, $((SECONDS - t0))s"$'\n'
    return $rc
}

summary() {
    echo "=== gpu_check.sh summary (device $DEVICE, $((SECONDS - T0))s of ${BUDGET}s) ==="
    printf '%s' "$STEPS"
}

stop() {  # a failure that makes everything after it meaningless: say so and exit at once
    echo "gpu_check.sh: FATAL: $1 (exit $2); nothing further was run"
    summary
    exit "$2"
}

# 1. the environment, before anything can fail
step env 60 "$PY" "$REPO/scripts/gpu_env.py" env --out "$OUT/env.txt"
echo "bundle: $BUNDLE ($(du -sh "$BUNDLE" | cut -f1)); device: $DEVICE; budget ${BUDGET}s" | tee -a "$OUT/env.txt"

# 2. the runtime: tvm without its compiler (bundle/site), tvm-ffi from the carried wheel, CUDA's runtime found
PYV=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
WHEEL=$(ls "$BUNDLE"/wheels/apache_tvm_ffi-*-"$PYV"-*.whl 2>/dev/null | head -1)
[ -n "$WHEEL" ] || stop "no apache-tvm-ffi wheel for $PYV in $BUNDLE/wheels" 3
step install 120 "$PY" -m pip install -q --no-index --no-deps --target "$WORK/ffi" "$WHEEL" || stop "installing $WHEEL failed" 3
export PYTHONPATH="$BUNDLE/site:$WORK/ffi:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TVM_USE_RUNTIME_LIB=1
if [ -d "$BUNDLE/upstream" ]; then  # `import mamba_ssm` = upstream's folder, its __init__ not run (gpu_upstream/)
    export TVM_MAMBA_UPSTREAM_DIR="$BUNDLE/upstream" PYTHONPATH="$PYTHONPATH:$REPO/scripts/gpu_upstream"
fi
if [ -d "$BUNDLE/upstream" ]; then  # (a pipeline's subshell: no exports in here)
    echo "upstream: $(ls "$BUNDLE/upstream") (pure-Python parts: its Triton kernels); its CUDA extensions" \
         "(selective_scan_cuda, causal_conv1d_cuda) not built: a compile here does not fit the budget (docs/gpu.md)"
else
    echo "upstream: not in the bundle (no mamba_ssm comparison)"
fi | tee -a "$OUT/env.txt"
if [ "$DEVICE" = cuda ]; then
    PACK=$(ls -d "$BUNDLE"/pack_sm* 2>/dev/null | head -1); CAND=$(ls -d "$BUNDLE"/cand_sm* 2>/dev/null | head -1)
    CUDART_DIR=$("$PY" "$REPO/scripts/gpu_env.py" cudart) || stop "libcudart.so.13 not found (see above)" 3
    export LD_LIBRARY_PATH="$CUDART_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "libcudart.so.13: $CUDART_DIR (on LD_LIBRARY_PATH)" | tee -a "$OUT/env.txt"
else
    PACK="$BUNDLE/pack_cpu"; CAND="$BUNDLE/cand_cpu"
fi
PACK=${PACK:-$BUNDLE/pack_sm (none in the bundle)}  # verify says so, after checking the runtime
export TVM_MAMBA_KERNEL_PACK="$PACK"
PACKS=(--pack "$PACK")
[ -n "$CAND" ] && [ -d "$CAND" ] && PACKS+=(--pack "$CAND")
step verify 120 "$PY" "$REPO/scripts/gpu_env.py" verify --device "$DEVICE" --site "$BUNDLE/site" "${PACKS[@]}"
rc=$?
[ "$rc" -eq 0 ] || stop "the runtime or a kernel pack is not usable (gpu_env.py verify, see above)" "$rc"

# 3. correctness and timings against the references (and upstream where it imports)
SMALL=()
[ "$DEVICE" = cuda ] || SMALL=(--small)
EST=()
[ -f "$BUNDLE/estimates.json" ] && EST=(--estimates "$BUNDLE/estimates.json")
RC=0
step check 200 "$PY" "$REPO/scripts/gpu_check.py" run --out "$OUT" --device "$DEVICE" "${SMALL[@]}" "${EST[@]}" \
    ${GPU_CHECK_OPS:+--ops "$GPU_CHECK_OPS"} || RC=$?

# 4. sanitizers (scripts/gpu_sanitize.sh: a probe first; each tool under its own timeout inside SAN_S)
SAN_S=$((BUDGET - (SECONDS - T0) - 50))  # keep 50 s for the tuning round
SAN_S=$((SAN_S > 150 ? 150 : SAN_S))
step sanitizers $((SAN_S + 10)) bash "$REPO/scripts/gpu_sanitize.sh" "$DEVICE" "$OUT/sanitizer.txt" "$WORK" "$SAN_S" \
    || { r=$?; [ "$RC" -ne 0 ] || RC=$r; }

# 5. one tuning measure round
if [ -n "$CAND" ] && [ -d "$CAND" ]; then
    step tune-measure 45 "$PY" -m tvm_mamba tune --measure "$CAND" --timings "$OUT/timings.json" || { r=$?; [ "$RC" -ne 0 ] || RC=$r; }
fi
summary
echo "gpu_check.sh: exit $RC; results in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
exit $RC
