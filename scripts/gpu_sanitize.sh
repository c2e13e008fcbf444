#!/usr/bin/env bash
# Step 4 of scripts/gpu_check.sh: every kernel once at a small shape (gpu_check.py run --small) under
# compute-sanitizer memcheck, racecheck and synccheck, within BUDGET_S seconds, never hanging the run.
#   bash scripts/gpu_sanitize.sh DEVICE REPORT WORKDIR BUDGET_S      (the environment of gpu_check.sh)
# A probe (a torch allocation and kernel under memcheck) runs first: compute-sanitizer worked on this
# workplace's Firecracker machines and refused the device on gVisor ("Device not supported", KINDS.md); where
# the probe fails or hangs, the tools are skipped and REPORT says why. Upstream (mamba_ssm's Triton kernels) is
# left out of these runs: only this project's kernels and the torch references run instrumented.
# Exit: 0 clean or skipped with a reason; 9 a tool reported errors; 124 a tool timed out.
set -uo pipefail
DEVICE=$1 REPORT=$2 WORK=$3 BUDGET=${4:-150}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
T0=$SECONDS
say() { echo "$*" | tee -a "$REPORT"; }

if [ "$DEVICE" != cuda ]; then
    say "sanitizers: SKIPPED (GPU_CHECK_DEVICE=$DEVICE: compute-sanitizer needs a CUDA device)"
    exit 0
fi
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
if [ -z "$SAN" ]; then
    say "sanitizers: SKIPPED (compute-sanitizer is not on PATH nor in /usr/local/cuda/bin)"
    exit 0
fi
KIND=$("$PY" -c 'import sys; sys.path.insert(0, sys.argv[1]); import gpu_env; print(gpu_env.runtime_kind())' \
       "$REPO/scripts" 2>/dev/null || uname -r)
say "sanitizers: $("$SAN" --version 2>&1 | tail -1); runtime $KIND; budget ${BUDGET}s"

# the probe: does the sanitizer work on this machine at all?
probe=$(timeout -k 5 45 "$SAN" --tool memcheck --error-exitcode 9 "$PY" -c \
    'import torch; x = torch.ones(256, device="cuda"); print("probe sum", float((2 * x).sum()))' 2>&1)
rc=$?
if [ "$rc" -ne 0 ] || ! grep -q "probe sum 512" <<<"$probe"; then
    why=$([ "$rc" -eq 124 ] && echo "timed out after 45s" || echo "exit $rc")
    say "sanitizers: SKIPPED: compute-sanitizer does not work on this machine ($why, runtime $KIND); its output:"
    tail -15 <<<"$probe" | tee -a "$REPORT"
    exit 0
fi
say "sanitizers: probe passed (memcheck ran a torch kernel clean)"

RC=0
TOOLS=(memcheck racecheck synccheck)
for i in "${!TOOLS[@]}"; do
    tool=${TOOLS[$i]}
    left=$((BUDGET - (SECONDS - T0) - 5))
    share=$((left / (${#TOOLS[@]} - i)))
    if [ "$share" -lt 15 ]; then
        say "sanitizers: $tool SKIPPED (${left}s of the budget left)"
        continue
    fi
    t0=$SECONDS
    log="$WORK/sanitizer_$tool.log"
    env -u TVM_MAMBA_UPSTREAM_DIR timeout -k 5 "$share" "$SAN" --tool "$tool" --error-exitcode 9 --print-limit 20 \
        "$PY" "$REPO/scripts/gpu_check.py" run --small --device cuda \
        ${GPU_CHECK_OPS:+--ops "$GPU_CHECK_OPS"} --out "$WORK/sanitize_$tool" >"$log" 2>&1
    rc=$?
    summary_line=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1)
    case $rc in
        0) verdict="clean" ;;
        9) verdict="ERRORS" ;;
        124|137) verdict="TIMED OUT after ${share}s" ;;
        *) verdict="exit $rc (the check itself failed under the tool: see below)" ;;
    esac
    say "sanitizers: $tool: $verdict, $((SECONDS - t0))s; ${summary_line:-no summary line}"
    if [ "$rc" -ne 0 ]; then
        grep -E "^=========" "$log" | head -60 >>"$REPORT"
        tail -20 "$log" >>"$REPORT"
        [ "$RC" -ne 0 ] || RC=$rc
    fi
done
exit $RC
