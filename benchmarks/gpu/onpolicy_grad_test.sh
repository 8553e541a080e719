#!/usr/bin/env bash
# Arm J's forward and gradient GPU test (tests/core/test_onpolicy_gpu.py) on its small random Llama and on the model
# folder $1 (BLOGGAP_GPU_TEST_MODEL): the lines that say how each went, also into $OUT/onpolicy_gpu_grad.log. Each
# run's time limit: 150 s, or with TEST_END (epoch seconds) the time left until then (at least 1 s: timeout 0 would
# mean no limit). The caller has set the vLLM bundle's environment (.dev/vllm/t/env.sh).
set -u
limit() {
  [ -z "${TEST_END:-}" ] && { echo 150; return; }
  local seconds=$(( TEST_END - $(date +%s) )); [ "$seconds" -lt 1 ] && seconds=1; echo "$seconds"
}
for model in "" "$1"; do
  echo "== model ${model:-tiny random Llama}"
  BLOGGAP_GPU_TEST_MODEL=$model timeout "$(limit)" python3 -m pytest -q -m gpu -p no:cacheprovider -s \
    tests/core/test_onpolicy_gpu.py 2>&1 | grep -E "relative L2|passed|failed|FAILED|Error" | cut -c1-300
done 2>&1 | tee "$OUT/onpolicy_gpu_grad.log"
