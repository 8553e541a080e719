#!/usr/bin/env bash
# The decisive reward comparison on the H200 (issue 15 item 3): arms A B E F G H (ARMS="A B D E F G H" adds D),
# 200 optimizer steps per run, arithmetic level 2, TRL's colocated vLLM generation, 8 runs at a time on the one GPU
# (one wave per call: 244-338 s measured), greedy held-out accuracy at the end of each run; settings in
# benchmarks/compare_sweep.yaml. Ran with seeds 0-4 (docs/compare.md "The decisive sweep": calls, result).
#
# One device call (<= 10 min) per invocation, from the repository root, after the vLLM bundle and mk_smollm2.py
# (docs/vllm.md "Reproduce"):
#
#   . .dev/vllm/t/env.sh && MODEL=/tmp/vx/smollm2 bash benchmarks/compare_sweep.sh
#
# Exit 3: the call's time budget (520 s) ended with runs left; make the same call again (finished runs and their
# held-out results are kept; runs stopped in flight start over). Exit 0: every run is done; the outputs are in
# .dev/compare_sweep/ (compare.json, compare.md, reward_curves.png). Exit 1: a run failed (runs/<run>.out), the
# next call retries it. The folder stays between calls on one machine (an ignored path); for a fresh machine carry
# .dev/compare_sweep/runs (logs and held-out results, well under 1 MB per run; trainer/ holds only policies waiting
# for their evaluation and is not needed). With $OUT set, the runs and outputs are also packed into
# $OUT/compare_sweep.tgz to come back.
#
# Stages: SEEDS="0 1 2 3" first (24 runs), read the paired smallest detectable difference in compare.md, then add
# seeds (SEEDS="0 1 2 3 4", or the yaml's 8 without SEEDS): finished runs are kept.
# SMOKE=1: every arm x seeds 0-1 x 20 steps, all 12 runs at once, 64 held-out prompts, in its own folder: a check
# that 12 colocated engines, the evaluation and the outputs work on the GPU (its first run found the shared
# MASTER_PORT; 12 at once has not run since the fix). BUDGET (s) sets the call's time budget; the call itself ends at
# BUDGET + 70 s. PARALLEL overrides the yaml's runs at once.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="${PYTHONPATH:-}:$PWD"
MODEL=${MODEL:-smollm2}
ARMS=${ARMS:-"A B E F G H"}
BUDGET=${BUDGET:-520}
extra=()
if [ -n "${SEEDS:-}" ]; then extra+=(--seeds $SEEDS); fi
if [ -n "${PARALLEL:-}" ]; then extra+=(--parallel "$PARALLEL"); fi   # runs at once (the yaml's 12 otherwise)
if [ "${SMOKE:-0}" = 1 ]; then
  extra+=(--seeds 0 1 --max-steps 20 --parallel 12 --heldout-n 64 --last-n 5 --output-dir .dev/compare_sweep_smoke)
fi
recipes=()
for arm in $ARMS; do recipes+=("recipes/arm_$arm.yaml"); done
# recipes first: --seeds takes every number after it
timeout $((BUDGET + 70)) python3 -m bloggap_plugin.cli compare "${recipes[@]}" --config benchmarks/compare_sweep.yaml \
  --model "$MODEL" --time-budget-s "$BUDGET" "${extra[@]}"
code=$?
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/compare_sweep.tgz" --exclude=trainer -C .dev compare_sweep compare_sweep_smoke 2>/dev/null
fi
exit $code
