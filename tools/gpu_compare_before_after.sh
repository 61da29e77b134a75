#!/usr/bin/env bash
# One device call, by phase: GPU tests, then benchmarks of an older tree (.gpu-old, carried) and of this one
# in the same session, so that "no worse than before" is one run's ratio.
#   PHASES="wheels tests items host old new old2 new2 hf" TESTS="tests/test_x.py" K="pytest -k expression" HF_K=... HF_TESTS=0 bash tools/gpu_compare_before_after.sh
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/slabstage-gpu}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  date -u; } > "$OUT/machine.txt" 2>&1
bench() {  # tree, json name, files...
  local tree=$1 name=$2; shift 2
  (cd "$tree" && PYTHONPATH=$PWD${EXTRA_PATH:+:$EXTRA_PATH} timeout "${BENCH_TIMEOUT:-200}" python3 -m pytest "$@" -k "${K:-}" --benchmark-enable \
     --benchmark-json="$OUT/$name.json" -q -p no:cacheprovider > "$OUT/$name.log" 2>&1)
  echo "$name: $(tail -1 "$OUT/$name.log")"
}
for phase in ${PHASES:-tests}; do
  case $phase in
    wheels) python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
              && export EXTRA_PATH=/tmp/site ;;
    tests) PYTHONPATH=$PWD${EXTRA_PATH:+:$EXTRA_PATH} timeout "${TEST_TIMEOUT:-300}" python3 -m pytest ${TESTS:-tests} -q -p no:cacheprovider \
             -m "not slow" -rfE > "$OUT/tests.log" 2>&1
           echo "tests: $(tail -1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30
           grep -E "^E  " "$OUT/tests.log" | sort | uniq -c | sort -rn | head -12 ;;
    items) K= bench . items bench/bench_media_items.py ;;
    host) for run in ".gpu-old old" ". new" ".gpu-old old2" ". new2"; do
            set -- $run; timeout 120 python3 bench/run_host_time.py "$1" "$2" 2>&1 | tail -4
          done ;;
    old|old2) bench .gpu-old "$phase" bench/bench_stage_embeddings.py bench/bench_graph_runner.py ;;
    new|new2) bench . "$phase" bench/bench_stage_embeddings.py bench/bench_graph_runner.py ;;
    hf) python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
        if [ "${HF_TESTS:-1}" != 0 ]; then
          PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m pytest tests/test_hf_models.py -q -p no:cacheprovider -rfE \
            > "$OUT/hf_tests.log" 2>&1; echo "hf tests: $(tail -1 "$OUT/hf_tests.log")"
        fi
        EXTRA_PATH=/tmp/site K=${HF_K:-} bench . hf bench/bench_hf.py ;;
  esac
done
