# Sourced by the last call of the vLLM 0.26 bundle (../shared/device/vllm.sh; its last chunk, .dev/vllm/p<nparts>,
# carried with .dev/vllm/t): moves that chunk beside the others in /tmp/vx, installs the bundle into /tmp/site and
# sets its environment (.dev/vllm/t/env.sh). Exits the calling script with 3 where the install fails.
mkdir -p /tmp/vx && mv ".dev/vllm/p$(cat .dev/vllm/t/nparts)"/part_* /tmp/vx/ && bash .dev/vllm/t/install.sh 2>&1 | grep -v "^WARNING" || exit 3
. .dev/vllm/t/env.sh
