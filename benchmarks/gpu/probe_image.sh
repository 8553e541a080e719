#!/usr/bin/env bash
# probe_image.sh: one device call (seconds) before the vLLM 0.31 bundle's calls. Prints what the GPU image has that
# the bundle plan (benchmarks/gpu/vllm031_plan.txt) cares about: the torch/triton/nvidia/CUDA Python packages with
# versions and locations, the packages built against torch (they see torch 2.13 once /tmp/site31 comes first),
# the CUDA libraries the dynamic loader knows, the driver, free disk, and for each plan entry whether the image
# already has that exact version (then the bundle can leave it out: the SKIP= line at the end).
# Usage on the device, from the project root: bash benchmarks/gpu/probe_image.sh
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
echo "== python: $(command -v python3) $(python3 -V 2>&1)"
echo "== driver / GPU"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
nvidia-smi 2>/dev/null | grep -m1 "CUDA Version"
echo "== disk"
df -h /tmp / 2>&1
echo "== env"
env | grep -E "^(LD_LIBRARY_PATH|CUDA_HOME|CUDA_PATH|PYTHONPATH|LD_PRELOAD|TRITON_|PYTORCH_)" || echo "(none of LD_LIBRARY_PATH CUDA_HOME PYTHONPATH LD_PRELOAD TRITON_* PYTORCH_* set)"
echo "== ldconfig -p (cuda, cublas, cudnn, nccl)"
ldconfig -p 2>/dev/null | grep -E "cuda|cublas|cudnn|nccl" || echo "(none)"
ls -d /usr/local/cuda* 2>/dev/null
echo "== Python packages"
python3 - "$here/vllm031_plan.txt" <<'EOF'
import importlib.metadata as md
import re
import sys

dists = {}
for d in md.distributions():
    name = (d.metadata["Name"] or "").lower().replace("_", "-")
    if name and name not in dists:  # the first on sys.path wins, as for import
        dists[name] = d
pat = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-|cuda-|flashinfer|xformers|flash-attn|vllm|transformers|"
                 r"tokenizers|numpy|numba|huggingface-hub|accelerate|trl|pydantic|fastapi|openai)")
for name in sorted(dists):
    if pat.match(name):
        d = dists[name]
        print(f"  {name}=={d.version}  {d.locate_file('')}")
print("== packages that require torch (compiled ones among them must match the torch that is imported)")
for name in sorted(dists):
    reqs = dists[name].requires or []
    if name != "torch" and any(re.match(r"torch\b(?![-_])", r) for r in reqs):
        print(f"  {name}=={dists[name].version}")
print("== the bundle plan against the image")
skip = []
for line in open(sys.argv[1]):
    if not line.strip() or line.startswith("#"):
        continue
    key, spec, default = line.split()[:3]
    name, ver = spec.split("==")
    have = dists.get(name.lower().replace("_", "-"))
    have_ver = have.version.split("+")[0] if have else None
    verdict = "image has it: leave out" if have_ver == ver else "carry" if default == "yes" else "not carried (WITH= adds it)"
    print(f"  {key:20s} plan {ver:14s} image {have.version if have else '-':16s} {verdict}")
    if have_ver == ver and default == "yes":
        skip.append(key)
print(f'SKIP="{" ".join(skip)}"   # for vllm031_bundle.sh')
EOF
echo "== image torch"
python3 -c "import torch; print(torch.__version__, torch.__file__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'nccl', torch.cuda.nccl.version(), 'gpu', torch.cuda.is_available())" 2>&1 | tail -1
