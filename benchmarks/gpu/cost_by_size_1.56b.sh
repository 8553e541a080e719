#!/usr/bin/env bash
# call 5: install the bundle, the SmolLM2 folder, the 1.56B shape, then cost_by_size runs until BUDGET
set -u
t0=$(date +%s)
mkdir -p /tmp/vx && mv .dev/vllm/p5/part_* /tmp/vx/ && bash .dev/vllm/t/install.sh || exit 3
. .dev/vllm/t/env.sh
python3 .dev/vllm/t/mk_smollm2.py 2>&1 | tail -2
python3 -m benchmarks.cost_by_size shape llama-1.56b-v49k --tokenizer /tmp/vx/smollm2 --out /tmp/vx/l156 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
left=$(( 555 - ($(date +%s) - t0) ))
echo "setup $(( $(date +%s) - t0 )) s; budget for runs ${left} s"
timeout $((left + 30)) python3 -m benchmarks.cost_by_size run --model llama-1.56b=/tmp/vx/l156 \
   --arms A,I,J,I:vllm_workspaces,H --repeats 3 --steps 30 --budget-s "$left" --out /tmp/c1 2>&1 \
   | grep -v "^\s*$" | cut -c1-600
tar -cJf "$OUT/c1.tar.xz" -C /tmp c1
cp /tmp/c1/cost_by_size.json "$OUT/" 2>/dev/null
echo "call total $(( $(date +%s) - t0 )) s"
