#!/usr/bin/env bash
# A later call on the same warm machine: cost_by_size runs into /tmp/NAME (resuming its finished runs) for BUDGET
# seconds; usage: bash benchmarks/gpu/cost_by_size_more.sh NAME BUDGET RUN_FLAGS... (the bundle's t/ carried).
# BUDGET "-": $BUDGET_S less 60 s for the packing, as a job of benchmarks/gpu/session.sh gets it (there PACK=/tmp/NAME
# packs the runs finished so far at every watch).
set -u
t0=$(date +%s); name=$1; budget=$2; shift 2
[ "$budget" = "-" ] && budget=$((BUDGET_S - 60))
. .dev/vllm/t/env.sh
# each line as it comes (grep | cut held them in a pipe's buffer, so a session's watch saw no finished run; mawk
# buffers its input too): bash's read takes a pipe a byte at a time
timeout $((budget + 40)) python3 -m benchmarks.cost_by_size run --budget-s "$budget" --out /tmp/$name "$@" 2>&1 \
   | while IFS= read -r line; do [ -n "${line//[[:space:]]/}" ] && printf '%s\n' "${line:0:600}"; done
tar -cJf "$OUT/$name.tar.xz" -C /tmp "$name"
cp /tmp/$name/cost_by_size.json "$OUT/" 2>/dev/null
echo "call total $(( $(date +%s) - t0 )) s"
