#!/usr/bin/env bash
# One background job that runs across device calls, so no call boundary stops a run.
#
# The device machine ends a command's processes when the call returns, except one in a new process session (setsid),
# which runs until the machine goes back (device README). A job longer than one 10-minute call (a GSM8K comparison
# wave, a set of interleaved cost runs) therefore runs as such a session for the machine's whole lease; every call
# after the first only waits on it and packs what it has written. Make each call within the machine's idle release
# (30 s) of the last one, or the machine goes back, and the job with it.
#
#   OUT=$OUT SESSION_S=<device seconds left, less 60> [PACK="PATH ..."] bash benchmarks/gpu/session.sh start COMMAND...
#   OUT=$OUT bash benchmarks/gpu/session.sh watch        # again while it exits 3
#
# start: runs COMMAND with BUDGET_S=$SESSION_S (the seconds it may take: it should end by then, writing what it has)
#   and OUT=$STATE/out (its outputs) in a new process session, its console in $STATE/job.log, then watches it like
#   `watch` (WAIT_S default 480 there: an install before it often shares the call). PACK: more paths (files or
#   folders, relative to the repository root or absolute) that each watch packs as they are then, e.g. a sweep's
#   runs/ or a cost_by_size --out folder; kept in $STATE for the later watches.
# watch: waits until the job ends or WAIT_S seconds pass (default 560), prints the console's last lines (PROGRESS: an
#   extended regular expression that picks them, default every line) and the GPU memory in use, and packs
#   $OUT/session.tgz: job.log, out/ and each PACK path (folders named trainer or final left out: policies and
#   checkpoints). Exit 0: the job ended (its exit status in $OUT/job_exit); 3: still running, call `watch` again;
#   1: it ended without an exit status (killed); 2: no job was started on this machine.
set -uo pipefail
STATE=${STATE:-/tmp/vx/session}
OUT=${OUT:-.dev/session_out}
mkdir -p "$OUT"

pack() {
  local items=(-C "$STATE" job.log) path
  [ -f "$STATE/exit" ] && items+=(exit)
  [ -d "$STATE/out" ] && items+=(out)
  if [ -f "$STATE/pack" ]; then
    while IFS= read -r path; do
      [ -e "$path" ] && items+=(-C "$(dirname "$path")" "$(basename "$path")")
    done < "$STATE/pack"
  fi
  tar czf "$OUT/session.tgz" --exclude=trainer --exclude=final "${items[@]}" 2> /dev/null
  [ -f "$STATE/exit" ] && cp "$STATE/exit" "$OUT/job_exit"
  grep -v "^\s*$" "$STATE/job.log" | grep -E "$(cat "$STATE/progress" 2> /dev/null || echo .)" | tail -n 12
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
  return 0
}

watch() {
  if [ ! -f "$STATE/pid" ]; then
    echo "session: no job was started on this machine ($STATE/pid is missing): the machine was given back since" \
      "'start'; call 'start' again" >&2
    return 2
  fi
  local pid waited=0 wait_s=${WAIT_S:-560}
  pid=$(cat "$STATE/pid")
  while kill -0 "$pid" 2> /dev/null && [ ! -f "$STATE/exit" ] && [ "$waited" -lt "$wait_s" ]; do
    sleep 5
    waited=$((waited + 5))
  done
  pack
  if [ -f "$STATE/exit" ]; then
    echo "session: the job ended, exit $(cat "$STATE/exit")"
    return 0
  fi
  if ! kill -0 "$pid" 2> /dev/null; then
    echo "session: the job (pid $pid) ended without recording its exit status (killed?)" >&2
    return 1
  fi
  echo "session: the job is still running after ${waited} s: call 'watch' again"
  return 3
}

case "${1:-}" in
  start)
    shift
    if [ -z "${SESSION_S:-}" ] || ! [ "$SESSION_S" -gt 0 ] 2> /dev/null; then
      echo "session start: set SESSION_S to the seconds the job may run (the device budget left, less a minute for" \
        "the last 'watch')" >&2
      exit 2
    fi
    if [ "$#" = 0 ]; then
      echo "session start: name the command to run, e.g. bash benchmarks/gpu/gsm8k_compare_call.sh" >&2
      exit 2
    fi
    if [ -f "$STATE/pid" ] && kill -0 "$(cat "$STATE/pid")" 2> /dev/null; then
      echo "session start: a job is already running (pid $(cat "$STATE/pid")): call 'watch'" >&2
      exit 2
    fi
    rm -rf "$STATE" && mkdir -p "$STATE/out"
    for path in ${PACK:-}; do
      case "$path" in /*) echo "$path" ;; *) echo "$PWD/$path" ;; esac
    done > "$STATE/pack"
    [ -n "${PROGRESS:-}" ] && echo "$PROGRESS" > "$STATE/progress"
    # The job's exit status goes to $STATE/exit when it ends, so `watch` can tell an end from a kill.
    setsid bash -c 'state=$1 budget=$2; shift 2; BUDGET_S=$budget OUT="$state/out" "$@"; echo $? > "$state/exit"' \
      job "$STATE" "$SESSION_S" "$@" > "$STATE/job.log" 2>&1 < /dev/null &
    echo $! > "$STATE/pid"
    echo "session: started the job (pid $!, budget $SESSION_S s): $*"
    WAIT_S=${WAIT_S:-480}
    watch
    exit $?
    ;;
  watch)
    watch
    exit $?
    ;;
  *)
    echo "usage: bash benchmarks/gpu/session.sh start COMMAND [ARG...] | watch (SESSION_S for start; see the header)" >&2
    exit 2
    ;;
esac
