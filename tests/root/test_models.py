"""bloggap_plugin.models: tiny models, spec errors, the real default model's tokenizer and flags."""

from __future__ import annotations

import pytest
import torch

from bloggap_plugin.models import TINY_MODELS, ModelSpecError, load_model, resolve_dtype

ARCHITECTURES = {
    "tiny-random-llama": "LlamaForCausalLM",
    "tiny-random-qwen2": "Qwen2ForCausalLM",
    "tiny-random-gpt_neox": "GPTNeoXForCausalLM",
    "tiny-random-qwen2_moe": "Qwen2MoeForCausalLM",
    "tiny-random-gemma3": "Gemma3ForCausalLM",
}


@pytest.mark.parametrize("spec", TINY_MODELS)
def test_tiny_models_load_and_run(spec):
    model, tokenizer = load_model(spec, dtype="bf16")
    assert type(model).__name__ == ARCHITECTURES[spec]
    assert next(model.parameters()).dtype == torch.bfloat16
    assert not model.training
    assert tokenizer.padding_side == "left"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.chat_template
    ids = tokenizer(["hi there", "x"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**ids).logits
    assert logits.shape == (2, ids["input_ids"].shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_tiny_models_are_seeded_and_tied_only_for_qwen2_and_gemma3():
    first, _ = load_model("tiny-random-llama")
    second, _ = load_model("tiny-random-llama")
    for (name, a), b in zip(first.named_parameters(), second.parameters()):
        assert torch.equal(a, b), name
    qwen, _ = load_model("tiny-random-qwen2")
    assert qwen.lm_head.weight is qwen.model.embed_tokens.weight
    assert first.lm_head.weight is not first.model.embed_tokens.weight
    gemma, _ = load_model("tiny-random-gemma3")
    assert gemma.lm_head.weight is gemma.model.embed_tokens.weight and gemma.config.model_type == "gemma3_text"


def _assert_lists_accepted(err: ModelSpecError):
    text = str(err)
    assert "accepted" in text
    assert "smollm2" in text
    for spec in TINY_MODELS:
        assert spec in text


def test_unknown_spec_lists_accepted():
    with pytest.raises(ModelSpecError) as info:
        load_model("no-such-model-anywhere")
    assert "no-such-model-anywhere" in str(info.value)
    _assert_lists_accepted(info.value)


def test_unknown_tiny_model_lists_accepted():
    with pytest.raises(ModelSpecError) as info:
        load_model("tiny-random-mamba")
    assert "tiny-random-mamba" in str(info.value)
    _assert_lists_accepted(info.value)


def test_missing_gguf_lists_accepted(tmp_path):
    missing = tmp_path / "absent.gguf"
    with pytest.raises(ModelSpecError) as info:
        load_model(str(missing))
    assert str(missing) in str(info.value) and "does not exist" in str(info.value)
    _assert_lists_accepted(info.value)


def test_folder_without_config_lists_accepted(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelSpecError) as info:
        load_model(str(tmp_path))
    assert "config.json" in str(info.value)
    _assert_lists_accepted(info.value)


def test_model_spec_error_is_a_value_error():
    assert issubclass(ModelSpecError, ValueError)


def test_resolve_dtype():
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("fp16") is torch.float16
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="bf16, fp16, fp32"):
        resolve_dtype("int8")


def test_smollm2_tokenizer_and_flags(smollm2_bf16):
    model, tokenizer = smollm2_bf16
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.eos_token_id == im_end and tokenizer.pad_token_id == im_end
    assert model.config.eos_token_id == im_end and model.generation_config.eos_token_id == im_end
    assert model.generation_config.pad_token_id == im_end
    assert tokenizer.padding_side == "left"
    # tied embeddings: the head is the embedding tensor itself
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # no quantizer flag, so Trainer will fine-tune it
    assert getattr(model, "hf_quantizer", None) is None
    assert not getattr(model, "is_quantized", False)
    assert getattr(model.config, "quantization_config", None) is None
    # the architecture cpu_stack.md describes
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert model.config.vocab_size == 49152
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert next(model.parameters()).dtype == torch.bfloat16
    # the chat template ends the assistant turn with <|im_end|>
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_end|>" in text
