#!/usr/bin/env bash
set -u
t0=$(date +%s)
. benchmarks/gpu/bundle_and_shape.sh
BLOGGAP_GPU_TEST_MODEL=/tmp/vx/l156 timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/core/test_onpolicy_gpu.py \
    2>&1 | grep -E "relative L2|passed|failed" | cut -c1-300 | tee "$OUT/onpolicy_gpu_bf16bwd.log"
left=$(( 215 - ($(date +%s) - t0) ))
echo "budget for runs ${left} s"
timeout $((left + 20)) python3 -m benchmarks.cost_by_size run --model llama-1.56b=/tmp/vx/l156 --arms J,A --repeats 1 \
   --steps 30 --budget-s "$left" --out /tmp/c3 2>&1 | grep -v "^\s*$" | cut -c1-700
tar -cJf "$OUT/c3.tar.xz" -C /tmp c3
echo "call total $(( $(date +%s) - t0 )) s"
