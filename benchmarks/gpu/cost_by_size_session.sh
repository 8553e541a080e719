#!/usr/bin/env bash
# Issue 44's remaining cost runs as one job of benchmarks/gpu/session.sh, started in the vLLM 0.26 bundle's last call
# (its last chunk, .dev/vllm/p<nparts>, carried with .dev/vllm/t), in order of what the issue needs most:
#   1. tiles_first.sh for SHAPE (default llama-0.48b-v49k) and ARMS (default A,J:tiles,I:tiles,H): install, the
#      SmolLM2 folder, the shape, its tile table from `bloggap tiles`, the tiles GPU test, then 3 interleaved runs of
#      each arm into /tmp/c1 (30 steps);
#   2. SmolLM2-135M (real weights), arms SMALL_ARMS (default A,J; SMALL_ARMS= skips it) x3 interleaved into /tmp/c2;
#   2p. with PROFILE_ARMS (e.g. A,J; default none), torch profiles of SmolLM2-135M's optimizer steps 10-11 per arm
#      (GapCallback entry, benchmarks.arm_i_live's callback_X_ni2 runs, 12 steps) into $OUT/prof_135m/: where arm J's
#      step goes at the size where it costs most per step (host vs device time, kernel families); PROFILE_SHAPES=1
#      adds each profile's matmuls by input shape (which of them take the host's time);
#   3. arm J's GPU forward and gradient test on the 1.56B shape (tests/core/test_onpolicy_gpu.py with
#      BLOGGAP_GPU_TEST_MODEL; phase 1's folder where SHAPE is that shape), into $OUT/onpolicy_gpu_grad.log
#      (GRAD_TEST=0 skips it);
#   4. with the time left, the 3B-class shape llama-3b-v49k, arms BIG_ARMS (default A,J:tiles with its own tile
#      table), up to BIG_REPEATS (default 3) interleaved runs each into /tmp/c3: whether it fits beside vLLM on this
#      card, and at what step time (BIG_ARMS= skips it, e.g. where phase 1's SHAPE is the 3B shape). BIG_MEMORY
#      (e.g. 0.15; default the runs' 0.3) gives its engines that share of the GPU instead, for a card where 0.3 leaves
#      the trainer too little (T30: out of memory on an H100); its rows are then labelled llama-3b-vllmBIG_MEMORY.
# Every phase ends by the job's end less the later phases' reserves (SMALL_S, default 420 s; PROFILE_S, default
# 300 s; TEST_S, default 150 s; BIG_S, default 0: phase 4 gets what is left), so a slow phase costs the later phases
# nothing but its own leftovers; a skipped phase reserves nothing.
#   OUT=$OUT SESSION_S=<...> PACK="/tmp/c1 /tmp/c2 /tmp/c3" bash benchmarks/gpu/session.sh start \
#       bash benchmarks/gpu/cost_by_size_session.sh
set -u
VX=${VX:-/tmp/vx}  # bundle_and_shape.sh's folder (another only in tests)
t0=$(date +%s)
end=$((t0 + BUDGET_S - 60))  # the last minute packs
SMALL_ARMS=${SMALL_ARMS-A,J}; GRAD_TEST=${GRAD_TEST:-1}
PROFILE_ARMS=${PROFILE_ARMS:-}
small_s=${SMALL_S:-420}; test_s=${TEST_S:-150}; big_s=${BIG_S:-0}; profile_s=${PROFILE_S:-300}
[ -z "$SMALL_ARMS" ] && small_s=0
[ -z "$PROFILE_ARMS" ] && profile_s=0
[ "$GRAD_TEST" = 0 ] && test_s=0
left() {  # seconds until the job's end less $1 s of reserve, at least 1 (timeout 0 would mean no limit)
  local seconds=$(( end - $(date +%s) - $1 )); [ "$seconds" -lt 1 ] && seconds=1; echo "$seconds"
}

echo "== phase 1: ${SHAPE:=llama-0.48b-v49k}, arms ${ARMS:=A,J:tiles,I:tiles,H}"
export SHAPE ARMS
BUDGET_S=$(( $(left $((small_s + profile_s + test_s + big_s))) + 60 )) bash benchmarks/gpu/tiles_first.sh -
. .dev/vllm/t/env.sh

if [ -n "$SMALL_ARMS" ]; then
  echo "== phase 2: smollm2-135m, arms $SMALL_ARMS at $(( $(date +%s) - t0 )) s"
  bash benchmarks/gpu/cost_by_size_more.sh c2 "$(left $((profile_s + test_s + big_s)))" \
    --model smollm2-135m="$VX/smollm2" --arms "$SMALL_ARMS" --repeats 3 --steps 30
fi

if [ -n "$PROFILE_ARMS" ]; then
  echo "== phase 2p: profiles of smollm2-135m, arms $PROFILE_ARMS at $(( $(date +%s) - t0 )) s"
  runs=$(echo "$PROFILE_ARMS" | sed -E 's/([A-J])/callback_\1_ni2/g')
  shapes=(); [ "${PROFILE_SHAPES:-0}" != 0 ] && shapes=(--profile-shapes)
  timeout "$(left $((test_s + big_s)))" python3 -m benchmarks.arm_i_live run --model "$VX/smollm2" \
    --out "$OUT/prof_135m" --steps 12 --memory 0.3 --runs "$runs" --profile-steps 10-11 \
    ${shapes[@]+"${shapes[@]}"} 2>&1 \
    | grep -v "^\s*$" | tail -12 | cut -c1-300
fi

if [ "$GRAD_TEST" != 0 ]; then
  echo "== phase 3: arm J's gradient test at 1.56B at $(( $(date +%s) - t0 )) s"
  built=0  # phase 1's shape when SHAPE is the 1.56B one (bundle_and_shape.sh writes it to $VX/l156): kept, not rebuilt
  if [ ! -f "$VX/l156/config.json" ]; then
    python3 -m benchmarks.cost_by_size shape llama-1.56b-v49k --tokenizer "$VX/smollm2" --out "$VX/l156" 2>&1 | tail -1
    built=1
  fi
  TEST_END=$((end - big_s)) bash benchmarks/gpu/onpolicy_grad_test.sh "$VX/l156"
  [ "$built" = 1 ] && rm -rf "$VX/l156"
fi

left_s=$(left 0)
BIG_ARMS=${BIG_ARMS-A,J:tiles}
echo "== phase 4: llama-3b-v49k, arms ${BIG_ARMS:-none}, ${left_s} s left at $(( $(date +%s) - t0 )) s"
if [ -n "$BIG_ARMS" ] && [ "$left_s" -gt 240 ]; then
  python3 -m benchmarks.cost_by_size shape llama-3b-v49k --tokenizer "$VX/smollm2" --out "$VX/llama-3b-v49k" 2>&1 \
    | tail -1
  tiles=()
  if [[ "$BIG_ARMS" == *:tiles* ]]; then
    timeout 150 python3 -m bloggap_plugin.cli tiles --model "$VX/llama-3b-v49k" --out "$VX/tiles_3b.json" 2>&1 \
      | grep -v "^\[tiles" | tail -5
    . benchmarks/gpu/tiles_or_plain.sh
    tiles_or_plain "$VX/tiles_3b.json" BIG_ARMS
  fi
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  big_label=llama-3b; memory=()
  if [ -n "${BIG_MEMORY:-}" ]; then big_label="llama-3b-vllm$BIG_MEMORY"; memory=(--memory "$BIG_MEMORY"); fi
  bash benchmarks/gpu/cost_by_size_more.sh c3 "$(left 0)" --model "$big_label=$VX/llama-3b-v49k" --arms "$BIG_ARMS" \
    --repeats "${BIG_REPEATS:-3}" --steps 30 ${tiles[@]+"${tiles[@]}"} ${memory[@]+"${memory[@]}"}
fi
echo "job total $(( $(date +%s) - t0 )) s"
