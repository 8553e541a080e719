#!/usr/bin/env bash
# Every H200 measurement of the project, in two phases (one device call each):
#   measure : results that do not depend on wall time, run side by side on the one GPU
#   timing  : cost and per-step overhead, each job alone so timings are not shared with other work
# Usage on the GPU machine, from the repo root, with $BLOGGAP_GGUF set and trl/datasets/gguf on PYTHONPATH:
#   bash benchmarks/gpu/run_h200.sh measure "$OUT" [JOBS]      bash benchmarks/gpu/run_h200.sh timing "$OUT" [JOBS]
# (JOBS: optional comma list, e.g. doctor,tables, to re-run only those jobs)
# JSON and plots land in $OUT/r/ (copy into benchmarks/results/h200/); logs and the compare run folder in
# $OUT/logs_<phase>.tgz. Each job has a time limit so the whole call ends inside the device's 10 minutes.
set -uo pipefail
phase=${1:?phase: measure or timing}
out=${2:?output folder}
res="$out/r"; logs="$out/logs"
mkdir -p "$res" "$logs"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="${PYTHONPATH:-}:$PWD"
py=python3
# One load first so the dense SmolLM2 copy is cached before parallel jobs start (the GGUF dequantises in ~30 s).
$py -c "from bloggap_plugin.models import load_model; load_model('smollm2')" >/dev/null 2>&1

only=${3:-}  # optional comma list of job names to run (default: all of the phase)
job() {  # name, limit_s, command...: run in the background under a time limit; log and record exit code + wall time
  local name=$1 limit=$2; shift 2
  if [ -n "$only" ] && [[ ",$only," != *",$name,"* ]]; then return; fi
  ( start=$(date +%s); timeout "$limit" "$@" > "$logs/$name.log" 2>&1; rc=$?
    echo "$name rc=$rc wall_s=$(( $(date +%s) - start ))" >> "$out/status.txt" ) &
}

case "$phase" in
  measure)
    job doctor  300 $py -m bloggap_plugin.cli doctor --device cuda --json "$res/doctor.json"
    job tables  480 $py -m benchmarks.tables --out "$res"
    job ladder  400 $py -m benchmarks.ladder --out "$res"
    job trunc   300 $py -m benchmarks.trunc_bias --out "$res"
    job compare 520 $py -m benchmarks.compare_gpu --out "$res"
    wait
    ;;
  timing)
    job cost 200 $py -m benchmarks.cost --out "$res"; wait
    job trl  330 $py -m benchmarks.trl_arms --out "$res"; wait
    job overhead 420 $py -m benchmarks.trl_arms --arms A,G --probe-every 1 8 --probe-budget 0 0.005 --name trl_overhead \
      --out "$res"; wait
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
[ -d "$res/compare_gpu" ] && mv "$res/compare_gpu" "$logs/"
tar czf "$out/logs_$phase.tgz" -C "$logs" . && rm -rf "$logs"
cat "$out/status.txt"
ls -la "$res"
