#!/usr/bin/env bash
# Issue 15 item 2 on the GPU machine in one device call, after the vLLM bundle and mk_smollm2.py (carry .dev/gsm8k,
# a copy of ../shared/data/gsm8k):
#
#   . .dev/vllm/t/env.sh && MODEL=/tmp/vx/smollm2 bash benchmarks/gpu/gsm8k_call.sh
#
# 1. T15-baseline on the whole GSM8K test split (1,319 rows; vLLM; greedy and sampled at T = 1), the JSON rewritten
#    after every piece, so a time limit keeps the finished cells;
# 2. the demonstration run (benchmarks/gsm8k_demo.yaml: arms A and H, 60 steps, 1-2 step problems, vLLM), resumable.
# Outputs in $OUT (set on the GPU machine; else .dev/gsm8k_call): gsm8k_baseline.json, gsm8k_completions.jsonl,
# gsm8k_demo.tgz (the demo's compare.json, compare.md, curves and run logs). Exit 0 when both finished.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="${PYTHONPATH:-}:$PWD"
MODEL=${MODEL:-smollm2}
DATA=${DATA:-.dev/gsm8k}
OUT=${OUT:-.dev/gsm8k_call}
mkdir -p "$OUT"
timeout "${BASELINE_S:-240}" python3 -m benchmarks.gsm8k_baseline --model "$MODEL" --data "$DATA" --out "$OUT" \
  --completions "$OUT/gsm8k_completions.jsonl"
baseline=$?
timeout "${DEMO_S:-330}" python3 -m bloggap_plugin.cli compare recipes/arm_A.yaml recipes/arm_H.yaml \
  --config benchmarks/gsm8k_demo.yaml --model "$MODEL" --data "$DATA"
demo=$?
[ -d .dev/gsm8k_demo ] && tar czf "$OUT/gsm8k_demo.tgz" --exclude=trainer -C .dev gsm8k_demo
echo "gsm8k_call: baseline exit $baseline, demo exit $demo"
[ "$baseline" = 0 ] && [ "$demo" = 0 ]
