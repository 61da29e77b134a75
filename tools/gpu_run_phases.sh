#!/usr/bin/env bash
# One device call's worth of GPU work, by phase (tools/README.md lists them):
#   bash tools/gpu_run_phases.sh tests sanitize soak     (results under $OUT, or /tmp/slabstage-gpu)
# Each phase logs to $OUT/$TAG/<phase>.log (TAG default: logs), packed into $OUT/$TAG.tgz; prints
# the machine and one summary line per phase last. The suites' JSON, tables and plots go to $RESULTS (default
# $OUT/$TAG/results), never into the working tree: a later call that sends the tree again leaves them be.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/slabstage-gpu}
TAG=${TAG:-logs}
LOG=$OUT/$TAG
RESULTS=${RESULTS:-$LOG/results}
mkdir -p "$LOG" "$RESULTS"
summary=()
run() {  # name, command...
  local name=$1; shift
  local t0=$SECONDS
  "$@" >"$LOG/$name.log" 2>&1
  local rc=$?
  summary+=("$name rc=$rc $((SECONDS - t0))s :: $(grep -E 'passed|failed|error|ERROR SUMMARY|OK|Error' "$LOG/$name.log" | tail -2 | tr '\n' ' ' | cut -c1-220)")
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  python3 -c "import platform, torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'python', platform.python_version(), 'gpus', torch.cuda.device_count())"
  python3 -c "import transformers; print('transformers', transformers.__version__)" 2>/dev/null || echo "transformers: not installed"
  date -u; } >"$LOG/machine.txt" 2>&1
for phase in "$@"; do
  case $phase in
    tests) run tests python3 -m pytest tests -q -m "not slow" -p no:cacheprovider -rfEs --junitxml="$LOG/junit.xml" ;;
    soak) SLABSTAGE_SOAK_STEPS=${SOAK_STEPS:-10000} SLABSTAGE_SOAK_OUT=$LOG/soak.json \
            run soak python3 -m pytest tests/runner/test_soak.py -m slow -q -p no:cacheprovider -rfEs ;;
    sanitize) run sanitize bash tools/gpu_sanitize.sh "$LOG/sanitizer" ;;  # native, memcheck (twice), racecheck
    bench_runner) run bench_runner python3 bench/run.py --results "$RESULTS" --suite graph_runner ;;
    tp) run tp_tests python3 -m pytest tests/tp/test_tp.py -q -p no:cacheprovider -rfEs -m multigpu
        run tp_bench python3 bench/run.py --results "$RESULTS" --suite tp ;;
    bench) run bench python3 bench/run.py --results "$RESULTS"
           run report python3 bench/report.py --results "$RESULTS" ;;
    profile) run profile python3 bench/nvtx_workload.py --steps 40 --torch-profiler "$LOG/trace.json" ;;
    figures) run figures python3 bench/run.py --results "$RESULTS" --suite new_inputs ;;
    cache) run cache python3 bench/run.py --results "$RESULTS" --suite encoder_cache ;;  # the encoder cache's A/B
    engine) run engine python3 bench/run.py --results "$RESULTS" --suite prefill --suite generate ;;  # README's rows
    kernel) run kernel python3 -m pytest tests/ops tests/cache tests/runner -q -m "not slow" -k cuda \
              -p no:cacheprovider -rfEs ;;  # the kernels, the cache and the runner on CUDA
    quick) run quick python3 -m pytest tests/runner/test_graph_runner.py tests/ops/test_stage_batch.py \
             tests/runner/test_profile_ranges.py -q -p no:cacheprovider -rfEs ;;
    probe_mem) run probe_mem python3 tools/probe_capture_memory.py --json "$LOG/probe_mem.json" ;;
    probe_launch) run probe_launch python3 tools/probe_graph_launch.py --json "$LOG/probe_launch.json" ;;
    probe_record) run probe_record python3 tools/probe_replay_record.py --json "$LOG/probe_record.json" ;;
    *) summary+=("$phase: unknown phase") ;;
  esac
done
tar czf "$OUT/$TAG.tgz" -C "$OUT" "$TAG"
cat "$LOG/machine.txt"
printf '%s\n' "${summary[@]}"
