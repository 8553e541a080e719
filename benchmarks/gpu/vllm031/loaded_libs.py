"""Import torch, triton and vLLM as env.sh sets them up; print their versions and where every CUDA library that the
process loaded comes from (/tmp/site31 = carried, anything else = the image). Exits 1 if torch or vLLM is not the
bundle's version."""

import re
import sys

import torch

print("torch", torch.__version__, "from", torch.__file__, "| CUDA", torch.version.cuda)
print("cuDNN compiled", torch._C._cudnn.getCompileVersion(), "runtime", torch._C._cudnn.getRuntimeVersion(),
      "| NCCL", torch.cuda.nccl.version())
maps = open("/proc/self/maps").read()
libs = sorted({line.split()[-1] for line in maps.splitlines()
               if re.search(r"/lib(cuda|cudart|cublas|cublasLt|cudnn\w*|nccl|cusparse\w*|nvrtc|nvJitLink|nvshmem\w*)\.so", line)})
for path in libs:
    print("  loaded", path)
import triton  # noqa: E402

print("triton", triton.__version__, "from", triton.__file__)
import vllm  # noqa: E402

print("vllm", vllm.__version__, "from", vllm.__file__)
if not torch.__version__.startswith("2.13.0") or vllm.__version__ != "0.31.0":
    sys.exit(f"expected torch 2.13.0 and vLLM 0.31.0, got {torch.__version__} and {vllm.__version__}: is /tmp/site31 "
             "first on PYTHONPATH (. benchmarks/gpu/vllm031/env.sh)?")
