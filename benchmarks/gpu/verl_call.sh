#!/usr/bin/env bash
# One device call of issue 13 on the GPU machine (nvidia-h200), from the project root, after the chunk calls of
# vllm.sh (VLLM_VERSION=0.24.0 + verl_requirements.txt, DEST=.dev/vllm24). Installs the bundle if this machine has
# not yet (the last chunk call), writes SmolLM2 as a HF folder, checks the imports (verl_live.py probe), writes the
# parquet files and the entry point, then runs verl_live.py run. Whatever ends the call, the runs' logs, metrics and
# verl_live_runs.json come back in $OUT (verl_runs.tgz + verl_live_runs.json + verl_probe.json).
#
#   bash benchmarks/gpu/verl_call.sh RUNS STEPS BUDGET_S [RUN_TIMEOUT_S]
#   e.g. bash benchmarks/gpu/verl_call.sh geo_rs/control,geo_rs/nofix,geo_rs/fix 20 500 200
#   VERL_LIVE_PARALLEL=5 bash benchmarks/gpu/verl_call.sh geo_rs/nofix,geo_rs/fix,seq_mis/control,... 12 560 480
# VERL_LIVE_PARALLEL=N runs N at once on the one GPU (verl_live.py run --parallel). A run list with arm_E also
# checks its dumped old log-probs against an independent fp32-head scoring on this GPU (check-head), and every call
# records `bloggap patch verl --check` against the verl installed here (verl_patch_check.txt).
set -uo pipefail
runs=${1:?runs}; steps=${2:?steps}; budget=${3:?budget seconds}; run_timeout=${4:-280}
T=${BLOGGAP_VLLM_DEST:-.dev/vllm24}/t
OUT=${OUT:?set by the device tool}
work=/tmp/vl
t0=$(date +%s)
collect() {
  mkdir -p "$OUT"
  # the guard's warning as each Ray worker wrote it (its own log files), to tell a warning never written from one
  # the driver's console did not receive (2026-12-01: arm_B's step 8 had all_rejected = 1 and no warning line)
  grep -H "bloggap: rollout correction preset" /tmp/ray*/session_*/logs/worker-* 2>/dev/null | cut -c1-600 \
    > "$work/ray_worker_guard_lines.txt"
  [ -d "$work" ] && tar -czf "$OUT/verl_runs.tgz" -C "$work" --exclude=./data --exclude=./site --exclude=./ckpt . 2>/dev/null
  cp "$work/verl_live_runs.json" "$work/verl_probe.json" "$work/verl_patch_check.txt" "$OUT/" 2>/dev/null
  echo "verl_call: $(( $(date +%s) - t0 )) s in this call"
}
trap collect EXIT
mkdir -p "$work"
if [ ! -d /tmp/site/vllm ]; then
  last=$(ls -d "${T%/t}"/p* 2>/dev/null | sort -V | tail -1)
  [ -n "$last" ] && mkdir -p /tmp/vx && mv "$last"/part_* /tmp/vx/ 2>/dev/null
  bash "$T/install.sh" || exit 3
fi
# wheels carried beside the bundle (a bundle built before verl_requirements.txt gained them): .dev/extra/*.whl
extra=${BLOGGAP_VERL_EXTRA:-.dev/extra}
if ls "$extra"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$extra"/*.whl 2>&1 | grep -v "already exists" | tail -3
fi
# verl 0.9.1's FSDP engine imports AutoModelForCausalLMWithValueHead from trl.experimental.ppo or trl whenever TRL
# is importable (verl/models/transformers/monkey_patch.py, apply_monkey_patch); TRL 1.16 has neither, so the actor's
# init_model failed with ImportError (2026-11-30; those runs hid TRL). The plugin now skips that step when TRL lacks
# the class; BLOGGAP_HIDE_TRL=1 hides the bundle's TRL from the verl runs as the recorded runs did.
if [ "${BLOGGAP_HIDE_TRL:-0}" = 1 ] && [ -d /tmp/site/trl ]; then mv /tmp/site/trl /tmp/trl_hidden_from_verl; fi
# shellcheck disable=SC1091
. "$T/env.sh"
export RAY_AUTH_MODE=disabled
[ -f /tmp/vx/smollm2/config.json ] || python3 "$T/mk_smollm2.py" || exit 4
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))"
python3 -m benchmarks.verl_live probe --out "$work" || exit 5
[ -f "$work/data/train.parquet" ] || python3 -m benchmarks.verl_live prepare --out "$work" || exit 6
python3 -c "import verl, sys; print('verl', verl.__version__, verl.__file__)" > "$work/verl_patch_check.txt" 2>&1
python3 -m bloggap_plugin.cli patch verl --check >> "$work/verl_patch_check.txt" 2>&1
echo "rc=$?" >> "$work/verl_patch_check.txt"
left=$(( budget - ($(date +%s) - t0) ))
python3 -m benchmarks.verl_live run --model /tmp/vx/smollm2 --out "$work" --runs "$runs" --steps "$steps" \
  --budget "$left" --run-timeout "$run_timeout" --parallel "${VERL_LIVE_PARALLEL:-1}"
rc=$?
case ",$runs," in
  *,arm_E,*) python3 -m benchmarks.verl_live check-head --out "$work" --model /tmp/vx/smollm2 --run arm_E --device cuda ;;
esac
for f in "$work"/*.log; do echo "== tail $f"; grep -v "^\s*$" "$f" | tail -25; done
exit $rc
