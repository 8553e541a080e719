#!/usr/bin/env bash
set -u
t0=$(date +%s)
. benchmarks/gpu/bundle_and_shape.sh
for m in "" /tmp/vx/l156; do
  echo "== model ${m:-tiny random Llama}"
  BLOGGAP_GPU_TEST_MODEL=$m timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/core/test_onpolicy_gpu.py \
    2>&1 | grep -E "relative L2|passed|failed|FAILED|Error" | cut -c1-300
done 2>&1 | tee "$OUT/onpolicy_gpu_grad.log"
echo "call total $(( $(date +%s) - t0 )) s"
