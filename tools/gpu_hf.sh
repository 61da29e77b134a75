#!/usr/bin/env bash
# slabstage.hf on a GPU machine without transformers: install the wheels in .whl/ (git-ignored,
# fetched with pip download for Python 3.12 manylinux x86_64), then the hf tests and the hf benchmark.
#   bash tools/gpu_hf.sh            (results under $OUT, or /tmp/slabstage-gpu: hf.json and logs)
set -u
OUT=${OUT:-/tmp/slabstage-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'gpu', torch.cuda.get_device_name())" 2>&1 | tee "$OUT/hf_machine.txt"
python3 -m pytest tests/hf/test_hf_models.py tests/hf/test_hf_example.py -q -p no:cacheprovider -rfEs 2>&1 | tee "$OUT/hf_tests.log" | tail -25
tests_rc=${PIPESTATUS[0]}
python3 examples/qwen3_vl.py --device cuda 2>&1 | tee "$OUT/hf_demo.log" | tail -8
python3 examples/qwen3_vl.py --device cuda --dtype bf16 2>&1 | tee -a "$OUT/hf_demo.log" | tail -4
python3 -m pytest bench/bench_hf.py --benchmark-enable --benchmark-json="$OUT/hf.json" -q -p no:cacheprovider \
  --benchmark-columns=median,iqr,rounds 2>&1 | tee "$OUT/hf_bench.log" | tail -60
bench_rc=${PIPESTATUS[0]}
echo "hf tests rc=$tests_rc, hf bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
