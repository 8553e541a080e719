#!/usr/bin/env bash
# Issue 33 item 1, more warm-start settings in one device call, after the vLLM bundle and mk_smollm2.py (carry
# .dev/gsm8k, a copy of ../shared/data/gsm8k):
#
#   . .dev/vllm/t/env.sh && python3 .dev/vllm/t/mk_smollm2.py && \
#     bash benchmarks/gpu/gsm8k_warmstart_settings.sh "lr2e-4=--lr 2e-4" "lr1e-4-e5=--lr 1e-4 --epochs 5"
#
# Each argument is NAME=ARGUMENTS: benchmarks/gpu/gsm8k_warmstart_call.sh with those arguments (its MODEL, DATA and
# SEED), the base model's evaluation taken from $BEFORE (--before-from; the committed H200 run's by default, so only
# training and the evaluation after it run), its folder under $WORK/NAME and its checkpoint in $WORK/ckpt-NAME. A
# setting starts only while at least $MIN_S seconds of $BUDGET_S are left, and (one at a time) as many as the longest
# setting that finished in this call took; it is given what is left. Each finished
# or stopped setting is packed into $OUT/NAME.tar.xz (its gsm8k_warmstart.json, log and eval_after/; the device
# returns at most 8 files); one line per setting on stdout (its exit code and its own seconds). Exit 0 when every
# setting finished. WARMSTART_CALL=SCRIPT runs SCRIPT in place of gsm8k_warmstart_call.sh (the tests' stand-in).
#
# PARALLEL=N runs up to N settings at once (each started while MIN_S of the budget is left, given what is left at
# its start; the lines come in the order the settings were given); GPU_MEM=F gives each setting's vLLM evaluations
# that gpu_memory_utilization (gsm8k_warmstart --gpu-mem; default 0.5, which fits one evaluation at a time).
# How many settings fit one GPU at once is measured, not assumed: the five at once ran out of memory on an H200
# (benchmarks/results/h200/logs/gsm8k_warmstart_settings_parallel5_b06bb1d.log), so the default is one at a time.
#
# DECLARED=FILE (issue 45): the settings declared in FILE (benchmarks/gsm8k_warmstart_declared.yaml), each with
# its arguments there (scored on the validation split); NAME arguments pick some of them (default: all), and a name
# FILE does not declare is refused. Each setting then evaluates the base model itself (set BEFORE to a validation
# evaluation of it, e.g. the first setting's eval_before/gsm8k_baseline.json, to reuse that one).
set -uo pipefail
OUT=${OUT:-.dev/gsm8k_warmstart_settings}
WORK=${WORK:-/tmp/vx/warmstart_settings}
if [ -n "${DECLARED:-}" ]; then
  BEFORE=${BEFORE:-}
  declared=$(python3 -m benchmarks.gsm8k_warmstart_publish declared --file "$DECLARED") || exit 2
  picked=()
  for name in "$@"; do
    line=$(printf '%s\n' "$declared" | grep -E "^${name//./\\.}=" | head -1)
    if [ -z "$line" ]; then
      echo "gsm8k_warmstart_settings: setting '$name' is not declared in $DECLARED" >&2
      exit 2
    fi
    picked+=("$line")
  done
  if [ "$#" -eq 0 ]; then mapfile -t picked <<< "$declared"; fi
  set -- "${picked[@]}"
fi
BEFORE=${BEFORE-benchmarks/results/h200/gsm8k_warmstart/eval_before/gsm8k_baseline.json}
BUDGET_S=${BUDGET_S:-540}
MIN_S=${MIN_S:-240}
if [ "$#" -eq 0 ]; then
  echo "gsm8k_warmstart_settings: no setting given: pass NAME=ARGUMENTS, e.g. \"lr2e-4=--lr 2e-4\"" >&2
  exit 2
fi
for setting in "$@"; do
  name=${setting%%=*}
  if [ "$name" = "$setting" ] || ! [[ "$name" =~ ^[A-Za-z0-9._-]+$ ]]; then
    echo "gsm8k_warmstart_settings: bad setting '$setting': expected NAME=ARGUMENTS," \
      "NAME of letters, digits, '.', '_', '-'" >&2
    exit 2
  fi
done
PARALLEL=${PARALLEL:-1}
if ! [[ "$PARALLEL" =~ ^[1-9][0-9]*$ ]]; then
  echo "gsm8k_warmstart_settings: PARALLEL=$PARALLEL: expected a positive whole number of settings at once" >&2
  exit 2
fi
mkdir -p "$OUT" "$WORK"
start=$SECONDS

run_setting() {  # NAME ARGUMENTS LEFT: one setting, packed; its line into $WORK/NAME.line, its exit code into .code
  local name=$1 arguments=$2 left=$3 code log summary last began=$SECONDS
  rm -rf "${WORK:?}/$name" "${WORK:?}/ckpt-$name"
  mkdir -p "$WORK/$name"
  # shellcheck disable=SC2086 # the setting's arguments are words
  OUT="$WORK/$name" CKPT="$WORK/ckpt-$name" WARMSTART_S=$left \
    bash "${WARMSTART_CALL:-benchmarks/gpu/gsm8k_warmstart_call.sh}" ${BEFORE:+--before-from "$BEFORE"} ${GPU_MEM:+--gpu-mem "$GPU_MEM"} \
    $arguments > /dev/null 2>&1
  code=$?
  tar -C "$WORK" -cJf "$OUT/$name.tar.xz" "$name"
  log="$WORK/$name/gsm8k_warmstart.log"
  summary=$(grep -E '^after SFT +\| all ' "$log" | tail -1)
  last=$([ "$code" -eq 0 ] || tail -1 "$log")
  echo "$name: exit $code, $((SECONDS - began)) s${summary:+; $summary}${last:+; $last}" > "$WORK/$name.line"
  echo "$code" > "$WORK/$name.code"
  echo "$((SECONDS - began))" > "$WORK/$name.seconds"
}

status=0
names=()
longest=0  # the longest a finished setting (exit 0) took in this call: one at a time, a setting needs that much too
for setting in "$@"; do
  name=${setting%%=*}
  names+=("$name")
  rm -f "$WORK/$name.line" "$WORK/$name.code" "$WORK/$name.seconds"
  while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do wait -n; done
  left=$((BUDGET_S - (SECONDS - start)))
  if [ "$left" -lt "$MIN_S" ] || [ "$left" -lt "$longest" ]; then
    why="a setting needs $MIN_S"
    if [ "$longest" -gt 0 ]; then why="$why, and one this call took $longest"; fi
    echo "$name: not started ($left s left, $why)" > "$WORK/$name.line"
    echo 1 > "$WORK/$name.code"
    continue
  fi
  if [ "$PARALLEL" -eq 1 ]; then
    run_setting "$name" "${setting#*=}" "$left"
    if [ "$(cat "$WORK/$name.code")" = 0 ] && [ "$(cat "$WORK/$name.seconds")" -gt "$longest" ]; then
      longest=$(cat "$WORK/$name.seconds")
    fi
  else
    run_setting "$name" "${setting#*=}" "$left" &
  fi
done
wait
for name in "${names[@]}"; do
  cat "$WORK/$name.line"
  [ "$(cat "$WORK/$name.code")" = 0 ] || status=1
done
exit $status
