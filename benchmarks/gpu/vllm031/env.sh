# Source on the GPU machine after install.sh. /tmp/site31 goes first on sys.path, so torch 2.13.0, triton 3.7.1,
# NCCL 2.29.7 and vLLM 0.31.0 come from there and every other CUDA library from the image (torch's
# _preload_cuda_deps searches sys.path in order). FlashInfer is not carried: without VLLM_USE_FLASHINFER_SAMPLER=0 the
# engine fails at start-up. torch 2.13 is compiled against cuDNN 9.20 and the image has 9.19: unless the bundle
# carried cuDNN (WITH=cudnn), torch.backends.cudnn.version() raises without PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1.
export PYTHONPATH=/tmp/site31${PYTHONPATH:+:$PYTHONPATH} VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
[ -d /tmp/site31/nvidia/cudnn/lib ] || export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
