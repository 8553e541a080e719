"""TRL 1.16 GRPO with vLLM 0.31 in colocate mode, one process, no launcher (TRL sets RANK/WORLD_SIZE/LOCAL_RANK/
MASTER_ADDR/MASTER_PORT itself). Adapted from the vLLM 0.26 bundle's script. Usage: python3 trl_colocate.py
[MODEL_DIR] [STEPS]"""

import sys
import time

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

model = sys.argv[1] if len(sys.argv) > 1 else "/tmp/vx31/smollm2"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
ds = Dataset.from_dict({"prompt": [f"What is {a} + {a + 2}? Reply with just the number." for a in range(3, 19)]})


def reward_len(completions: list, **kw: object) -> list[float]:
    """Reward in [-inf, 0]: minus the distance of the completion's length from 20 characters, over 20."""
    return [-abs(len(c) - 20) / 20.0 for c in completions]


args = GRPOConfig(output_dir="/tmp/vx31/grpo", use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
                  per_device_train_batch_size=8, num_generations=8, max_completion_length=32, max_steps=steps,
                  learning_rate=1e-6, logging_steps=1, report_to="none", save_strategy="no", bf16=True, seed=0)
t = time.time()
trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=ds)
trainer.train()
keep = ("step", "loss", "grad_norm", "rewards/reward_len/mean", "completions/mean_length", "train_runtime")
for row in trainer.state.log_history:
    print({k: v for k, v in row.items() if k in keep})
print(f"GRPO colocate OK, {steps} steps, {time.time() - t:.1f}s")
