#!/usr/bin/env bash
# Issue 45: the GSM8K reward comparison, one device call per invocation, after the vLLM bundle and mk_smollm2.py
# (carry .dev/gsm8k, a copy of ../shared/data/gsm8k, and $SELECTION):
#
#   . .dev/vllm/t/env.sh && python3 .dev/vllm/t/mk_smollm2.py && \
#     SELECTION=benchmarks/results/h200/compare_gsm8k/warmstart_selection.json bash benchmarks/gpu/gsm8k_compare_call.sh
#
# 0. Where a checkpoint was carried to this machine ($CKPT_T, default .dev/ckpt/t, carried with the call after
#    ckpt_parts.sh's chunk calls): ckpt_join.sh restores it into $CKPT and checks it (exit 3 where chunks are missing
#    or do not match); then step 1 does not run.
# 1. When $CKPT holds no checkpoint (the first call on a fresh machine): the warm start of the setting $SELECTION
#    chose (benchmarks.gsm8k_warmstart_publish select), built into $CKPT by gsm8k_warmstart_call.sh with that
#    setting's arguments (trained on train_minus_validation, scored on validation; the base model's validation
#    scoring is taken from $BEFORE, the committed one by default, set BEFORE= to score it again), then the
#    checkpoint's greedy accuracy on the whole test split, once (gsm8k_baseline into $OUT/test_<first 12 hex of its
#    sha256>/).
# 2. bloggap compare over arms $ARMS (A B F H J) with benchmarks/gsm8k_compare.yaml and --model $CKPT, given the
#    call's time left (BUDGET_S in all, default 520): the sweep resumes, refuses to finish a seed whose finished runs
#    started from another checkpoint, and exits 3 when the budget ends with runs left (make the call again); a run
#    that fails is started RETRIES more times in the same call (default 1, bloggap compare --retries).
# Outputs in $OUT (else .dev/gsm8k_compare_call): warmstart/ (gsm8k_warmstart.json, its log, eval_*), test_*/
# (gsm8k_baseline.json, completions.jsonl), compare_gsm8k.tgz (the sweep's runs and outputs, no policies).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="${PYTHONPATH:-}:$PWD"
MODEL=${MODEL:-/tmp/vx/smollm2}
DATA=${DATA:-.dev/gsm8k}
OUT=${OUT:-.dev/gsm8k_compare_call}
CKPT=${CKPT:-/tmp/vx/smollm2-gsm8k-sft}
ARMS=${ARMS:-"A B F H J"}
BUDGET_S=${BUDGET_S:-520}
SWEEP=${SWEEP:-.dev/compare_gsm8k}
BEFORE=${BEFORE-benchmarks/results/h200/compare_gsm8k/base_validation/gsm8k_baseline.json}
CKPT_T=${CKPT_T:-.dev/ckpt/t}
start=$SECONDS
mkdir -p "$OUT"
if [ ! -f "$CKPT/config.json" ] && [ -f "$CKPT_T/checkpoint.sha256" ]; then
  # a checkpoint carried to this machine (ckpt_parts.sh's chunk calls, then $CKPT_T with this call): restored, checked
  CKPT=$CKPT T=$CKPT_T bash benchmarks/gpu/ckpt_join.sh || exit 3
fi
if [ ! -f "$CKPT/config.json" ]; then
  if [ -z "${SELECTION:-}" ] || [ ! -f "$SELECTION" ]; then
    echo "gsm8k_compare_call: no checkpoint in $CKPT and no SELECTION file: set SELECTION to the file" \
      "benchmarks.gsm8k_warmstart_publish select wrote" >&2
    exit 2
  fi
  arguments=$(python3 -c "import json, sys; print(' '.join(json.load(open(sys.argv[1]))['arguments']))" "$SELECTION") \
    || exit 2
  mkdir -p "$OUT/warmstart"
  # shellcheck disable=SC2086 # the chosen setting's arguments are words
  MODEL=$MODEL DATA=$DATA OUT="$OUT/warmstart" CKPT=$CKPT WARMSTART_S=$((BUDGET_S - (SECONDS - start))) \
    bash benchmarks/gpu/gsm8k_warmstart_call.sh $arguments ${BEFORE:+--before-from "$BEFORE"} || exit 1
  sha=$(python3 -m benchmarks.gsm8k_warmstart hash "$CKPT") || exit 1
  timeout $((BUDGET_S - (SECONDS - start))) python3 -m benchmarks.gsm8k_baseline --model "$CKPT" --data "$DATA" \
    --split test --decodings greedy --out "$OUT/test_${sha:0:12}" --completions "$OUT/test_${sha:0:12}/completions.jsonl" \
    || exit 1
fi
recipes=()
for arm in $ARMS; do recipes+=("recipes/arm_$arm.yaml"); done
left=$((BUDGET_S - (SECONDS - start)))
if [ "$left" -lt 60 ]; then
  echo "gsm8k_compare_call: the warm start took the call ($left s left); make the call again for the sweep" >&2
  exit 3
fi
# A run that fails is started once more in the same call (--retries, RETRIES to change it): a failed evaluation can
# be redone only from the policy its run saved, which a fresh machine would no longer have.
timeout $((left + 70)) python3 -m bloggap_plugin.cli compare "${recipes[@]}" --config benchmarks/gsm8k_compare.yaml \
  --model "$CKPT" --data "$DATA" --output-dir "$SWEEP" --time-budget-s "$left" --retries "${RETRIES:-1}"
code=$?
[ -d "$SWEEP" ] && tar czf "$OUT/compare_gsm8k.tgz" --exclude=trainer -C "$(dirname "$SWEEP")" "$(basename "$SWEEP")"
echo "gsm8k_compare_call: compare exit $code, $((SECONDS - start)) s"
exit $code
