#!/usr/bin/env bash
# Issue 44 item 3, the matmul-tiles route, as the last bundle call (vLLM 0.26 bundle of ../shared/device/vllm.sh,
# chunk 5 carried with .dev/vllm/t): install, the SmolLM2 folder and a shape (bundle_and_shape.sh; SHAPE as there),
# then
#   1. python -m benchmarks.bi_matmul on the shape: T25 into $OUT/bi_matmul.json, the tile table it supports into
#      $OUT/tiles.json (kept in /tmp/vx/tiles.json for later calls);
#   2. the tiles GPU test (rows keep their bits whatever bucket serves the call);
#   3. cost_by_size runs of the shape, arms $ARMS (default A,J:tiles,J,I:tiles,I), until the call's budget, with that
#      table for the :tiles arms (later calls: cost_by_size_more.sh c1 BUDGET --matmul-tiles /tmp/vx/tiles.json ...).
# Args: BUDGET s for the whole call (default 570); REVISION: the commit the tree is, for the result.
set -u
rm -f /tmp/vx/tiles.json
t0=$(date +%s)
budget=${1:-570}; arms=${ARMS:-A,J:tiles,J,I:tiles,I}
. benchmarks/gpu/bundle_and_shape.sh
echo "setup $(( $(date +%s) - t0 )) s"
timeout 240 python3 -m benchmarks.bi_matmul run --shape "$SHAPE" --out "$OUT/bi_matmul.json" \
  --tiles-out /tmp/vx/tiles.json --revision "${REVISION:-unknown}" 2>&1 \
  | grep -v "^\s*$" | cut -c1-400 | tail -60
tiles=(--matmul-tiles /tmp/vx/tiles.json)
cp /tmp/vx/tiles.json "$OUT/" 2>/dev/null || { echo "no tile table: the runs below are arms without it"; tiles=()
  arms=$(printf '%s\n' ${arms//,/ } | sed 's/:tiles$//' | awk '!seen[$0]++' | paste -sd,); }
echo "bi_matmul done at $(( $(date +%s) - t0 )) s"
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_vllm_tiles_gpu.py 2>&1 | tail -4
left=$(( budget - ($(date +%s) - t0) ))
echo "budget for runs ${left} s"
bash benchmarks/gpu/cost_by_size_more.sh c1 "$left" --model "$SHAPE_LABEL=$SHAPE_DIR" --arms "$arms" --repeats 3 \
  --steps 30 ${tiles[@]+"${tiles[@]}"}
echo "call total $(( $(date +%s) - t0 )) s"
