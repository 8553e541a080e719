# Sourced by the last bundle call's scripts (vLLM 0.26 bundle of ../shared/device/vllm.sh, chunk 5 carried with
# .dev/vllm/t): install the bundle, set its environment, write the SmolLM2 folder (/tmp/vx/smollm2) and the
# llama-1.56b-v49k shape (/tmp/vx/l156). Exits the calling script with 3 where the install fails.
mkdir -p /tmp/vx && mv .dev/vllm/p5/part_* /tmp/vx/ && bash .dev/vllm/t/install.sh 2>&1 | grep -v "^WARNING" || exit 3
. .dev/vllm/t/env.sh
python3 .dev/vllm/t/mk_smollm2.py 2>&1 | tail -1
python3 -m benchmarks.cost_by_size shape llama-1.56b-v49k --tokenizer /tmp/vx/smollm2 --out /tmp/vx/l156 2>&1 | tail -1
