#!/usr/bin/env bash
# Programmatic dependent launch, on or off, for a replay's staging (one GPU, one device call, ~5 minutes):
#   OUT=/tmp/slabstage-gpu bash tools/pdl_ab.sh
# 1. the CUDA cases of the op, cache and runner tests with PDL on (the default on Hopper);
# 2. the encoder_cache suite's replay and stage cases twice, SLABSTAGE_PDL=0 then 1, each into its own results
#    folder, then the report of each. Everything under $OUT/pdl, packed into $OUT/pdl.tgz.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/slabstage-gpu}
LOG=$OUT/pdl
mkdir -p "$LOG"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  python3 -c "import platform, torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'python', platform.python_version())"
  date -u; } >"$LOG/machine.txt" 2>&1
SLABSTAGE_PDL=1 python3 -m pytest tests/ops tests/cache tests/runner -q -m "not slow" -k cuda -p no:cacheprovider \
  -rfEs >"$LOG/kernel_tests_pdl.log" 2>&1
echo "kernel tests (PDL on): rc=$? $(tail -1 "$LOG/kernel_tests_pdl.log")"
for pdl in 0 1; do
  SLABSTAGE_PDL=$pdl python3 bench/run.py --results "$LOG/pdl$pdl" --suite encoder_cache -k "replay or stage" \
    >"$LOG/bench_pdl$pdl.log" 2>&1
  echo "encoder_cache, SLABSTAGE_PDL=$pdl: rc=$?"
  python3 bench/report.py --results "$LOG/pdl$pdl" >"$LOG/report_pdl$pdl.log" 2>&1
  grep -iE "replay|stage" "$LOG/pdl$pdl"/*.md 2>/dev/null | head -20
done
tar czf "$OUT/pdl.tgz" -C "$OUT" pdl
