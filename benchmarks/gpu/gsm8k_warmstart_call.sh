#!/usr/bin/env bash
# Issue 33 item 1 on the GPU machine in one device call, after the vLLM bundle (it carries TRL and datasets) and
# mk_smollm2.py (carry .dev/gsm8k, a copy of ../shared/data/gsm8k):
#
#   . .dev/vllm/t/env.sh && python3 .dev/vllm/t/mk_smollm2.py && bash benchmarks/gpu/gsm8k_warmstart_call.sh
#
# benchmarks/gsm8k_warmstart.py with its defaults (3 epochs over the train split, lr 5e-5 cosine, 64 rows a step,
# bf16 autocast, seed $SEED): greedy accuracy on the whole test split before (vLLM), the SFT warm start, the checkpoint
# and its sha256, greedy accuracy after. Extra arguments go to it (e.g. --max-steps 200). Outputs in $OUT (set on the
# GPU machine; else .dev/gsm8k_warmstart): gsm8k_warmstart.json (rewritten after every phase), gsm8k_warmstart.log,
# eval_before/ and eval_after/ (gsm8k_baseline.json and completions.jsonl each): 6 files. The checkpoint goes to $CKPT
# (default /tmp/vx/smollm2-gsm8k-sft), outside $OUT, which returns at most 8 files; later steps of the same call (or of
# a call made while the machine is still warm) load it from there. Exit 0 when every phase finished.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="${PYTHONPATH:-}:$PWD"
MODEL=${MODEL:-/tmp/vx/smollm2}
DATA=${DATA:-.dev/gsm8k}
OUT=${OUT:-.dev/gsm8k_warmstart}
CKPT=${CKPT:-/tmp/vx/smollm2-gsm8k-sft}
mkdir -p "$OUT"
timeout "${WARMSTART_S:-500}" python3 -m benchmarks.gsm8k_warmstart run --model "$MODEL" \
  --model-name SmolLM2-135M-Instruct --data "$DATA" --out "$OUT" --ckpt "$CKPT" --seed "${SEED:-0}" "$@" 2>&1 \
  | tee "$OUT/gsm8k_warmstart.log"
code=$?
echo "gsm8k_warmstart_call: exit $code"
exit $code
