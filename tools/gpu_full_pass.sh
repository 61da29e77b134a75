#!/usr/bin/env bash
# The whole GPU pass on a 2-GPU machine in under 10 minutes:
# benchmarks on GPU 0 while tests, soak, sanitizer and profile run on GPU 1; then tensor parallel on both.
# Needs 2 GPUs of one host (the `tp` phase uses both).
export OUT=${OUT:-/tmp/slabstage-gpu}
mkdir -p "$OUT"
(CUDA_VISIBLE_DEVICES=0 TAG=bench timeout 360 bash tools/gpu_run_phases.sh bench > "$OUT/bench.summary" 2>&1) &
(CUDA_VISIBLE_DEVICES=1 TAG=checks timeout 360 bash tools/gpu_run_phases.sh tests soak sanitize profile \
   > "$OUT/checks.summary" 2>&1) &
wait
TAG=tp timeout 150 bash tools/gpu_run_phases.sh tp > "$OUT/tp.summary" 2>&1
for t in bench checks tp; do  # a phase cut by its timeout left no archive: make it, keep the file count low
  [ -d "$OUT/$t" ] && tar czf "$OUT/$t.tgz" -C "$OUT" "$t" && rm -rf "${OUT:?}/$t"
done
tail -n 12 "$OUT"/*.summary
