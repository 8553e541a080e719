#!/usr/bin/env bash
# Issue 45: the GSM8K comparison as one background job that runs across device calls, so no call boundary stops a run.
#
# The device machine ends a command's processes when the call returns, except one in a new process session (setsid),
# which runs until the machine goes back (device README). A 10-minute call cannot hold one wave of the plan (five
# runs of 200 steps at once, then five held-out evaluations), and a run stopped by a call's budget starts over, so
# the job below owns the machine's whole lease instead; every call after the first only waits on it and packs what
# it has written. Make each call within the machine's idle release (30 s) of the last one, or the machine goes back.
#
#   call after the bundle's install (carry .dev/vllm/t, .dev/gsm8k, and .dev/compare_gsm8k when earlier seeds exist):
#     . .dev/vllm/t/env.sh && python3 .dev/vllm/t/mk_smollm2.py && \
#       SESSION_S=<device seconds left, less 60> bash benchmarks/gpu/gsm8k_compare_session.sh start
#   every later call (carry .dev/vllm/t):
#     . .dev/vllm/t/env.sh && bash benchmarks/gpu/gsm8k_compare_session.sh watch
#
# start: launches $CALL (gsm8k_compare_call.sh: the warm start of $SELECTION's setting when $CKPT holds none, its
#   test-split scoring, then bloggap compare) with BUDGET_S=$SESSION_S in a new session, writing under $STATE, then
#   watches it like `watch` (WAIT_S default 480 there: the install before it shares the call). The job's own
#   budget makes the sweep start no run that would not end before the lease does, and stop what runs at its end,
#   writing the sweep's outputs from the finished runs.
# watch: waits until the job ends or WAIT_S seconds pass (default 560), prints the job's last progress lines, and
#   packs $OUT/session.tgz: the job's log, its outputs (warmstart/, test_*/, compare_gsm8k.tgz once it ends) and the
#   sweep's runs/ so far (logs, held-out results, no policies). Exit 0: the job ended (its exit status in
#   $OUT/job_exit); 3: still running, call `watch` again; 2: no job was started on this machine.
set -uo pipefail
STATE=${STATE:-/tmp/vx/gsm8k_session}
SWEEP=${SWEEP:-.dev/compare_gsm8k}
WAIT_S=${WAIT_S:-}
OUT=${OUT:-.dev/gsm8k_compare_session}
mkdir -p "$OUT"

pack() {
  local items=(-C "$STATE" job.log)
  [ -f "$STATE/exit" ] && items+=(exit)
  [ -d "$STATE/out" ] && items+=(out)
  local sweep_items=()
  [ -d "$SWEEP/runs" ] && sweep_items=(-C "$(dirname "$SWEEP")" "$(basename "$SWEEP")/runs")
  tar czf "$OUT/session.tgz" --exclude=trainer --exclude=final "${items[@]}" "${sweep_items[@]}"
  [ -f "$STATE/exit" ] && cp "$STATE/exit" "$OUT/job_exit"
  grep -v "^\s*$" "$STATE/job.log" | grep -E "^\[compare\]|gsm8k_compare_call|T15-baseline|^all " | tail -n 12
  # GPU memory in use now (the held-out batch size's headroom shows here)
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
  return 0
}

watch() {
  if [ ! -f "$STATE/pid" ]; then
    echo "gsm8k_compare_session: no job was started on this machine ($STATE/pid is missing): the machine was" \
      "given back since 'start'; call 'start' again" >&2
    return 2
  fi
  local pid waited=0 wait_s=${WAIT_S:-560}
  pid=$(cat "$STATE/pid")
  while kill -0 "$pid" 2>/dev/null && [ ! -f "$STATE/exit" ] && [ "$waited" -lt "$wait_s" ]; do
    sleep 5
    waited=$((waited + 5))
  done
  pack
  if [ -f "$STATE/exit" ]; then
    echo "gsm8k_compare_session: the job ended, exit $(cat "$STATE/exit")"
    return 0
  fi
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "gsm8k_compare_session: the job (pid $pid) ended without recording its exit status (killed?)" >&2
    return 1
  fi
  echo "gsm8k_compare_session: the job is still running after ${waited} s: call 'watch' again"
  return 3
}

case "${1:-}" in
  start)
    if [ -z "${SESSION_S:-}" ] || ! [ "$SESSION_S" -gt 0 ] 2>/dev/null; then
      echo "gsm8k_compare_session start: set SESSION_S to the seconds the job may run (the device budget left, less" \
        "a minute for the last 'watch')" >&2
      exit 2
    fi
    if [ -f "$STATE/pid" ] && kill -0 "$(cat "$STATE/pid")" 2>/dev/null; then
      echo "gsm8k_compare_session start: a job is already running (pid $(cat "$STATE/pid")): call 'watch'" >&2
      exit 2
    fi
    rm -rf "$STATE" && mkdir -p "$STATE/out"
    WAIT_S=${WAIT_S:-480}
    # The job's exit status goes to $STATE/exit when it ends, so `watch` can tell an end from a kill.
    setsid bash -c 'BUDGET_S="$1" OUT="$2/out" SWEEP="$3" bash "$4"; echo $? > "$2/exit"' job "$SESSION_S" \
      "$STATE" "$SWEEP" "${CALL:-benchmarks/gpu/gsm8k_compare_call.sh}" > "$STATE/job.log" 2>&1 < /dev/null &
    echo $! > "$STATE/pid"
    echo "gsm8k_compare_session: started the job (pid $!, budget $SESSION_S s), writing $STATE/job.log"
    watch
    exit $?
    ;;
  watch)
    watch
    exit $?
    ;;
  *)
    echo "usage: bash benchmarks/gpu/gsm8k_compare_session.sh start|watch (SESSION_S for start; see the header)" >&2
    exit 2
    ;;
esac
