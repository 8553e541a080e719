#!/usr/bin/env bash
# The last bundle call (vLLM 0.26 bundle of ../shared/device/vllm.sh; its last chunk, .dev/vllm/p<nparts>, carried
# with .dev/vllm/t): install, the SmolLM2 folder, a shape (SHAPE, default the 1.56B one: bundle_and_shape.sh), then
# cost_by_size runs of that shape until the call's budget. Args: ARMS (default A,I,J), BUDGET s for the whole call
# (default 560).
set -u
t0=$(date +%s)
arms=${1:-A,I,J}; budget=${2:-560}
. benchmarks/gpu/bundle_and_shape.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
left=$(( budget - ($(date +%s) - t0) ))
echo "setup $(( $(date +%s) - t0 )) s; budget for runs ${left} s"
timeout $((left + 30)) python3 -m benchmarks.cost_by_size run --model "$SHAPE_LABEL=$SHAPE_DIR" --arms "$arms" \
   --repeats 3 --steps 30 --budget-s "$left" --out /tmp/c1 2>&1 | grep -v "^\s*$" | cut -c1-600
tar -cJf "$OUT/c1.tar.xz" -C /tmp c1
cp /tmp/c1/cost_by_size.json "$OUT/" 2>/dev/null
echo "call total $(( $(date +%s) - t0 )) s"
