#!/usr/bin/env bash
# compute-sanitizer over tools/sanitize_workload.py, on a GPU machine with compute-sanitizer on PATH:
#   native            the workload alone (fills Triton's compile cache, so no kernel compiles under the sanitizer)
#   memcheck          memcheck, PyTorch's caching allocator on (CUDA graphs captured and replayed)
#   memcheck_nocache  memcheck with PYTORCH_NO_CUDA_MEMORY_CACHING=1: every tensor its own cudaMalloc, so an
#                     access one element out of bounds is reported (the runners run eagerly)
#   racecheck         racecheck (shared-memory hazards)
# each sanitizer phase with --error-exitcode 1.
#
#   bash tools/gpu_sanitize.sh OUTDIR
#
# Logs go to OUTDIR/<phase>.log; one summary line per phase (exit status, whether the workload printed
# SANITIZE WORKLOAD OK, the sanitizer's summary line) is printed last and kept in OUTDIR/summary.txt.
# Exits 1 when any phase exited non-zero or its workload did not print SANITIZE WORKLOAD OK.
# Environment: PYTHON (default python3), PHASE_TIMEOUT (seconds per phase, default 0: no limit).
set -u
if [ $# -ne 1 ]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
mkdir -p "$1" && OUTDIR=$(cd "$1" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
if ! command -v compute-sanitizer >/dev/null; then
  echo "gpu_sanitize: compute-sanitizer is not on PATH" >&2
  exit 2
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
WORKLOAD=("${PYTHON:-python3}" tools/sanitize_workload.py)
SANITIZER=(compute-sanitizer --error-exitcode 1 --print-limit 20)
LIMIT=()
if [ "${PHASE_TIMEOUT:-0}" != 0 ]; then LIMIT=(timeout "$PHASE_TIMEOUT"); fi

lines=()
failed=0
phase() {  # name, command...
  local name=$1; shift
  local log=$OUTDIR/$name.log t0=$SECONDS rc ok=no summary
  ${LIMIT[@]+"${LIMIT[@]}"} "$@" >"$log" 2>&1
  rc=$?
  grep -qx 'SANITIZE WORKLOAD OK' "$log" && ok=yes
  summary=$(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | tail -1 | sed 's/^=* *//')
  if [ "$rc" -ne 0 ] || [ "$ok" != yes ]; then failed=1; fi
  lines+=("$(printf '%-16s rc=%-3s workload OK: %-3s %4ss  %s' "$name" "$rc" "$ok" "$((SECONDS - t0))" \
    "${summary:-(no sanitizer summary)}")")
}

phase native "${WORKLOAD[@]}"
phase memcheck "${SANITIZER[@]}" --tool memcheck "${WORKLOAD[@]}"
phase memcheck_nocache env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${SANITIZER[@]}" --tool memcheck "${WORKLOAD[@]}"
phase racecheck "${SANITIZER[@]}" --tool racecheck "${WORKLOAD[@]}"

printf '%s\n' "${lines[@]}" | tee "$OUTDIR/summary.txt"
if [ "$failed" -ne 0 ]; then
  echo "gpu_sanitize: FAILED (logs in $OUTDIR)"
fi
exit "$failed"
