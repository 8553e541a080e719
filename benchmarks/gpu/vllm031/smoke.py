"""GPU smoke test of the vLLM 0.31 bundle (after install.sh and env.sh): versions; a bf16 matmul (cuBLAS 13.1.0 of the
image under torch 2.13) against fp32; a cuDNN convolution and cuDNN SDPA (cuDNN 9.19 of the image under torch 2.13,
compiled against 9.20), reported and not fatal; then vLLM generates from SmolLM2 (/tmp/vx31/smollm2, written by
mk_smollm2.py) with top_p 0.9, which JIT-compiles vLLM's Triton sampler kernel with triton 3.7.1.
Usage: python3 smoke.py [MODEL_DIR]"""

import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def _sdpa_cudnn() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    ref = F.scaled_dot_product_attention(q.float(), q.float(), q.float(), is_causal=True)
    assert (out.float() - ref).abs().max().item() < 5e-2


model = sys.argv[1] if len(sys.argv) > 1 else "/tmp/vx31/smollm2"
print("torch", torch.__version__, "CUDA", torch.version.cuda, "| GPU", torch.cuda.get_device_name(0))
print(subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                     text=True).stdout.strip(), "driver")
g = torch.Generator(device="cuda").manual_seed(0)
a = torch.randn(2048, 2048, device="cuda", generator=g)
b = torch.randn(2048, 2048, device="cuda", generator=g)
err = ((a.bfloat16() @ b.bfloat16()).float() - a @ b).abs().max().item() / (a @ b).abs().max().item()
print(f"matmul bf16 vs fp32: max error {err:.2e} of the largest entry")
assert err < 2e-2, err
for name, fn in [
    ("cudnn conv2d", lambda: F.conv2d(torch.randn(2, 8, 32, 32, device="cuda"), torch.randn(16, 8, 3, 3, device="cuda"))),
    ("cudnn sdpa", lambda: _sdpa_cudnn()),
]:
    try:
        fn()
        torch.cuda.synchronize()
        print(name, "ok; cudnn", torch.backends.cudnn.version())
    except Exception as exc:  # reported: the fix is WITH=cudnn in the bundle
        print(name, "FAILED:", str(exc).splitlines()[0][:300])


from vllm import LLM, SamplingParams  # noqa: E402

t = time.time()
llm = LLM(model, dtype="bfloat16", gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=512, seed=0)
print(f"engine start {time.time() - t:.1f} s")
params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, logprobs=0, seed=0)
out = llm.generate(["The capital of France is"] * 2, params)
o = out[0].outputs[0]
print("text:", repr(o.text))
print("log-probs:", [round(d[tok].logprob, 4) for tok, d in zip(o.token_ids, o.logprobs)])
assert len(o.token_ids) > 0
print("SMOKE31 ok")
