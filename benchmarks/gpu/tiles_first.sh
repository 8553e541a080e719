#!/usr/bin/env bash
# Issue 44 item 3, the matmul-tiles route, as the last bundle call (vLLM 0.26 bundle of ../shared/device/vllm.sh,
# its last chunk, .dev/vllm/p<nparts>, carried with .dev/vllm/t): install, the SmolLM2 folder and a shape
# (bundle_and_shape.sh; SHAPE as there, e.g. SHAPE=qwen2-1.39b-v49k or llama-0.48b-v49k), then
#   1. the tile table for the shape into /tmp/vx/tiles.json (kept for later calls) and $OUT/tiles.json: with
#      TILES_BY=command (the default) the user's command, bloggap tiles --model SHAPE_DIR (every case into
#      $OUT/tiles_cases.json); with TILES_BY=harness python -m benchmarks.bi_matmul (T25 into $OUT/bi_matmul.json);
#   2. the tiles GPU test (rows keep their bits whatever bucket serves the call);
#   3. cost_by_size runs of the shape, arms $ARMS (default A,J:tiles,J,I:tiles,I), until the call's budget; the :tiles
#      runs name the table with gap.matmul_tiles (later calls: cost_by_size_more.sh c1 BUDGET --matmul-tiles
#      /tmp/vx/tiles.json ...).
# Args: BUDGET s for the whole call (default 570; "-": $BUDGET_S less 60 s, as a job of benchmarks/gpu/session.sh
# gets it, with PACK=/tmp/c1 there); REVISION: the commit the tree is, for the harness's result.
set -u
rm -f /tmp/vx/tiles.json
t0=$(date +%s)
budget=${1:-570}; arms=${ARMS:-A,J:tiles,J,I:tiles,I}
[ "$budget" = "-" ] && budget=$((BUDGET_S - 60))
. benchmarks/gpu/bundle_and_shape.sh
echo "setup $(( $(date +%s) - t0 )) s"
if [ "${TILES_BY:-command}" = harness ]; then
  timeout 240 python3 -m benchmarks.bi_matmul run --shape "$SHAPE" --out "$OUT/bi_matmul.json" \
    --tiles-out /tmp/vx/tiles.json --revision "${REVISION:-unknown}" 2>&1 \
    | grep -v "^\s*$" | cut -c1-400 | tail -60
else
  timeout 240 python3 -m bloggap_plugin.cli tiles --model "$SHAPE_DIR" --out /tmp/vx/tiles.json \
    --cases "$OUT/tiles_cases.json" 2>&1 | grep -v "^\[tiles" | tail -20
fi
. benchmarks/gpu/tiles_or_plain.sh
tiles_or_plain /tmp/vx/tiles.json arms
echo "tile table done at $(( $(date +%s) - t0 )) s"
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_vllm_tiles_gpu.py 2>&1 | tail -4
left=$(( budget - ($(date +%s) - t0) ))
echo "budget for runs ${left} s"
bash benchmarks/gpu/cost_by_size_more.sh c1 "$left" --model "$SHAPE_LABEL=$SHAPE_DIR" --arms "$arms" --repeats 3 \
  --steps 30 ${tiles[@]+"${tiles[@]}"}
echo "call total $(( $(date +%s) - t0 )) s"
