"""Arm I (vLLM's numbers): the plain-torch pieces of its forward, the plan's wiring, and its refusals (CPU)."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from bloggap_plugin.core.plans import make_plan
from bloggap_plugin.core.plans.vllm_shadow import VllmFormPlan
from bloggap_plugin.core.scoring import token_logprobs
from bloggap_plugin.core.vllm.form import (
    TORCH_KERNELS,
    Kernels,
    VllmForm,
    norm_in_step_launches,
    pack,
    paged_kv,
    parse_form,
    rms_norm_hf,
    rms_norm_vllm_triton,
    rope_hf,
    rope_vllm,
    sampler_token_logprobs,
    step_launches,
    torch_paged_attention,
    torch_paged_varlen_attention,
    torch_varlen_attention,
    vllm_cos_sin_cache,
)
from bloggap_plugin.core.vllm.kernels import VllmFormUnavailable, load_kernels
from bloggap_plugin.core.vllm.versions import form_layout
from bloggap_plugin.recipes import GapConfig, RecipeError

K = 8


def _rows(batch: int = 4, width: int = 20, seed: int = 0):
    """TRL's layout: rows 0 and 1 left-padded (prompts of different lengths), row 3 right-padded (early EOS)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 90, (batch, width), generator=gen)
    mask = torch.ones(batch, width, dtype=torch.long)
    mask[0, :5] = 0
    if batch > 1:
        mask[1, :2] = 0
    if batch > 3:
        mask[3, -2:] = 0
    return ids, mask


@pytest.mark.parametrize("spec", ["tiny-random-llama", "tiny-random-qwen2"])
def test_hf_form_is_the_bf16_models_forward(tiny_model, spec):
    """Preset ``hf`` (packed tokens, HF's maths) is the bf16 shadow's own HF forward: bit-identical for one unpadded
    row (same ops on the same shapes), within bf16 noise for padded rows (HF's masked attention path)."""
    model, _ = tiny_model(spec)
    ids, mask = _rows()
    plan = make_plan(model, "vllm", pieces="hf")
    shadow = plan.shadow
    shadow.config._attn_implementation = "sdpa"
    one = token_logprobs(shadow, ids[2:3], mask[2:3], K, positions="mask")
    assert torch.equal(plan.token_logprobs(ids[2:3], mask[2:3], K, positions="mask"), one)
    real = mask[:, -K:].bool()
    full = token_logprobs(shadow, ids, mask, K, positions="mask")
    diff = (plan.token_logprobs(ids, mask, K, positions="mask") - full)[real].abs()
    assert diff.max() < 0.01
    assert plan.stats()["pieces"] == VllmForm(**dataclasses.asdict(parse_form("hf"))).describe()


def test_norm_and_rope_pieces_bitwise_hf(tiny_model):
    """The ``hf`` norm and RoPE are HF's modules' maths, and vLLM's cos/sin cache holds HF's cos/sin values (same
    inverse frequencies, exact products) on CPU."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model, _ = tiny_model("tiny-random-llama")
    shadow = make_plan(model, "vllm", pieces="hf").shadow
    gen = torch.Generator().manual_seed(1)
    hidden = (torch.randn(20, 32, generator=gen) * 3).to(torch.bfloat16)
    norm = shadow.model.norm
    assert torch.equal(rms_norm_hf(hidden, norm.weight, norm.variance_epsilon), norm(hidden))
    x = torch.randn(20, 4, 8, generator=gen).to(torch.bfloat16)
    positions = torch.arange(20)
    cos, sin = shadow.model.rotary_emb(x, positions[None])
    expected, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    assert torch.equal(rope_hf(x, positions, shadow.model.rotary_emb.inv_freq), expected[0].transpose(0, 1))
    cache = vllm_cos_sin_cache(8, shadow.config.rope_parameters["rope_theta"], 512, torch.bfloat16, torch.device("cpu"))
    assert torch.equal(cache[:20, :4], cos[0, :, :4]) and torch.equal(cache[:20, 4:], sin[0, :, :4])


def test_vllm_forms_round_once():
    """vLLM's batch-invariant RMSNorm and its RoPE kernel compute in fp32 and round once: within half a bf16 ulp
    (2^-8 relative) of the float64 value; HF's forms round two or three times and do not stay within it."""
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(256, 64, generator=gen) * 4).to(torch.bfloat16)
    weight = (1 + 0.3 * torch.randn(64, generator=gen)).to(torch.bfloat16)
    x64 = x.double()
    exact = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    half_ulp = 2.0 ** -8 * exact.abs() * (1 + 1e-5)
    assert ((rms_norm_vllm_triton(x, weight, 1e-6).double() - exact).abs() <= half_ulp).all()
    assert ((rms_norm_hf(x, weight, 1e-6).double() - exact).abs() > half_ulp).any()
    q = torch.randn(64, 4, 16, generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, 500, (64,), generator=gen)
    cache = vllm_cos_sin_cache(16, 10000.0, 512, torch.bfloat16, torch.device("cpu"))
    cos, sin = (c.double()[:, None, :] for c in cache[positions].chunk(2, dim=-1))
    x1, x2 = q.double().chunk(2, dim=-1)
    exact = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    half_ulp = 2.0 ** -8 * exact.abs() * (1 + 1e-5) + 1e-30
    assert ((rope_vllm(q, positions, cache).double() - exact).abs() <= half_ulp).all()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
    assert ((rope_hf(q, positions, inv_freq).double() - exact).abs() > half_ulp).any()


def test_pack_and_paged_kv_layout():
    """Packing keeps each row's real tokens in order with positions 0..n-1; the paged KV cache read back through
    its block table is the packed K/V, so paged attention equals contiguous attention bit for bit."""
    ids, mask = _rows()
    packed = pack(ids, mask)
    assert packed.lengths == [15, 18, 20, 18]
    assert packed.cu_seqlens.tolist() == [0, 15, 33, 53, 71]
    assert torch.equal(packed.tokens[:15], ids[0, 5:]) and torch.equal(packed.positions[:15], torch.arange(15))
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(71, 4, 8, generator=gen)
    k = torch.randn(71, 2, 8, generator=gen)
    v = torch.randn(71, 2, 8, generator=gen)
    contiguous = torch_varlen_attention(q, k, v, packed.cu_seqlens, 8 ** -0.5)
    for page in (1, 3, 16):
        key_cache, value_cache, table = paged_kv(k, v, packed.lengths, page)
        assert key_cache.shape == (sum((n + page - 1) // page for n in packed.lengths), page, 2, 8)
        assert table.dtype == torch.int32 and table.shape[0] == 4
        paged = torch_paged_attention(q, key_cache, value_cache, table, packed.cu_seqlens, 8 ** -0.5)
        assert torch.equal(paged, contiguous)
    with pytest.raises(ValueError, match="contiguous run"):
        pack(ids, torch.tensor([[1, 0, 1] + [1] * 17] * 4))
    with pytest.raises(ValueError, match="no real token"):
        pack(ids[:1], torch.zeros(1, 20, dtype=torch.long))


def _counting(kernels: Kernels, calls: dict) -> Kernels:
    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapped

    fields = ("linear", "rms_norm", "add_rms_norm", "rotary", "silu_and_mul", "flash", "flash_paged", "scope")
    return dataclasses.replace(kernels, **{name: count(name, getattr(kernels, name)) for name in fields})


def test_kernel_pieces_call_their_kernels_and_match_the_torch_form(tiny_model):
    """With plain-torch stand-ins for vLLM's kernels, ``all`` computes exactly the ``torch`` preset (minus the
    batch-invariant layer-0 norm), and each kernel piece calls its kernel: layer 0's first norm once, the fused
    add-norms 2 x layers, RoPE twice and attention, SiLU once per layer, the scope once per scoring call (norms in
    one launch each: ``norm_launch=packed``, attention in one call per layer: ``attention_launch=packed``; the
    defaults ``steps`` are tested below)."""
    model, _ = tiny_model("tiny-random-llama")
    ids, mask = _rows()
    calls: dict = {}
    form = parse_form("all,batch_invariant=false,norm_launch=packed,attention_launch=packed,logprobs=log_softmax")
    plan = VllmFormPlan(model, form, _counting(TORCH_KERNELS, calls))
    out = plan.token_logprobs(ids, mask, K, positions="mask")
    layers = model.config.num_hidden_layers
    assert calls == {"rms_norm": 1, "add_rms_norm": 2 * layers, "rotary": 2 * layers, "flash": layers,
                     "silu_and_mul": layers}
    expected = make_plan(model, "vllm", pieces="torch").token_logprobs(ids, mask, K, positions="mask")
    assert torch.equal(out, expected)
    calls.clear()
    bi = VllmFormPlan(model, dataclasses.replace(form, batch_invariant=True), _counting(TORCH_KERNELS, calls))
    assert torch.equal(bi.token_logprobs(ids, mask, K, positions="mask"), out)  # F.linear stand-in: same numbers
    assert calls["scope"] == 1 and calls["linear"] == 4 * layers + 1  # qkv, o, gate_up, down per layer; head once


def test_norm_in_step_launches_sizes_each_launch_like_vllms_steps():
    """Prompt tokens in one launch of at least ``large`` rows (zero rows appended), generated tokens in launches of
    fewer; a row-wise norm gives each token exactly what one launch over all of them gives."""
    x = torch.randn(11, 6)
    weight = torch.randn(6)
    generated = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1], dtype=torch.bool)  # two rows: 3 + 4 and 2 + 2
    sizes = []

    def norm(rows, w, eps):
        sizes.append(rows.shape[0])
        return rms_norm_hf(rows, w, eps)

    launches = step_launches(generated, large=4)
    assert launches[0].tolist() == [0, 1, 2, 7, 8] and [c.tolist() for c in launches[1]] == [[3, 4, 5], [6, 9, 10]]
    out = norm_in_step_launches(norm, x, weight, 1e-6, launches, large=4)
    assert sizes == [5, 3, 3]  # prompt: 5 rows (>= 4, nothing appended); generated: launches of fewer than 4
    assert torch.equal(out, rms_norm_hf(x, weight, 1e-6))
    sizes.clear()
    norm_in_step_launches(norm, x[:3], weight, 1e-6, step_launches(generated[:3], large=4), large=4)
    assert sizes == [4]  # 3 prompt rows padded to a large launch


def test_norm_launch_steps_makes_a_launch_size_dependent_norm_batch_invariant(tiny_model):
    """A stand-in norm kernel that, like vLLM's CUDA RMSNorm, computes differently in launches of >= 256 tokens:
    ``norm_launch: packed`` then scores a row differently alone (< 256 tokens) than with three others (> 256);
    ``steps`` scores it the same in both, and each launch holds prompt tokens only (>= 256) or generated only (< 256)."""
    model, _ = tiny_model("tiny-random-llama")
    ids, mask = _rows(batch=4, width=100)
    launches = []

    def size_dependent(x, weight, eps):
        launches.append(x.shape[0])
        out = rms_norm_hf(x, weight, eps)
        return out * 1.25 if x.shape[0] >= 256 else out

    kernels = dataclasses.replace(TORCH_KERNELS, rms_norm=size_dependent, add_rms_norm=size_dependent)
    scores = {}
    for launch in ("packed", "steps"):
        plan = VllmFormPlan(model, parse_form(f"all,batch_invariant=false,norm_launch={launch}"), kernels)
        together = plan.token_logprobs(ids, mask, K, positions="mask")
        alone = torch.cat([plan.token_logprobs(ids[i:i + 1], mask[i:i + 1], K, positions="mask") for i in range(4)])
        scores[launch] = (together, alone)
    assert not torch.equal(*scores["packed"])
    assert torch.equal(*scores["steps"])
    generated_tokens = int(mask[:, -K:].sum())
    launches.clear()
    plan.token_logprobs(ids, mask, K, positions="mask")
    per_forward = 2 * model.config.num_hidden_layers + 1  # every norm: layer 0's first one too (not batch-invariant)
    assert len(launches) == 2 * per_forward and set(launches) == {256 if int(mask.sum()) - generated_tokens < 256
                                                                   else int(mask.sum()) - generated_tokens,
                                                                   generated_tokens}


def test_plan_keeps_the_policy_and_sync_refreshes_fused_weights(tiny_model):
    """Scoring never changes the policy; after the policy's weights move, ``sync`` refreshes the shadow and the
    fused q/k/v and gate/up weights (scores equal a fresh plan's); bytes: bf16 shadow + fused copies + cache."""
    model, _ = tiny_model("tiny-random-llama")
    model = type(model)(model.config)  # a private copy: this test changes weights
    ids, mask = _rows()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = make_plan(model, "vllm", pieces="torch")
    old = plan.token_logprobs(ids, mask, K, positions="mask")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)
    plan.sync(model)
    new = plan.token_logprobs(ids, mask, K, positions="mask")
    assert not torch.equal(new, old)
    assert torch.equal(new, make_plan(model, "vllm", pieces="torch").token_logprobs(ids, mask, K, positions="mask"))
    n_params = sum(p.numel() for p in model.parameters())
    layer = model.model.layers[0]
    fused = sum(m.weight.numel() for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                                           layer.mlp.gate_proj, layer.mlp.up_proj)) * len(model.model.layers)
    rope = model.config.max_position_embeddings * model.config.head_dim
    buffers = {b.data_ptr(): b for b in model.buffers()}.values()
    assert all(b.dtype == torch.float32 for b in buffers)  # RoPE frequencies: the shadow keeps them in fp32
    assert plan.stats()["bytes_added"] == 2 * (n_params + fused + rope) + 4 * sum(b.numel() for b in buffers)


def test_refusals_name_the_problem_and_the_fix(tiny_model):
    model, _ = tiny_model("tiny-random-llama")
    with pytest.raises(VllmFormUnavailable, match=r"batch_invariant=true, attention=vllm_fa, norm=kernel, "
                       r"rope=kernel, act=kernel, logprobs=v2_sampler call vLLM's CUDA kernels, but the plan runs on cpu: .*"
                       r"gap\.i_pieces: torch"):
        make_plan(model, "vllm")
    with pytest.raises(VllmFormUnavailable, match=r"pieces attention=vllm_fa call"):
        load_kernels(parse_form("torch,attention=vllm_fa"), "cpu")
    assert load_kernels(parse_form("torch"), "cpu") is TORCH_KERNELS
    with pytest.raises(ValueError, match="start with a preset, one of all, torch, hf"):
        parse_form("attention=sdpa")
    with pytest.raises(ValueError, match=r"piece norm='fast': use one of hf, torch, kernel"):
        parse_form("torch,norm=fast")
    with pytest.raises(ValueError, match="fused_proj takes true or false"):
        parse_form("torch,fused_proj=1")
    with pytest.raises(ValueError, match="pieces= and over_parameters= are arm I's plan options; arm 'fp32' has none"):
        make_plan(model, "fp32", pieces="torch")
    with pytest.raises(ValueError, match="over_parameters= are arm I's plan options; arm 'fp16'"):
        make_plan(model, "fp16", over_parameters=True)
    neox, _ = tiny_model("tiny-random-gpt_neox")
    with pytest.raises(ValueError, match=r"model_type 'gpt_neox' \(supported: llama, qwen2\)"):
        make_plan(neox, "vllm", pieces="torch")
    with pytest.raises(RecipeError, match="gap.i_pieces only applies to arm I; arm is B"):
        GapConfig(arm="B", i_pieces="torch")
    with pytest.raises(RecipeError, match="gap.i_pieces: arm I pieces 'bogus'"):
        GapConfig(arm="vllm", i_pieces="bogus")
    with pytest.raises(RecipeError, match="arm I scores with vLLM's positions .*set gap.positions: mask"):
        GapConfig(arm="I", positions="arange")
    assert GapConfig(arm="I", i_pieces="torch,rope=hf").plan_arm == "vllm"


def test_trl_arm_i_trains_on_its_plan_and_refuses_kernel_pieces_on_cpu(tmp_path, trains):
    """GRPO in TRL with arm I: the old log-probs come from the arm's plan (vLLM's maths in torch on CPU) and two
    a step trains with a finite loss; the default pieces (vLLM's kernels) refuse at attach, before any step."""
    import math
    import warnings

    from _support.trl_runs import logs_of, make

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make(tmp_path / "torch", GapConfig(arm="I", i_pieces="torch", probe_rows=4), dtype="bf16",
                       max_steps=1)
        assert isinstance(trainer._gap_session.state.resources.plan, VllmFormPlan)
        assert trainer._gap_session.state.resources.plan.stats()["pieces"] == parse_form("torch").describe()
        trainer.train()
    logs = logs_of(trainer)
    assert len(logs) == 1 and math.isfinite(logs[0]["loss"])
    assert 0.0 <= logs[0]["gap/ratio/oob_frac"] <= 1.0 and logs[0]["gap/time/scoring_s"] > 0
    with pytest.raises(VllmFormUnavailable, match="the plan runs on cpu"):
        make(tmp_path / "all", GapConfig(arm="I"), dtype="bf16")


def _fake_vllm_batch_invariant(monkeypatch, active: bool, version: str = "0.26.0"):
    """A stand-in for vLLM ``version``'s batch-invariant module, where that release keeps it (0.26:
    ``vllm.model_executor.layers.batch_invariant``, 0.31: ``vllm.model_executor.determinism.batch_invariant``; vLLM
    is not installed on CPU). Returns the module."""
    import types

    from _support.fake_vllm import install_fake_vllm_modules

    from bloggap_plugin.core.vllm.versions import form_layout

    module = types.ModuleType(form_layout(version).batch_invariant)
    module._batch_invariant_MODE = active
    module._log_softmax_batch_invariant = lambda input, dim, half_to_float: input
    module.softmax_batch_invariant = lambda input, dim, dtype=None: input
    module.mean_batch_invariant = lambda input, dim, keepdim=False, dtype=None: input
    module.bmm_batch_invariant = lambda a, b, *, out=None: a
    install_fake_vllm_modules(monkeypatch, version, module)
    return module


BI_OPS = ("aten::_log_softmax", "aten::softmax", "aten::_softmax", "aten::mean.dim", "aten::bmm")


def _cuda_kernels() -> dict:
    return {op: [line for line in torch._C._dispatch_dump(op).splitlines() if line.startswith("CUDA")]
            for op in BI_OPS}


def _cuda_settings() -> tuple:
    matmul = torch.backends.cuda.matmul
    return (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction,
            torch.backends.cuda.preferred_blas_library())


@pytest.mark.parametrize("version", ["0.26.0", "0.31.0"])
def test_batch_invariant_scope_registers_vllms_overrides_for_the_block_only(monkeypatch, version):
    """Inside the scope vLLM's five aten overrides are the CUDA kernels and cuBLAS runs without reduced-precision
    reductions on cuBLASLt; after it (also after an error) the previous kernels and settings are back. Where vLLM's
    engine already enabled its mode process-wide, the scope registers nothing."""
    from bloggap_plugin.core.vllm.kernels import batch_invariant_scope, vllm_batch_invariant_active

    _fake_vllm_batch_invariant(monkeypatch, active=False, version=version)
    blas = {"backend": torch.backends.cuda.preferred_blas_library()}  # a CPU build refuses to select cuBLASLt

    def preferred_blas_library(backend=None):
        if backend is not None:
            blas["backend"] = backend
        return blas["backend"]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred_blas_library)
    before_kernels, before_settings = _cuda_kernels(), _cuda_settings()
    assert not vllm_batch_invariant_active()
    with pytest.raises(RuntimeError, match="inside"):
        with batch_invariant_scope():
            inside = _cuda_kernels()
            assert all(len(inside[op]) == 1 and "registered at" in inside[op][0] and inside[op] != before_kernels[op]
                       for op in BI_OPS)
            fp16_reduced, bf16_reduced, backend = _cuda_settings()
            assert fp16_reduced in (False, (False, False)) and bf16_reduced in (False, (False, False))
            assert backend == "cublaslt"
            raise RuntimeError("inside")
    assert _cuda_kernels() == before_kernels and _cuda_settings() == before_settings
    _fake_vllm_batch_invariant(monkeypatch, active=True, version=version)
    assert vllm_batch_invariant_active()
    with batch_invariant_scope():
        assert _cuda_kernels() == before_kernels and _cuda_settings() == before_settings


def _fake_vllm_kernels(monkeypatch, seen: dict, version: str = "0.26.0"):
    """vLLM ``version``'s kernel entry points (0.26.0 or 0.31.0) as plain-torch fakes with that release's signatures
    (read from its wheel) and in-place semantics, at its module paths, so the glue in
    :mod:`bloggap_plugin.core.vllm.kernels` (module paths, argument order, keywords, reshapes) runs on CPU."""
    import sys
    import types

    import torch.nn.functional as F
    from _support.fake_vllm import install_fake_vllm_modules

    bi = _fake_vllm_batch_invariant(monkeypatch, active=False, version=version)
    v031 = version.startswith("0.31")
    bi.linear_batch_invariant = lambda input, weight, bias=None: F.linear(input, weight, bias)
    bi.rms_norm_batch_invariant = lambda input, weight, eps=1e-6, residual=None: rms_norm_vllm_triton(input, weight, eps)
    ops = types.ModuleType("vllm._custom_ops")
    ops.rms_norm = lambda out, input, weight, epsilon: out.copy_(rms_norm_hf(input, weight, epsilon))

    def fused_add_rms_norm(input, residual, weight, epsilon):
        summed = (input.float() + residual.float()).to(input.dtype)
        residual.copy_(summed)
        input.copy_(rms_norm_hf(summed, weight, epsilon))

    def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0, inverse=False):
        assert is_neox and key is None and rope_dim_offset == 0 and not inverse
        view = query.view(query.shape[0], -1, head_size)
        view.copy_(rope_vllm(view, positions, cos_sin_cache))

    ops.fused_add_rms_norm, ops.rotary_embedding = fused_add_rms_norm, rotary_embedding
    fa_utils = types.ModuleType("vllm.v1.attention.backends.fa_utils")
    if v031:  # 0.31 adds keywords after has_sinks
        fa_utils.get_flash_attn_version = (lambda requires_alibi=False, head_size=None, head_size_v=None,
                                           has_sinks=False, requires_softcap=False, kv_cache_block_size=None,
                                           supports_fa4_hd256=False: 3)
    else:
        fa_utils.get_flash_attn_version = (lambda requires_alibi=False, head_size=None, head_size_v=None,
                                           has_sinks=False: 3)
    flash = types.ModuleType("vllm.vllm_flash_attn")

    def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                               q_v=None, dropout_p=0.0, softmax_scale=None, causal=False, window_size=None,
                               softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                               block_table=None, return_softmax_lse=False, out=None, scheduler_metadata=None,
                               q_descale=None, k_descale=None, v_descale=None, num_splits=0, output_scale=None,
                               fa_version=2, s_aux=None, cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None,
                               mask_mod=None, *rest, **more):
        # 0.26 ends (..., mask_mod, aux_tensors, dynamic_causal); 0.31 (..., mask_mod, block_sparse_tensors,
        # aux_tensors, aux_tensor_leading_dims, dynamic_causal): the plugin passes none of these, and keywords only
        tail = ({"block_sparse_tensors", "aux_tensors", "aux_tensor_leading_dims", "dynamic_causal"} if v031
                else {"aux_tensors", "dynamic_causal"})
        assert not rest and set(more) <= tail and all(value is None for value in more.values())
        assert causal and cu_seqlens_q.dtype == torch.int32
        seen.setdefault("flash", []).append({"num_splits": num_splits, "fa_version": fa_version,
                                             "paged": block_table is not None})
        if block_table is None:
            assert torch.equal(cu_seqlens_k, cu_seqlens_q)
            return torch_varlen_attention(q, k, v, cu_seqlens_q, softmax_scale)
        assert seqused_k.dtype == torch.int32 and block_table.dtype == torch.int32
        assert block_table.shape[0] == seqused_k.shape[0] == cu_seqlens_q.shape[0] - 1
        return torch_paged_varlen_attention(q, k, v, cu_seqlens_q, seqused_k, block_table, softmax_scale)

    flash.flash_attn_varlen_func = flash_attn_varlen_func
    logprob = types.ModuleType("vllm.v1.worker.gpu.sample.logprob")

    def compute_token_logprobs(logits, token_ids):
        assert logits.dtype in (torch.bfloat16, torch.float32) and token_ids.dim() == 2 and token_ids.shape[1] == 1
        seen.setdefault("token_logprobs", []).append(tuple(logits.shape))
        seen.setdefault("logits_dtype", []).append(logits.dtype)
        # vLLM's Triton kernel reads row i's logits at ``i * logits.stride(0)`` and its token id at ``i * topk``
        # (0.26) or ``i * token_ids.stride(0)`` (0.31) from the tensors' storage: read them the same way
        dense_logits = torch.as_strided(logits, logits.shape, (logits.stride(0), 1))
        id_stride = token_ids.stride(0) if v031 else token_ids.shape[1]
        dense_ids = torch.as_strided(token_ids, token_ids.shape, (id_stride, 1))
        return sampler_token_logprobs(dense_logits, dense_ids[:, 0]).unsqueeze(-1)

    logprob.compute_token_logprobs = compute_token_logprobs
    install_fake_vllm_modules(monkeypatch, f"{version}+fake", bi, ops, fa_utils, flash, logprob)
    assert sys.modules["vllm"]._custom_ops is ops
    library = torch.library.Library("_C", "FRAGMENT")  # vLLM's SiluAndMul calls torch.ops._C.silu_and_mul
    library.define("silu_and_mul(Tensor(a!) out, Tensor input) -> ()")
    def silu_and_mul(out, x):
        half = x.shape[-1] // 2
        out.copy_(F.silu(x[..., :half]) * x[..., half:])

    library.impl("silu_and_mul", silu_and_mul, "CPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", lambda backend=None: "cublaslt")
    return library


@pytest.mark.parametrize("version", ["0.26.0", "0.31.0"])
def test_vllm_kernel_glue_with_fakes_of_vllms_signatures(monkeypatch, tiny_model, version):
    """``load_kernels`` on "cuda" with fakes of vLLM's entry points (signatures and module paths copied from each
    release's wheel; 0.31 moved the batch-invariant module): preset ``all`` computes exactly vLLM's maths in torch
    with batch invariance (the fakes' maths), FA gets num_splits=1, vLLM's FA version and the paged cache, and the
    kernels record vLLM's version."""
    seen: dict = {}
    library = _fake_vllm_kernels(monkeypatch, seen, version)
    try:
        model, _ = tiny_model("tiny-random-llama")
        ids, mask = _rows()
        kernels = load_kernels(parse_form("all"), "cuda")
        assert kernels.source == f"vllm {version}+fake"
        assert kernels.linear is sys.modules[form_layout(version).batch_invariant].linear_batch_invariant
        out = VllmFormPlan(model, parse_form("all"), kernels).token_logprobs(ids, mask, K, positions="mask")
        expected = VllmFormPlan(model, parse_form("torch,batch_invariant=true,attention=vllm_fa,attention_launch=steps,"
                                                  "logprobs=v2_sampler"), TORCH_KERNELS)
        assert torch.equal(out, expected.token_logprobs(ids, mask, K, positions="mask"))
        assert seen.pop("token_logprobs") == [(ids.shape[0] * K, model.config.vocab_size)]
        layers = model.config.num_hidden_layers
        assert seen["flash"] == [{"num_splits": 1, "fa_version": 3, "paged": True}] * 2 * layers  # prefill, decode
        seen["flash"].clear()
        # tiles of 7 positions and a last tile of one: that tile's targets are a strided view of the row's targets
        tiled = VllmFormPlan(model, parse_form("all"), kernels).token_logprobs(ids, mask, K, positions="mask",
                                                                              chunk_tokens=7 * ids.shape[0])
        assert seen.pop("token_logprobs") == [(ids.shape[0] * 7, model.config.vocab_size),
                                              (ids.shape[0], model.config.vocab_size)]
        assert torch.equal(tiled, out)
        assert set(seen.pop("logits_dtype")) == {torch.bfloat16}
        # logprobs=v2_sampler_fp32 (vLLM 0.31's sampler when sampling processes the logits): the kernel reads the
        # fp32 temperature-scaled logits unrounded; at temperature 1 those are the bf16 values
        fp32_form = parse_form("all,logprobs=v2_sampler_fp32")
        fp32_plan = VllmFormPlan(model, fp32_form, load_kernels(fp32_form, "cuda"))
        assert torch.equal(fp32_plan.token_logprobs(ids, mask, K, positions="mask"), out)
        assert set(seen.pop("logits_dtype")) == {torch.float32}
        reference = VllmFormPlan(model, parse_form("torch,batch_invariant=true,attention=vllm_fa,attention_launch=steps,"
                                                   "logprobs=v2_sampler_fp32"), TORCH_KERNELS)
        hot = fp32_plan.token_logprobs(ids, mask, K, positions="mask", temperature=0.7)
        assert torch.equal(hot, reference.token_logprobs(ids, mask, K, positions="mask", temperature=0.7))
        rounded = VllmFormPlan(model, parse_form("all"), kernels).token_logprobs(ids, mask, K, positions="mask",
                                                                                temperature=0.7)
        assert not torch.equal(hot, rounded)  # 0.26's piece rounds the scaled logits to bf16 first
        seen["flash"].clear()
        packed_form = parse_form("all,batch_invariant=false,page_size=0,attention_launch=packed,logprobs=log_softmax")
        plan = VllmFormPlan(model, packed_form, load_kernels(packed_form, "cuda"))
        assert torch.equal(plan.token_logprobs(ids, mask, K, positions="mask"),
                           make_plan(model, "vllm", pieces="torch").token_logprobs(ids, mask, K, positions="mask"))
        assert seen["flash"] == [{"num_splits": 0, "fa_version": 3, "paged": False}] * layers
    finally:
        library._destroy()


def test_a_vllm_release_whose_pieces_were_not_read_is_refused_and_left_alone(monkeypatch):
    """A vLLM whose release has no layout (here 0.28.1, with 0.26's modules in place): ``load_kernels`` refuses,
    naming the release and the ones read, and the plugin does not read its batch-invariant switch."""
    from bloggap_plugin.core.vllm.kernels import vllm_batch_invariant_active

    library = _fake_vllm_kernels(monkeypatch, {}, "0.26.0")
    try:
        sys.modules[form_layout("0.26.0").batch_invariant]._batch_invariant_MODE = True
        assert vllm_batch_invariant_active()
        sys.modules["vllm"].__version__ = "0.28.1"
        with pytest.raises(VllmFormUnavailable, match=r"but vLLM 0\.28\.1 is not a release whose pieces were read "
                                                      r"\(0\.26\.0, 0\.31\.0\)"):
            load_kernels(parse_form("all"), "cuda")
        assert not vllm_batch_invariant_active()
    finally:
        library._destroy()


def test_hf_attention_interface_attends_as_the_packed_form(tiny_model):
    """vLLM's FlashAttention registered with transformers (here with the plain-torch stand-in kernel): the bf16 HF
    model using it equals its own sdpa forward bit for bit on one unpadded row (same attention maths), and on padded
    rows computes what arm I's packed ``hf`` forward computes (observed identical; bounded here)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    from bloggap_plugin.core.vllm.kernels import register_hf_attention

    model, _ = tiny_model("tiny-random-llama")
    ids, mask = _rows()
    name = register_hf_attention(TORCH_KERNELS, page_size=3)
    assert ALL_MASK_ATTENTION_FUNCTIONS[name] is flash_attention_mask
    plan = make_plan(model, "vllm", pieces="hf")
    shadow = plan.shadow
    shadow.config._attn_implementation = "sdpa"
    one = token_logprobs(shadow, ids[2:3], mask[2:3], K, positions="mask")
    shadow.config._attn_implementation = name
    assert torch.equal(token_logprobs(shadow, ids[2:3], mask[2:3], K, positions="mask"), one)
    real = mask[:, -K:].bool()
    padded = token_logprobs(shadow, ids, mask, K, positions="mask")
    assert (padded - plan.token_logprobs(ids, mask, K, positions="mask"))[real].abs().max() < 1e-4
    q = torch.zeros(1, 4, 3, 8)
    with pytest.raises(ValueError, match="no dropout"):
        AttentionInterface()[name](shadow.model.layers[0].self_attn, q, q[:, :2], q[:, :2], None, dropout=0.1)


def test_paged_varlen_reference_equals_contiguous_causal_attention():
    """The paged varlen reference with whole rows as entries is causal attention per row; with each row's last token
    as an entry of its own (one query, all keys up to it) it is that row's last output."""
    from bloggap_plugin.core.vllm.form import torch_paged_varlen_attention

    gen = torch.Generator().manual_seed(3)
    lengths = [7, 19, 3]
    total, heads, kv_heads, dim = sum(lengths), 4, 2, 8
    q = torch.randn(total, heads, dim, generator=gen)
    k = torch.randn(total, kv_heads, dim, generator=gen)
    v = torch.randn(total, kv_heads, dim, generator=gen)
    cu = torch.tensor([0, 7, 26, 29], dtype=torch.int32)
    reference = torch_varlen_attention(q, k, v, cu, 0.3)
    key_cache, value_cache, table = paged_kv(k, v, lengths, 4)
    whole = torch_paged_varlen_attention(q, key_cache, value_cache, cu, torch.tensor(lengths), table, 0.3)
    assert torch.allclose(whole, reference, atol=1e-6)
    last = (cu[1:] - 1).long()
    single = torch_paged_varlen_attention(q[last], key_cache, value_cache, torch.arange(4, dtype=torch.int32),
                                          torch.tensor(lengths), table, 0.3)
    assert torch.allclose(single, reference[last], atol=1e-6)


def test_attention_launch_steps_calls_prefill_then_one_query_per_generated_token(tiny_model):
    """``attention_launch: steps``: per layer one prefill call over the prompt tokens (each row's keys = its prompt)
    and one decode-form call with an entry per generated token whose keys run up to and including it; the scores
    equal the packed call's within fp32 noise (same maths, another kernel order)."""
    model, _ = tiny_model("tiny-random-llama")
    model = model.float()
    ids, mask = _rows(batch=4, width=20)
    calls = []

    def spy(q, key_cache, value_cache, cu_q, seqused_k, table, max_q, max_k, scale):
        calls.append({"queries": int(q.shape[0]), "entries": int(cu_q.numel() - 1), "max_q": max_q,
                      "seqused_k": seqused_k.tolist()})
        return TORCH_KERNELS.flash_paged(q, key_cache, value_cache, cu_q, seqused_k, table, max_q, max_k, scale)

    kernels = dataclasses.replace(TORCH_KERNELS, flash_paged=spy)
    scores = {}
    for launch in ("packed", "steps"):
        plan = VllmFormPlan(model, parse_form(f"torch,attention=vllm_fa,attention_launch={launch}"), kernels)
        scores[launch] = plan.token_logprobs(ids, mask, K, positions="mask")
    real = mask[:, -K:].bool()
    assert (scores["steps"] - scores["packed"])[real].abs().max() < 1e-2  # bf16 shadow: one bf16 step at most
    layers = model.config.num_hidden_layers
    assert len(calls) == 2 * layers
    lengths = mask.sum(-1).tolist()
    generated = mask[:, -K:].sum(-1).tolist()  # the K completion columns were fed back one decode step at a time
    prompts = [n - g for n, g in zip(lengths, generated)]
    prefill, decode = calls[0], calls[1]
    assert prefill == {"queries": sum(prompts), "entries": 4, "max_q": max(prompts), "seqused_k": prompts}
    expected = [p + j + 1 for p, g in zip(prompts, generated) for j in range(g)]
    assert decode == {"queries": sum(generated), "entries": sum(generated), "max_q": 1, "seqused_k": expected}


def _v2_reference(logits_bf16: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """vLLM's model runner V2 log-prob of ``targets`` under bf16 logits, in float64: ``x - max - log(sum(exp(x - max)))``."""
    x = logits_bf16.double()
    top = x.max(-1, keepdim=True).values
    lse = torch.log(torch.exp(x - top).sum(-1, keepdim=True))
    return (x - top - lse).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def test_logprobs_piece_v2_sampler_scores_the_bf16_logits_as_vllms_model_runner_v2(tiny_model):
    """``logprobs=v2_sampler``: the sampled token's log-prob as vLLM 0.26's model runner V2 computes it. The kernel
    receives the head's bf16 logits ``[N, V]`` (temperature applied in fp32 and rounded back to bf16, as V2 applies
    it in place) and the targets ``[N]``; the plan returns its values in ``[B, K]``. The stand-in's values are within
    fp32 rounding of the float64 maths. A kept-set ``reduce`` (truncation) is used as given."""
    model, _ = tiny_model("tiny-random-llama")
    ids, mask = _rows()
    seen: list = []

    def recording(logits, tokens):
        seen.append((logits.clone(), tokens.clone()))
        return TORCH_KERNELS.token_logprobs(logits, tokens)

    kernels = dataclasses.replace(TORCH_KERNELS, token_logprobs=recording)
    plain = VllmFormPlan(model, parse_form("torch"), TORCH_KERNELS)
    assert parse_form("torch").logprobs == "log_softmax" and parse_form("all").logprobs == "v2_sampler"
    captured: list = []

    def capture(logits, targets, index):
        captured.append(logits.clone())
        return torch.zeros(targets.shape)

    for temperature in (1.0, 0.7):
        seen.clear()
        captured.clear()
        plan = VllmFormPlan(model, parse_form("torch,logprobs=v2_sampler"), kernels)
        out = plan.token_logprobs(ids, mask, K, positions="mask", temperature=temperature, chunk_tokens=0)
        plain.token_logprobs(ids, mask, K, positions="mask", temperature=1.0, chunk_tokens=0, reduce=capture)
        logits = captured[0]  # [B, K, V] fp32 values of the bf16 head's output
        assert torch.equal(logits, logits.to(torch.bfloat16).float())
        (received, tokens), = seen
        assert received.dtype == torch.bfloat16 and received.shape == (ids.shape[0] * K, logits.shape[-1])
        assert torch.equal(received, (logits / temperature).to(torch.bfloat16).reshape(-1, logits.shape[-1]))
        assert torch.equal(tokens, ids[:, -K:].reshape(-1))
        assert torch.equal(out, TORCH_KERNELS.token_logprobs(received, tokens).view(ids.shape[0], K))
        reference = _v2_reference(received, tokens).view(ids.shape[0], K)
        assert float((out.double() - reference).abs().max()) < 2e-6
    seen.clear()
    plan.token_logprobs(ids, mask, K, positions="mask", reduce=capture)
    assert seen == []  # a caller's reduce (a kept set) is not replaced


def test_logprobs_piece_is_named_in_refusals_and_needs_vllm():
    assert "logprobs=v2_sampler" in parse_form("all").needs_vllm()
    assert parse_form("torch").needs_vllm() == [] and parse_form("hf").logprobs == "log_softmax"
    with pytest.raises(ValueError, match=r"piece logprobs='fast': use one of log_softmax, v2_sampler"):
        parse_form("all,logprobs=fast")


def test_arm_i_scores_as_many_rows_per_forward_as_its_token_budget_holds(tiny_model):
    """Arm I's forward is batch-invariant, so the rows per forward set its cost (host launches per forward), not its
    numbers: the TRL adapter scores arm I's old log-probs in forwards of up to ``TOKENS_PER_FORWARD`` packed-width
    tokens whatever TRL's micro-batch, unless ``gap.score_rows`` bounds them; the probe's one-row forwards stay one
    row. Other plans keep the caller's rows."""
    import types

    from bloggap_plugin.core.plans import ScoringPlan
    from bloggap_plugin.core.plans.vllm_shadow import TOKENS_PER_FORWARD
    from bloggap_plugin.trl.scorer import Scorer

    model, _ = tiny_model("tiny-random-llama")
    ids, mask = _rows(batch=6)
    plan = VllmFormPlan(model, parse_form("torch"), TORCH_KERNELS)
    assert plan.rows_per_forward(ids.shape[1]) == TOKENS_PER_FORWARD // ids.shape[1]
    assert plan.rows_per_forward(TOKENS_PER_FORWARD * 3) == 1
    assert ScoringPlan.rows_per_forward(make_plan(model, "fp32"), ids.shape[1]) is None
    forwards: list[int] = []
    original = plan.model.forward

    def counting(input_ids, *args, **kwargs):
        forwards.append(input_ids.shape[0])
        return original(input_ids, *args, **kwargs)

    plan.model.forward = counting

    def trainer(score_rows: int):
        config = GapConfig(arm="I", positions="mask", i_pieces="torch", score_rows=score_rows)
        settings = types.SimpleNamespace(positions="mask", renormalize=False)
        state = types.SimpleNamespace(config=config, settings=settings)
        trainer = types.SimpleNamespace(accelerator=types.SimpleNamespace(device=torch.device("cpu")), temperature=1.0)
        return types.SimpleNamespace(state=state, trainer=trainer, reducer=None)

    whole = Scorer.plan_scores(trainer(0), plan, ids, mask, K, 2)
    assert forwards == [6]
    forwards.clear()
    bounded = Scorer.plan_scores(trainer(4), plan, ids, mask, K, 2)
    assert forwards == [2, 2, 2] and torch.equal(bounded, whole)
    forwards.clear()
    Scorer.plan_scores(trainer(0), plan, ids[:1], mask[:1], K, 1)
    assert forwards == [1]


def test_prompt_first_order_computes_what_the_packed_order_computes(tiny_model, monkeypatch):
    """``prompt_first`` (arm I's default with ``attention_launch: steps``) runs every piece on the tokens reordered as
    vLLM's steps saw them, so each step-sized launch is a contiguous slice. With a launch-size-dependent norm stand-in
    and the paged attention stand-in, its log-probs equal, bit for bit, those of the same forward in packed order
    (launches gathered and scattered by index); its launches hold the same tokens."""
    import bloggap_plugin.core.plans.vllm_shadow as vllm_plan
    from bloggap_plugin.core.vllm.form import prompt_first

    model, _ = tiny_model("tiny-random-llama")
    ids, mask = _rows(batch=6, width=120)
    sizes: list = []

    def size_dependent(x, weight, eps):
        sizes.append(x.shape[0])
        out = rms_norm_hf(x, weight, eps)
        return out * 1.25 if x.shape[0] >= 256 else out

    kernels = dataclasses.replace(TORCH_KERNELS, rms_norm=size_dependent, add_rms_norm=size_dependent)
    form = parse_form("all,batch_invariant=false,logprobs=log_softmax")
    reordered = VllmFormPlan(model, form, kernels).token_logprobs(ids, mask, 60, positions="mask")
    first_sizes = list(sizes)

    def packed_order(packed, large=256):
        packed.launches = step_launches(packed.generated, large)
        return packed

    monkeypatch.setattr(vllm_plan, "prompt_first", packed_order)
    sizes.clear()
    packed = VllmFormPlan(model, form, kernels).token_logprobs(ids, mask, 60, positions="mask")
    assert torch.equal(reordered, packed) and first_sizes == sizes
    batch = pack(ids, mask)
    generated = torch.zeros(mask.shape, dtype=torch.bool)
    generated[:, -59:] = True
    batch.generated = generated[batch.where]
    ordered = prompt_first(batch)
    prompt_count = int((~batch.generated).sum())
    assert torch.equal(ordered.order, torch.cat([(~batch.generated).nonzero()[:, 0], batch.generated.nonzero()[:, 0]]))
    assert torch.equal(ordered.tokens, batch.tokens[ordered.order])
    prompt, chunks = ordered.launches
    assert prompt == slice(0, prompt_count) and chunks[0].start == prompt_count and chunks[-1].stop == batch.tokens.numel()
    assert all(c.stop - c.start < 256 for c in chunks) and all(a.stop == b.start for a, b in zip(chunks, chunks[1:]))
