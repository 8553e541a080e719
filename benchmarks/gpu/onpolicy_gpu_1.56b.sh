#!/usr/bin/env bash
set -u
t0=$(date +%s)
mkdir -p /tmp/vx && mv .dev/vllm/p5/part_* /tmp/vx/ && bash .dev/vllm/t/install.sh || exit 3
. .dev/vllm/t/env.sh
python3 .dev/vllm/t/mk_smollm2.py 2>&1 | tail -1
python3 -m benchmarks.cost_by_size shape llama-1.56b-v49k --tokenizer /tmp/vx/smollm2 --out /tmp/vx/l156 2>&1 | tail -1
for m in "" /tmp/vx/l156; do
  echo "== model ${m:-tiny random Llama}"
  BLOGGAP_GPU_TEST_MODEL=$m timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/core/test_onpolicy_gpu.py \
    2>&1 | grep -E "relative L2|passed|failed|FAILED|Error" | cut -c1-300
done 2>&1 | tee "$OUT/onpolicy_gpu_grad.log"
echo "call total $(( $(date +%s) - t0 )) s"
