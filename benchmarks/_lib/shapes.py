"""Model shapes for timing and memory benchmarks: random-init causal LMs of real sizes, built on the device.

Random init is valid for timing and memory only: its logit scale makes out-of-band rates meaningless.
"""

from __future__ import annotations

import torch

# Real-size shapes (random init; timing only). Values from the public configs of these models.
SHAPES = {
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                   tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=32768)),
    "qwen2.5-3b": ("qwen2", dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                 num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                                 tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=32768)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=32768)),
    "llama-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                               tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=8192)),
    # Llama and Qwen2 shapes with SmolLM2's vocabulary and tokenizer (49152 tokens), for runs through bloggap train;
    # the name gives the parameter count (qwen2-1.39b is Qwen2.5-1.5B's widths with the smaller vocabulary)
    "llama-0.48b-v49k": ("llama", dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
                                       num_attention_heads=24, num_key_value_heads=8, vocab_size=49152,
                                       tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=8192)),
    "llama-1.56b-v49k": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                                       num_attention_heads=32, num_key_value_heads=8, vocab_size=49152,
                                       tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=8192)),
    "qwen2-1.39b-v49k": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                      num_attention_heads=12, num_key_value_heads=2, vocab_size=49152,
                                      tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=8192)),
    "llama-3b-v49k": ("llama", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                    num_attention_heads=24, num_key_value_heads=8, vocab_size=49152,
                                    tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=8192)),
    # CPU quick mode
    "tiny-llama": ("llama", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=10,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                                 tie_word_embeddings=False, max_position_embeddings=512)),
    "tiny-qwen2-tied": ("qwen2", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=10,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                                      tie_word_embeddings=True, max_position_embeddings=512)),
}  # fmt: skip


def build_shape(
    name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0, layers: int | None = None
):
    """A random-init causal LM of shape ``name`` built directly on ``device`` in ``dtype`` (eval mode);
    ``layers`` overrides its number of decoder layers (same widths and vocabulary)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    kind, kwargs = SHAPES[name]
    if layers is not None:
        kwargs = kwargs | {"num_hidden_layers": layers}
    config = (Qwen2Config if kind == "qwen2" else LlamaConfig)(**kwargs)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def load_policy(name: str, device: torch.device, layers: int | None = None):
    """(model, random_init) for a shape name (``layers``: see :func:`build_shape`) or ``smollm2`` (real weights)."""
    if name in SHAPES:
        return build_shape(name, device, layers=layers), True
    from bloggap_plugin.models import load_model

    return load_model(name, dtype="bf16", device=device)[0], False
