#!/usr/bin/env bash
# a later call: torch profiles of steps 10-11 (GapCallback entry) for arms A, I, J at 1.56B, then the arm J GPU test there
set -u
t0=$(date +%s)
. .dev/vllm/t/env.sh
timeout 420 python3 -m benchmarks.arm_i_live run --model /tmp/vx/l156 --out /tmp/prof --steps 12 --memory 0.3 \
   --runs callback_A_ni2,callback_I_ni2,callback_J_ni2 --profile-steps 10-11 2>&1 | grep -v "^\s*$" | tail -30 | cut -c1-400
tar -cJf "$OUT/prof.tar.xz" -C /tmp prof
BLOGGAP_GPU_TEST_MODEL=/tmp/vx/l156 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -s \
   tests/core/test_onpolicy_gpu.py 2>&1 | tail -15 | tee "$OUT/onpolicy_gpu_l156.log"
echo "call total $(( $(date +%s) - t0 )) s"
