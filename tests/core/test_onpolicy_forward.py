"""The exactly on-policy training forward (arm I's form over the policy's own parameters) and the backward passes of
arm I's kernel pieces, on CPU with the plain-torch stand-ins for vLLM's kernels (``TORCH_KERNELS``).

Bounds, and why:

- a wrapped piece's gradient is torch's fp32 gradient of the same formula at the same (bf16) inputs, rounded to the
  input's dtype (bf16) when autograd hands it on: per element within half a bf16 ulp, ``2^-8`` relative (plus fp32
  noise where the reference is computed in another order: ``1e-6`` of the largest element);
- the whole forward's parameter gradients against the fp32 policy's own HF forward under torch autograd (the exact
  maths, without vLLM's bf16 roundings): within 2% relative (L2 over all parameters) and 4% per parameter tensor,
  a few bf16 unit roundoffs (``2^-8``) accumulated through the bf16 activations; and within 1% of torch's own
  autograd through the same bf16 forward (the stand-ins are plain torch, so torch can differentiate them directly:
  the two differ only in where the backward rounds).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from bloggap_plugin.core.plans.vllm_shadow import OnPolicyForward, VllmFormLM, VllmFormPlan, sampler_reduce
from bloggap_plugin.core.scoring import token_logprobs
from bloggap_plugin.core.vllm.autograd import PIECE_FORMULAS, autograd_kernels
from bloggap_plugin.core.vllm.form import (
    TORCH_KERNELS,
    Kernels,
    pack,
    parse_form,
    prompt_first,
    stepwise_attention,
    vllm_cos_sin_cache,
)

HALF_ULP = 2.0 ** -8
FORMS = ["all", "all,attention_launch=packed,norm_launch=packed,page_size=0", "all,attention_launch=packed",
         "torch", "hf"]


def _rows(batch: int = 6, width: int = 40, seed: int = 0):
    """TRL's layout: left-padded prompts of different lengths, right-padded completions (early EOS)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 90, (batch, width), generator=gen)
    mask = torch.ones(batch, width, dtype=torch.long)
    mask[0, :7] = 0
    mask[1, :3] = 0
    mask[3, -4:] = 0
    mask[4, :2] = 0
    mask[4, -9:] = 0
    return ids, mask


def _private(tiny_model, spec: str = "tiny-random-llama"):
    model, _ = tiny_model(spec)
    return type(model)(model.config)  # a private copy: these tests write gradients


@pytest.mark.parametrize("spec", FORMS)
@pytest.mark.parametrize("keep", [16, 1])
def test_training_forward_equals_arm_is_scorer_bit_for_bit(tiny_model, spec, keep):
    """Over the policy's fp32 parameters (cast to bf16 inside the graph, fused weights concatenated there) and with
    every kernel piece wrapped for autograd, the training forward's log-probs are the no-grad scorer's (arm I's plan
    on its bf16 shadow of the same weights) bit for bit, on a padded TRL batch, for any logits_to_keep; gradients
    reach every parameter in fp32."""
    model = _private(tiny_model)
    ids, mask = _rows()
    form = parse_form(spec)
    old = VllmFormPlan(model, form, TORCH_KERNELS).token_logprobs(ids, mask, keep, batch_size=4, positions="mask")
    new, _ = OnPolicyForward(model, form, TORCH_KERNELS).token_logprobs(ids, mask, keep, batch_size=4)
    assert new.requires_grad and torch.equal(new.detach(), old)
    (new * mask[:, -keep:]).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_training_forward_with_qkv_bias_and_tiles(tiny_model):
    """Qwen2 (q/k/v biases, fused bias concatenated in the graph) with the head in one-position tiles: still the
    scorer's bits; entropies come detached, from the same logits."""
    model = _private(tiny_model, "tiny-random-qwen2")
    ids, mask = _rows()
    form = parse_form("all")
    old = VllmFormPlan(model, form, TORCH_KERNELS).token_logprobs(ids, mask, 12, positions="mask", chunk_tokens=1)
    new, entropy = OnPolicyForward(model, form, TORCH_KERNELS).token_logprobs(ids, mask, 12, chunk_tokens=1,
                                                                              compute_entropy=True)
    assert torch.equal(new.detach(), old)
    assert entropy.shape == new.shape and not entropy.requires_grad and (entropy >= 0).all()
    new.sum().backward()
    assert model.model.layers[0].self_attn.q_proj.bias.grad is not None


def test_training_forward_changes_neither_policy_nor_shadow(tiny_model):
    """Forward and backward leave the policy's weights and the scorer's shadow (and its fused copies) as they were,
    bit for bit; the scorer still scores what it scored."""
    model = _private(tiny_model)
    ids, mask = _rows()
    form = parse_form("all")
    plan = VllmFormPlan(model, form, TORCH_KERNELS)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shadow = {k: v.clone() for k, v in plan.shadow.state_dict().items()}
    fused = [t.clone() for t in plan.model.fused_tensors()]
    old = plan.token_logprobs(ids, mask, 16, positions="mask")
    new, _ = OnPolicyForward(model, form, TORCH_KERNELS).token_logprobs(ids, mask, 16)
    new.sum().backward()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(shadow[k], v) for k, v in plan.shadow.state_dict().items())
    assert all(torch.equal(a, b) for a, b in zip(fused, plan.model.fused_tensors(), strict=True))
    assert torch.equal(plan.token_logprobs(ids, mask, 16, positions="mask"), old)


# ------------------------------------------------------------------------------------------ each piece's gradient
def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _check_piece(wrapped, kernel, reference, args: list, grad_args: list[int], seed: int = 0):
    """``wrapped(*args)`` returns the kernel's bits; its gradients for ``grad_args`` are within half a bf16 ulp of
    torch autograd of ``reference`` (independent fp32 maths) at the same values under the same upstream gradient."""
    bf = [_leaf(a) if i in grad_args else a for i, a in enumerate(args)]
    out = wrapped(*bf)
    assert torch.equal(out.detach(), kernel(*args))
    gen = torch.Generator().manual_seed(seed)
    upstream = torch.randn(out.shape, generator=gen).to(out.dtype)
    got = torch.autograd.grad(out, [bf[i] for i in grad_args], upstream)
    fp = [_leaf(a.float()) if i in grad_args else a for i, a in enumerate(args)]
    want = torch.autograd.grad(reference(*fp), [fp[i] for i in grad_args], upstream.float())
    for i, g, w in zip(grad_args, got, want, strict=True):
        assert g.dtype == args[i].dtype
        bound = HALF_ULP * w.abs() + 1e-6 * w.abs().max()
        assert ((g.float() - w).abs() <= bound).all(), (i, (g.float() - w).abs().max())


def _dense_causal(q, k, v, lengths, scale):
    """Attention over packed rows with a dense block-diagonal causal mask, in fp32 (no sdpa): ``[T, nq, d]``."""
    row = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    index = torch.arange(q.shape[0])
    visible = (row[:, None] == row[None, :]) & (index[None, :] <= index[:, None])
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hts,shd->thd", weights, v)


def test_each_wrapped_piece_has_torchs_fp32_gradient():
    kernels = autograd_kernels(TORCH_KERNELS)
    gen = torch.Generator().manual_seed(5)

    def bf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    x, weight, bias = bf(24, 16), bf(12, 16, scale=0.3), bf(12, scale=0.1)
    _check_piece(kernels.linear, TORCH_KERNELS.linear, lambda a, w, b: a @ w.T + b, [x, weight, bias], [0, 1, 2])
    norm_weight = (1 + 0.2 * torch.randn(16, generator=gen)).to(torch.bfloat16)
    exact_norm = lambda a, w, eps: a / torch.sqrt((a * a).mean(-1, keepdim=True) + eps) * w  # noqa: E731
    for name in ("rms_norm", "add_rms_norm"):
        _check_piece(getattr(kernels, name), getattr(TORCH_KERNELS, name), exact_norm, [x * 3, norm_weight, 1e-6],
                     [0, 1])
    cache = vllm_cos_sin_cache(8, 10000.0, 64, torch.bfloat16, torch.device("cpu"))
    positions = torch.randint(0, 64, (24,), generator=gen)

    def exact_rope(a, pos, table):
        cos, sin = (c.float().repeat(1, 2)[:, None, :] for c in table[pos].chunk(2, dim=-1))
        half = a.shape[-1] // 2
        return a * cos + torch.cat((-a[..., half:], a[..., :half]), dim=-1) * sin

    _check_piece(kernels.rotary, TORCH_KERNELS.rotary, exact_rope, [bf(24, 3, 8), positions, cache], [0])
    _check_piece(kernels.silu_and_mul, TORCH_KERNELS.silu_and_mul,
                 lambda a: a[:, :10] * torch.sigmoid(a[:, :10]) * a[:, 10:], [bf(24, 20)], [0])
    logits = bf(24, 50, scale=3)
    tokens = torch.randint(0, 50, (24,), generator=gen)
    _check_piece(kernels.token_logprobs, TORCH_KERNELS.token_logprobs,
                 lambda z, t: z.gather(-1, t[:, None])[:, 0] - torch.logsumexp(z, -1), [logits, tokens], [0])
    lengths = [5, 11, 8]
    cu = torch.tensor([0, 5, 16, 24], dtype=torch.int32)
    q, k, v = bf(24, 4, 8), bf(24, 2, 8), bf(24, 2, 8)
    _check_piece(kernels.flash, TORCH_KERNELS.flash,
                 lambda *a: _dense_causal(a[0], a[1], a[2], lengths, 0.35), [q, k, v, cu, 11, 0.35], [0, 1, 2])


@pytest.mark.parametrize("page", [16, 3])
def test_paged_attention_pieces_have_torchs_fp32_gradient(page):
    """The paged calls (``flash`` with a block table; ``flash_paged`` in vLLM's steps: a prefill call over the prompts,
    one query per generated token) differentiated through the paged cache's layout back to the packed K/V: torch's
    fp32 gradients of dense causal attention over the same rows. One call: within half a bf16 ulp. In steps, a key's
    gradient is the bf16 sum of the two calls' rounded gradients (autograd accumulates in the cache's dtype): within
    half an ulp of each call's part and of the sum."""
    from bloggap_plugin.core.vllm.form import paged_kv

    kernels = autograd_kernels(TORCH_KERNELS)
    gen = torch.Generator().manual_seed(6)
    ids = torch.zeros(3, 14, dtype=torch.long)
    mask = torch.ones(3, 14, dtype=torch.long)
    mask[0, :4] = 0
    mask[2, -3:] = 0
    packed = pack(ids, mask)
    generated = torch.zeros(mask.shape, dtype=torch.bool)
    generated[:, -6:] = True
    packed.generated = generated[packed.where]
    ordered = prompt_first(packed)
    total = packed.tokens.numel()
    q, k, v = ((torch.randn(total, h, 8, generator=gen)).to(torch.bfloat16) for h in (4, 2, 2))
    upstream = torch.randn(total, 4, 8, generator=gen).to(torch.bfloat16)

    def exact(up):
        fp = [_leaf(t.float()) for t in (q, k, v)]
        return torch.autograd.grad(_dense_causal(*fp, packed.lengths, 0.35), fp, up.float())

    want = exact(upstream)
    prompt_part = exact(upstream * ~packed.generated[:, None, None])
    decode_part = exact(upstream * packed.generated[:, None, None])

    def check(got, parts):
        for g, w, *split in zip(got, want, *parts, strict=True):
            assert g.dtype == torch.bfloat16
            scale = w.abs() + sum(part.abs() for part in split)
            excess = (g.float() - w).abs() - HALF_ULP * (1 + 1e-3) * scale - 1e-6 * w.abs().max()
            assert (excess <= 0).all(), excess.max()

    leaves = [_leaf(t) for t in (q, k, v)]
    key_cache, value_cache, table = paged_kv(leaves[1], leaves[2], packed.lengths, page)
    out = kernels.flash(leaves[0], key_cache, value_cache, packed.cu_seqlens, 14, 0.35, block_table=table)
    check(torch.autograd.grad(out, leaves, upstream), [])
    leaves = [_leaf(t[ordered.order]) for t in (q, k, v)]  # prompt_first: the steps' order
    out = stepwise_attention(*leaves, ordered, page, kernels.flash_paged, 0.35)
    back = torch.empty_like(ordered.order)
    back[ordered.order] = torch.arange(total)
    got = torch.autograd.grad(out, leaves, upstream[ordered.order])
    check([g[back] for g in got], [prompt_part, decode_part])


def _arm_j_paged_calls(page: int = 4, keep: int = 16, seed: int = 3):
    """arm J's two paged calls on :func:`_rows` (entries of different lengths, GQA 4:2 heads), built as its forward
    builds them (``prompt_first`` order, ``stepwise_calls``, ``paged_kv``): ``{"prefill" | "decode": (q, key_cache,
    value_cache, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k)}``, fp32 random q/k/v; ``"rows"``:
    the decode call by rows (``form.decode_by_rows``) as the forward passes it to a differentiable kernel."""
    from bloggap_plugin.core.vllm.form import paged_kv, stepwise_calls

    ids, mask = _rows()
    packed = pack(ids, mask)
    generated = torch.zeros(mask.shape, dtype=torch.bool)
    generated[:, -keep:] = True
    packed.generated = generated[packed.where]
    ordered = prompt_first(packed)
    total = int(ordered.cu_seqlens[-1])
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total, 4, 8, generator=gen)
    k, v = torch.randn(total, 2, 8, generator=gen), torch.randn(total, 2, 8, generator=gen)
    key_cache, value_cache, _ = paged_kv(k, v, ordered.lengths, page)
    calls = {}
    for name, (index, *arguments) in zip(("prefill", "decode"), stepwise_calls(ordered, page)):
        calls[name] = (q[index], key_cache, value_cache, *arguments)
    calls["rows"] = ordered.paged[("rows", page)]
    return calls


@pytest.mark.parametrize("call", ["prefill", "decode"])
def test_dense_cache_attention_is_the_padded_entries_formula(call):
    """The two attention backward formulas (T16-armJ-attention): dense over the cache and padded entries give the
    same attention and the same gradients of q, key_cache and value_cache (fp32, to rounding) on arm J's prefill
    call (several queries per entry) and its decode call (one per entry, entries sharing blocks)."""
    from bloggap_plugin.core.vllm.autograd import dense_cache_attention, padded_paged_attention

    q, key_cache, value_cache, cu, seqused, table, max_q, max_k = _arm_j_paged_calls()[call]
    assert (max_q == 1) == (call == "decode") and cu.numel() - 1 > 2 and seqused.unique().numel() > 2
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    results = []
    for formula in (padded_paged_attention, dense_cache_attention):
        leaves = [t.clone().requires_grad_(True) for t in (q, key_cache, value_cache)]
        out = formula(*leaves, cu, seqused, table, max_q, max_k, 0.3)
        results.append([out, *torch.autograd.grad(out, leaves, upstream)])
    for padded, dense in zip(*results, strict=True):
        torch.testing.assert_close(dense, padded, rtol=1e-5, atol=1e-5)


def test_flash_paged_formula_takes_dense_for_decode_and_padded_for_prefill_or_a_large_mask(monkeypatch):
    """``flash_paged_formula`` chooses per call from shapes and ints alone: dense over the cache for a decode call
    (``max_seqlen_q == 1``) whose ``[Tq, slots]`` mask is within ``DENSE_MASK_ELEMENTS``, padded entries for the
    prefill call and for a decode call past the cap."""
    from bloggap_plugin.core.vllm import autograd as vllm_autograd

    ran = []

    def spy(name, formula):
        def call(*args):
            ran.append(name)
            return formula(*args)
        return call

    monkeypatch.setattr(vllm_autograd, "dense_cache_attention", spy("dense", vllm_autograd.dense_cache_attention))
    monkeypatch.setattr(vllm_autograd, "padded_paged_attention", spy("padded", vllm_autograd.padded_paged_attention))
    calls = _arm_j_paged_calls()
    for name in ("prefill", "decode"):
        vllm_autograd.flash_paged_formula(*calls[name], 0.3)
    assert ran == ["padded", "dense"]
    q, key_cache = calls["decode"][:2]
    elements = q.shape[0] * key_cache.shape[0] * key_cache.shape[1]
    monkeypatch.setattr(vllm_autograd, "DENSE_MASK_ELEMENTS", elements)
    vllm_autograd.flash_paged_formula(*calls["decode"], 0.3)
    monkeypatch.setattr(vllm_autograd, "DENSE_MASK_ELEMENTS", elements - 1)
    vllm_autograd.flash_paged_formula(*calls["decode"], 0.3)
    assert ran[2:] == ["dense", "padded"]
    # no host read of a device tensor: the choice works on meta tensors (shapes only)
    meta = [torch.empty(t.shape, device="meta") for t in (q, key_cache)]
    assert vllm_autograd.paged_attention_formula(*meta, 1) is vllm_autograd.padded_paged_attention
    monkeypatch.setattr(vllm_autograd, "DENSE_MASK_ELEMENTS", elements)
    assert vllm_autograd.paged_attention_formula(*meta, 1) is vllm_autograd.dense_cache_attention
    assert vllm_autograd.paged_attention_formula(*meta, 2) is vllm_autograd.padded_paged_attention


def test_a_kernel_that_changes_its_input_is_refused():
    """A kernel that writes into an input it was given (vLLM's rotary and fused add-norm ops do, unwrapped) would
    leave the backward other inputs than it read: refused at the call."""

    def in_place_rotary(x, positions, cache):
        return x.mul_(2)

    kernels = autograd_kernels(dataclasses.replace(TORCH_KERNELS, rotary=in_place_rotary))
    x = torch.randn(4, 2, 8, requires_grad=True).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="rotary kernel changed one of its inputs in place"):
        kernels.rotary(x, torch.arange(4), torch.zeros(8, 8))
    assert set(PIECE_FORMULAS) == {f.name for f in dataclasses.fields(Kernels)} - {"scope", "source"}


# ----------------------------------------------------------------------------------------- the whole forward
@pytest.mark.parametrize("spec", ["all", "torch"])
def test_parameter_gradients_within_bounds_of_torch_autograd(tiny_model, spec):
    """Parameter gradients of a weighted sum of the training forward's log-probs, against (1) the fp32 policy's own HF
    forward under torch autograd (the exact maths): within 2% (L2 over all parameters) and 4% per tensor; (2) torch's
    own autograd through the same bf16 forward (the stand-in pieces unwrapped): within 1%."""
    model = _private(tiny_model)
    ids, mask = _rows()
    keep = 16
    gen = torch.Generator().manual_seed(7)
    weights = torch.randn(ids.shape[0], keep, generator=gen) * mask[:, -keep:]
    form = parse_form(spec)

    def grads(logps):
        model.zero_grad()
        (logps * weights).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    def rel(got, want):
        total = sum(((got[n] - want[n]) ** 2).sum() for n in want) / sum((want[n] ** 2).sum() for n in want)
        return float(total.sqrt()), max(float((got[n] - want[n]).norm() / want[n].norm()) for n in want)

    exact = grads(token_logprobs(model, ids, mask, keep, positions="mask"))
    ours = grads(OnPolicyForward(model, form, TORCH_KERNELS).token_logprobs(ids, mask, keep)[0])
    plain_lm = VllmFormLM(model, form, TORCH_KERNELS, over_parameters=True)
    reduce = sampler_reduce(TORCH_KERNELS) if form.logprobs == "v2_sampler" else None
    plain = grads(token_logprobs(plain_lm, ids, mask, keep, positions="mask", reduce=reduce))
    total, worst = rel(ours, exact)
    assert total <= 0.02 and worst <= 0.04, (total, worst)
    assert rel(ours, plain)[0] <= 0.01
    assert all(float(g.norm()) > 0 for g in ours.values())
    assert not torch.equal(torch.cat([g.flatten() for g in ours.values()]),
                           torch.cat([g.flatten() for g in exact.values()]))  # not the fp32 forward itself


def _on_meta(tiny_model):
    """``(model, kernels)``: the tiny Llama built on the meta device (no values: reading one raises) and the torch
    stand-ins with the attention pieces as autograd's formulas (TORCH_KERNELS' references loop over rows on the host,
    as vLLM's kernels do not)."""
    from bloggap_plugin.core.vllm.autograd import flash_formula, flash_paged_formula

    source = _private(tiny_model)
    with torch.device("meta"):
        model = type(source)(source.config)
    return model, dataclasses.replace(TORCH_KERNELS, flash=flash_formula, flash_paged=flash_paged_formula)


@pytest.mark.parametrize("spec", ["all", "all,attention_launch=packed"])
def test_training_forward_and_backward_read_nothing_of_the_device_with_a_host_mask(tiny_model, spec):
    """With the attention mask on the CPU and everything else on the meta device (which holds no values: any read of
    a tensor's values there raises, as ``.item()``, ``.tolist()``, ``nonzero`` or a boolean-mask index would wait for
    a GPU), arm J's training forward and its backward run through: the rows' layout is computed on the host and copied
    over. The same forward with the mask on the device reads it (and raises there). The vLLM forms only (``sdpa``
    attention loops over rows on the host by design)."""
    model, kernels = _on_meta(tiny_model)
    forward = OnPolicyForward(model, parse_form(spec), kernels)
    ids, mask = _rows()
    logps, _ = forward.token_logprobs(ids.to("meta"), mask, 16, batch_size=4)
    assert logps.device.type == "meta" and logps.shape == (6, 16)
    logps.sum().backward()
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.parameters())
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        forward.token_logprobs(ids.to("meta"), mask.to("meta"), 16, batch_size=4)


@pytest.mark.parametrize("plan_class", ["VllmFormPlan", "VllmFormParamsPlan"])
def test_arm_i_and_js_old_pass_reads_nothing_of_the_device_with_a_host_mask(tiny_model, plan_class):
    """The old-log-prob plans of arms I (a bf16 shadow) and J (over the parameters) keep a mask given on the CPU there
    (``host_layout``) and score the meta device's rows without reading a value; given the mask on the device, they
    read it (and raise there)."""
    from bloggap_plugin.core.plans import vllm_shadow

    model, kernels = _on_meta(tiny_model)
    plan = getattr(vllm_shadow, plan_class)(model, parse_form("all"), kernels)
    assert plan.host_layout
    ids, mask = _rows()
    old = plan.token_logprobs(ids.to("meta"), mask, 16, batch_size=4, positions="mask")
    assert old.device.type == "meta" and old.shape == (6, 16)
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        plan.token_logprobs(ids.to("meta"), mask.to("meta"), 16, batch_size=4, positions="mask")


def test_grad_free_calls_run_the_kernel_alone(tiny_model):
    """Under ``torch.no_grad`` (or with no input needing a gradient) a wrapped piece is the kernel's call, no graph."""
    kernels = autograd_kernels(TORCH_KERNELS)
    x = torch.randn(4, 6).to(torch.bfloat16)
    w = torch.randn(3, 6, requires_grad=True)
    with torch.no_grad():
        out = kernels.linear(x, w.to(torch.bfloat16), None)
    assert out.grad_fn is None and torch.equal(out, F.linear(x, w.detach().to(torch.bfloat16)))
    assert kernels.linear(x, w.detach().to(torch.bfloat16), None).grad_fn is None


@pytest.mark.parametrize("spec", ["all", "torch"])
def test_arm_js_old_log_prob_plan_scores_over_the_parameters_without_a_shadow(tiny_model, spec):
    """``make_plan(policy, "vllm", over_parameters=True)`` (arm J's old log-probs) keeps no copy of the weights and
    has nothing to sync: it scores the policy's own parameters cast to bf16, the values arm I's plan scores on its
    bf16 shadow bit for bit, before and after the weights change."""
    from bloggap_plugin.core.plans import make_plan
    from bloggap_plugin.core.plans.vllm_shadow import VllmFormParamsPlan

    model = _private(tiny_model)
    ids, mask = _rows()
    form = parse_form(spec)
    shadowed = VllmFormPlan(model, form, TORCH_KERNELS)
    plan = VllmFormParamsPlan(model, form, TORCH_KERNELS)
    cache = plan.model.cos_sin_cache
    weights_bf16 = 2 * sum(p.numel() for p in model.parameters())
    assert plan.stats()["bytes_added"] == cache.numel() * cache.element_size()  # the RoPE cache only
    assert shadowed.stats()["bytes_added"] >= weights_bf16
    assert torch.equal(plan.token_logprobs(ids, mask, 16, positions="mask"),
                       shadowed.token_logprobs(ids, mask, 16, positions="mask"))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.01)
    shadowed.sync(model)
    assert torch.equal(plan.token_logprobs(ids, mask, 16, positions="mask"),
                       shadowed.token_logprobs(ids, mask, 16, positions="mask"))
    if spec == "torch":
        assert type(make_plan(model, "vllm", pieces=spec, over_parameters=True)) is VllmFormParamsPlan


@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm"])
def test_a_norm_in_step_launches_is_one_piece_with_each_launchs_values_and_gradient(name):
    """``in_step_launches`` runs every launch of ``norm_in_step_launches`` (the kernel's values, bit for bit) and
    differentiates the row-wise formula once over all rows: the same gradient as one piece per launch, within fp32
    noise (both are torch's fp32 gradient rounded once to bf16)."""
    from bloggap_plugin.core.vllm.form import norm_in_step_launches, step_launches

    kernel = getattr(autograd_kernels(TORCH_KERNELS), name)
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(40, 16, generator=gen) * 3).to(torch.bfloat16)
    weight = (1 + 0.2 * torch.randn(16, generator=gen)).to(torch.bfloat16)
    generated = torch.zeros(40, dtype=torch.bool)
    generated[[3, 4, 9, 20, 21, 22, 30, 39]] = True
    launches = step_launches(generated, large=4)  # the decode tokens in three launches
    upstream = torch.randn(40, 16, generator=gen).to(torch.bfloat16)
    one = [_leaf(x), _leaf(weight)]
    out_one = kernel.in_step_launches(one[0], one[1], 1e-6, launches, 4)
    per = [_leaf(x), _leaf(weight)]
    out_per = norm_in_step_launches(kernel, per[0], per[1], 1e-6, launches, 4)
    assert torch.equal(out_one, norm_in_step_launches(getattr(TORCH_KERNELS, name), x, weight, 1e-6, launches, 4))
    assert torch.equal(out_one, out_per)
    got = torch.autograd.grad(out_one, one, upstream)
    want = torch.autograd.grad(out_per, per, upstream)
    assert torch.equal(got[0], want[0])  # a row's input gradient is the same fp32 formula over the same row
    # the weight's: torch's fp32 gradient over all rows rounded once (one launch per piece rounds each launch's part
    # to bf16 and autograd sums them in bf16: further from it)
    exact = [_leaf(x.float()), _leaf(weight.float())]
    fp32 = torch.autograd.grad(exact[0] * torch.rsqrt(exact[0].pow(2).mean(-1, keepdim=True) + 1e-6) * exact[1],
                               exact, upstream.float())[1]
    assert ((got[1].float() - fp32).abs() <= HALF_ULP * fp32.abs() + 1e-6 * fp32.abs().max()).all()


def test_closed_form_gradients_are_torchs_gradients_of_the_formulas():
    """Each piece's gradient in closed form (``PIECE_GRADIENTS``: what the backward computes, without recomputing
    the piece) equals torch's autograd of the same fp32 formula, to fp32 rounding; every formula but the contiguous
    attention's has one (the paged attention's on arm J's prefill and decode calls: GQA, entries sharing blocks; and
    on the decode call given its rows)."""
    from bloggap_plugin.core.vllm.autograd import (
        PIECE_GRADIENTS,
        flash_paged_formula,
        linear_formula,
        rms_norm_formula,
        rms_norm_over_launches,
        rotary_formula,
        silu_and_mul_formula,
        token_logprobs_formula,
    )

    assert set(PIECE_GRADIENTS) == {linear_formula, rms_norm_formula, rms_norm_over_launches, rotary_formula,
                                    silu_and_mul_formula, token_logprobs_formula, flash_paged_formula}
    gen = torch.Generator().manual_seed(21)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    cache = vllm_cos_sin_cache(8, 10000.0, 64, torch.bfloat16, torch.device("cpu"))
    calls = _arm_j_paged_calls()
    cases = [
        (linear_formula, [randn(3, 5, 16), randn(12, 16, scale=0.3), randn(12, scale=0.1)]),
        (linear_formula, [randn(24, 16), randn(12, 16, scale=0.3), None]),
        (rms_norm_formula, [randn(24, 16, scale=3), 1 + 0.2 * randn(16), 1e-6]),
        (rms_norm_over_launches, [randn(24, 16, scale=3), 1 + 0.2 * randn(16), 1e-6, ("launches",)]),
        (rotary_formula, [randn(24, 3, 8), torch.randint(0, 64, (24,), generator=gen), cache]),
        (silu_and_mul_formula, [randn(24, 20, scale=2)]),
        (token_logprobs_formula, [randn(24, 50, scale=3), torch.randint(0, 50, (24,), generator=gen)]),
        *((flash_paged_formula, [*calls[name], 0.3]) for name in ("prefill", "decode")),
        (flash_paged_formula, [*calls["decode"], 0.3, calls["rows"]]),  # the decode call given its rows
    ]
    for formula, args in cases:
        leaves = [a.clone().requires_grad_(True) if torch.is_tensor(a) and a.is_floating_point() and a.dtype ==
                  torch.float32 else a for a in args]
        out = formula(*leaves)
        upstream = randn(*out.shape)
        differentiable = [a for a in leaves if torch.is_tensor(a) and a.requires_grad]
        want = torch.autograd.grad(out, differentiable, upstream)
        got = [g for a, g in zip(leaves, PIECE_GRADIENTS[formula](upstream, *args))
               if torch.is_tensor(a) and a.requires_grad]
        assert len(got) == len(want), formula.__name__
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6 * float(w.abs().max()), msg=formula.__name__)


def test_a_pieces_backward_dispatches_only_what_its_formula_needs():
    """Host work of the closed-form backwards (arm J's step is host-bound on the GPU): a gradient not wanted is not
    computed (a linear whose weight needs none runs one matmul, for ``d x``; one whose input needs none, one for
    ``d weight``), an input the gradient does not read is not cast (RoPE's ``x``, its whole cos/sin cache), a bf16
    linear's gradient is bf16 matmuls (as autocast's backward), and another bf16 input is cast to fp32 only where an
    op would otherwise compute in bf16. Counted with
    ``benchmarks.arm_j_host_ops.OpCounter`` (every aten op dispatched) around one piece's backward."""
    from benchmarks.arm_j_host_ops import OpCounter

    kernels = autograd_kernels(TORCH_KERNELS)
    gen = torch.Generator().manual_seed(13)

    def bf(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    def backward_ops(out, inputs):
        upstream = bf(*out.shape)
        with OpCounter() as counter:
            torch.autograd.grad(out, inputs, upstream)
        return counter.counts, counter.summary()["launching"]

    x, weight = bf(24, 16), bf(12, 16)
    for wants in ("x", "weight"):
        leaves = [_leaf(x) if wants == "x" else x, _leaf(weight) if wants == "weight" else weight]
        counts, _ = backward_ops(kernels.linear(*leaves, None), [t for t in leaves if t.requires_grad])
        # one bf16 matmul (as autocast's backward of a bf16 linear; tensor cores on a GPU), no cast
        assert counts["mm"] == 1 and counts["_to_copy"] == 0, (wants, dict(counts))
    leaves = [_leaf(x), _leaf(bf(16))]
    counts, launching = backward_ops(kernels.rms_norm(*leaves, 1e-6), leaves)
    # casts: x (read by bf16-unsafe ops) and the weight to fp32, d weight back to bf16 (d x is rounded as its last
    # product stores it); the upstream gradient enters ops beside fp32 operands. r = rsqrt(sum(x^2) / width + eps):
    # 5 ops (no mean: vLLM's batch-invariant mode sends aten::mean to a Triton kernel), n = x r, g = grad w,
    # sum(g n), d x = r (g - n sum(g n) / width): 5, d weight = sum(grad n): 2
    assert counts["_to_copy"] == 3 and counts["mean"] == 0 and launching <= 3 + 13, (dict(counts), launching)
    cache = vllm_cos_sin_cache(8, 10000.0, 64, torch.bfloat16, torch.device("cpu"))
    leaf = _leaf(bf(24, 3, 8))
    counts, launching = backward_ops(kernels.rotary(leaf, torch.randint(0, 64, (24,), generator=gen), cache), [leaf])
    # the rows of the cache read (one gather, one cast), two products and two fused multiply-adds storing d x in bf16
    assert counts["_to_copy"] == 1 and launching <= 6, (dict(counts), launching)


def _unread_by_loops(cu, seqused, table, max_k, queries, slots, page):
    """Which cache slots each query does not read, entry by entry in Python (independent of the vectorised mask)."""
    unread = torch.ones(queries, slots, dtype=torch.bool)
    for entry in range(cu.numel() - 1):
        start, end = int(cu[entry]), int(cu[entry + 1])
        for r, query in enumerate(range(start, end)):
            for position in range(min(max_k, int(seqused[entry]) - (end - start) + r + 1)):
                unread[query, int(table[entry, position // page]) * page + position % page] = False
    return unread


@pytest.mark.parametrize("call", ["prefill", "decode"])
def test_paged_unread_slots_and_its_memo(call):
    """The mask of slots a query does not read equals an entry-by-entry loop; its memo (one mask per call's metadata,
    shared by every layer) returns the same tensor for the same metadata and rebuilds it when the block table is
    changed in place or replaced."""
    from bloggap_plugin.core.vllm.autograd import _memo_unread_slots, paged_unread_slots

    q, key_cache, _, cu, seqused, table, _, max_k = _arm_j_paged_calls()[call]
    page = key_cache.shape[1]
    shape = (q.shape[0], key_cache.shape[0] * page, page)
    want = _unread_by_loops(cu, seqused, table, max_k, *shape)
    assert torch.equal(paged_unread_slots(cu, seqused, table, max_k, *shape), want)
    first = _memo_unread_slots(cu, seqused, table, max_k, *shape)
    assert torch.equal(first, want) and _memo_unread_slots(cu, seqused, table, max_k, *shape) is first
    table = table.clone()
    assert _memo_unread_slots(cu, seqused, table, max_k, *shape) is not first  # another tensor, equal values
    table[[0, -1]] = table[[-1, 0]].clone()  # in place: the first and last entries swap their blocks
    changed = _memo_unread_slots(cu, seqused, table, max_k, *shape)
    assert torch.equal(changed, _unread_by_loops(cu, seqused, table, max_k, *shape)) and not torch.equal(changed, want)


def test_paged_attention_gradient_past_its_cap_is_autograds(monkeypatch):
    """Past ``DENSE_GRADIENT_ELEMENTS`` (heads x queries x slots) the paged attention's gradient is torch's autograd
    of ``flash_paged_formula``; at the cap, the closed form; both the same gradients to fp32 rounding."""
    from bloggap_plugin.core.vllm import autograd as vllm_autograd

    ran = []
    original = vllm_autograd.formula_gradient
    monkeypatch.setattr(vllm_autograd, "formula_gradient", lambda *a, **k: ran.append(a[0]) or original(*a, **k))
    args = [*_arm_j_paged_calls()["decode"], 0.3]
    q, key_cache = args[0], args[1]
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(8))
    elements = q.shape[0] * q.shape[1] * key_cache.shape[0] * key_cache.shape[1]
    results = []
    for cap in (elements, elements - 1):
        monkeypatch.setattr(vllm_autograd, "DENSE_GRADIENT_ELEMENTS", cap)
        results.append(vllm_autograd.paged_attention_gradient(upstream, *args)[:3])
    assert ran == [vllm_autograd.flash_paged_formula]
    for dense, autograd in zip(*results, strict=True):
        torch.testing.assert_close(dense, autograd, rtol=1e-5, atol=1e-6 * float(autograd.abs().max()))


def _paged_backward_ops(seed: int, rows: bool):
    """``backward_ops(wanted)`` on arm J's decode call in bf16 (given its rows or not): the aten ops an ``OpCounter``
    (``benchmarks.arm_j_host_ops``) sees in the backward of the inputs ``wanted`` (indices of q, key_cache,
    value_cache), and how many of them launch a kernel; every gradient checked to come back in bf16."""
    from benchmarks.arm_j_host_ops import OpCounter

    kernels = autograd_kernels(TORCH_KERNELS)
    calls = _arm_j_paged_calls()
    q, key_cache, value_cache, *metadata = calls["decode"]
    q, key_cache, value_cache = (t.to(torch.bfloat16) for t in (q, key_cache, value_cache))
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    hint = {"rows": calls["rows"]} if rows else {}

    def backward_ops(wanted):
        leaves = [_leaf(t) if i in wanted else t for i, t in enumerate((q, key_cache, value_cache))]
        out = kernels.flash_paged(*leaves, *metadata, 0.3, **hint)
        with OpCounter() as counter:
            grads = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], upstream)
        assert all(g.dtype == torch.bfloat16 for g in grads)
        return counter.counts, counter.summary()["launching"]

    return backward_ops


def test_paged_attention_backward_dispatches_a_closed_form():
    """Host work of the paged attention's backward (about half of arm J's backward on the H200, T16-armJ-backward):
    in closed form, no recompute through autograd: five matmuls, the softmax and its gradient, one cast per input
    and per gradient; with the call's mask already built (every layer after the first), nothing for it. Counted
    with ``benchmarks.arm_j_host_ops.OpCounter``; only the gradients wanted are computed."""
    backward_ops = _paged_backward_ops(seed=9, rows=False)
    backward_ops({0, 1, 2})  # builds the call's mask
    counts, launching = backward_ops({0, 1, 2})
    assert counts["baddbmm"] == 5 and counts["scatter_add_"] == 0 and counts["_softmax"] == 0, dict(counts)
    # casts q, K, V, grad in and d q, d K, d V out (7), scores' mask and softmax (6), its gradient (4), matmuls (5)
    assert launching <= 24, (dict(counts), launching)
    counts, _ = backward_ops({0})
    assert counts["baddbmm"] == 3, dict(counts)  # S, dP, d q
    counts, _ = backward_ops({2})
    assert counts["baddbmm"] == 2, dict(counts)  # S, d V


def test_a_pieces_backward_runs_on_cublas_where_the_process_prefers_cublaslt(monkeypatch):
    """vLLM's batch-invariant mode prefers cuBLASLt process-wide; a piece's backward (not compared bit for bit with
    anything) runs its matmuls on cuBLAS and gives the preference back afterwards; where the process does not prefer
    cuBLASLt the backward leaves the setting alone. (This CPU build cannot select cuBLASLt: the setting is a stand-in.)"""
    from bloggap_plugin.core.vllm import autograd as vllm_autograd

    backends = torch._C._BlasBackend
    state = {"now": backends.Cublaslt, "calls": []}

    def preferred(backend=None):
        if backend is not None:
            state["calls"].append(backend)
            state["now"] = {"cublas": backends.Cublas, "cublaslt": backends.Cublaslt}.get(backend, backend)
        return state["now"]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    seen = []
    original = vllm_autograd.PIECE_GRADIENTS[vllm_autograd.linear_formula]
    monkeypatch.setitem(vllm_autograd.PIECE_GRADIENTS, vllm_autograd.linear_formula,
                        lambda *a, **k: seen.append(state["now"]) or original(*a, **k))
    kernels = autograd_kernels(TORCH_KERNELS)
    gen = torch.Generator().manual_seed(17)
    x, weight = _leaf(torch.randn(6, 8, generator=gen)), _leaf(torch.randn(4, 8, generator=gen))
    dx, dweight = torch.autograd.grad(kernels.linear(x, weight, None).sum(), [x, weight])
    assert seen == [backends.Cublas] and state["now"] == backends.Cublaslt
    assert state["calls"] == ["cublas", backends.Cublaslt]
    torch.testing.assert_close(dx, torch.ones(6, 4) @ weight.detach())
    state.update(now=backends.Cublas, calls=[])
    torch.autograd.grad(kernels.linear(x, weight, None).sum(), [x, weight])
    assert seen[-1] == backends.Cublas and state["calls"] == []


def test_the_unread_slots_memo_lets_a_mask_go_with_its_calls_metadata():
    """A memo entry (a ``[Tq, slots]`` mask, device memory) does not outlive the call's metadata: once the forward's
    ``cu_seqlens_q``/``seqused_k``/``block_table`` are freed, the entry is gone, before eight newer calls push it
    out."""
    import gc

    from bloggap_plugin.core.vllm import autograd as vllm_autograd

    q, key_cache, _, cu, seqused, table, _, max_k = _arm_j_paged_calls()["decode"]
    cu, seqused, table = cu.clone(), seqused.clone(), table.clone()
    page = key_cache.shape[1]
    ids = (id(cu), id(seqused), id(table))
    vllm_autograd._memo_unread_slots(cu, seqused, table, max_k, q.shape[0], key_cache.shape[0] * page, page)
    assert any(key[:3] == ids for key in vllm_autograd._UNREAD_MEMO)
    del cu, seqused, table
    gc.collect()
    assert not any(key[:3] == ids for key in vllm_autograd._UNREAD_MEMO)


def test_the_decode_call_by_rows_is_the_same_attention_over_each_rows_own_keys():
    """Arm J's decode call (one entry per generated token) described by rows: an entry per row that generated, its
    generated tokens (the last of its tokens) the queries, its length the keys, its block table row; checked against
    the packed rows one by one. The same attention as the decode call (fp32, to rounding). A row whose generated
    tokens are not the last of its tokens has no such description."""
    from bloggap_plugin.core.vllm.autograd import padded_paged_attention
    from bloggap_plugin.core.vllm.form import decode_by_rows

    calls = _arm_j_paged_calls()
    q, key_cache, value_cache, cu, seqused, table, _, max_k = calls["decode"]
    cu_rows, keys, table_rows, max_q_rows, max_k_rows = calls["rows"]
    ids, mask = _rows()
    lengths = mask.sum(1).tolist()
    generated = [int(mask[row, -16:].sum()) for row in range(len(lengths))]
    assert (cu_rows[1:] - cu_rows[:-1]).tolist() == generated and keys.tolist() == lengths  # every row generated
    assert max_q_rows == max(generated) and max_k_rows == max(lengths) == max_k
    assert torch.equal(table_rows[:, 0], torch.tensor([int(table[int(start), 0]) for start in cu_rows[:-1]]))
    by_entries = padded_paged_attention(q, key_cache, value_cache, cu, seqused, table, 1, max_k, 0.3)
    by_rows = padded_paged_attention(q, key_cache, value_cache, cu_rows, keys, table_rows, max_q_rows, max_k_rows, 0.3)
    torch.testing.assert_close(by_rows, by_entries, rtol=1e-5, atol=1e-6)
    row = torch.tensor([0, 0, 0, 1, 1])
    assert decode_by_rows(row, torch.tensor([3, 4, 5, 2, 3]), [6, 4], table[:2]) is not None
    assert decode_by_rows(row, torch.tensor([2, 4, 5, 2, 3]), [6, 4], table[:2]) is None  # row 0: 2, 4, 5 of 6


@pytest.mark.parametrize("call", ["prefill", "decode"])
def test_the_attention_gradient_by_entry_scores_each_entry_against_its_own_keys(call, monkeypatch):
    """The closed form by entry (the prefill; the decode call given its rows) against autograd of the formula and
    the dense closed form: the same gradients (fp32, to rounding). Its score tensor holds entries x heads x queries
    x keys of each entry, not every query against every cache slot (arm J's decode call: its rows x heads x the most
    generated tokens x the longest row, against generated tokens x heads x slots); each cache slot takes the
    gradient of at most one entry's key (the sum needs no order), padding none."""
    from bloggap_plugin.core.vllm import autograd as vllm_autograd

    calls = _arm_j_paged_calls()
    args = [*calls[call], 0.3]
    q, key_cache = args[0], args[1]
    rows = calls["rows"] if call == "decode" else None
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(11))
    scores = []
    original = vllm_autograd._bmm
    monkeypatch.setattr(vllm_autograd, "_bmm", lambda a, b, alpha=1.0: scores.append(a.shape[:2] + b.shape[2:])
                        or original(a, b, alpha))
    got = vllm_autograd.paged_attention_gradient(upstream, *args, *(() if rows is None else (rows,)))
    assert len(got) == len(args) + (rows is not None) and all(g is None for g in got[3:])
    entry_call = rows if rows is not None else args[3:8]
    entries, max_q, max_k = entry_call[0].numel() - 1, entry_call[3], entry_call[4]
    kv_heads, slots = key_cache.shape[2], key_cache.shape[0] * key_cache.shape[1]
    assert scores[0] == (entries * kv_heads, q.shape[1] // kv_heads * max_q, max_k)
    assert entries * q.shape[1] * max_q * max_k < q.shape[0] * q.shape[1] * slots
    leaves = [t.clone().requires_grad_(True) for t in args[:3]]
    want = torch.autograd.grad(vllm_autograd.flash_paged_formula(*leaves, *args[3:]), leaves, upstream)
    monkeypatch.setattr(vllm_autograd, "_bmm", original)
    dense = vllm_autograd.paged_attention_gradient(upstream, *args[:6], 1, args[7], 0.3) if call == "decode" else None
    for index, (g, w) in enumerate(zip(got[:3], want, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6 * float(w.abs().max()))
        if dense is not None:
            torch.testing.assert_close(g, dense[index], rtol=1e-5, atol=1e-6 * float(w.abs().max()))
    *_, write, _ = vllm_autograd.entry_layout(*entry_call[:5], q.shape[0], slots, key_cache.shape[1])
    real = write[write < slots]
    assert real.unique().numel() == real.numel()


def test_the_attention_backward_by_entry_dispatches_a_closed_form():
    """Host work of the closed form by entry (arm J's prefill call and its decode call by rows): five matmuls, the
    softmax and its gradient, one scatter per cache gradient, no recompute through autograd; with the call's layout
    already built (every layer after the first) nothing for it. Only the gradients wanted are computed."""
    backward_ops = _paged_backward_ops(seed=12, rows=True)
    backward_ops({0, 1, 2})  # builds the call's layout
    counts, launching = backward_ops({0, 1, 2})
    assert counts["baddbmm"] == 5 and counts["index_put_"] == 4 and counts["_softmax"] == 0, dict(counts)
    assert counts["repeat_interleave"] == 0 and counts["arange"] == 0, dict(counts)  # the layout: memoised
    # casts q and grad in (2) and d q, d K, d V out (3), placing q and grad in entries (4), gathering K and V (4),
    # d q back to the queries (1), summing d K and d V into the cache (4), matmuls (5), softmax (6), its gradient (4)
    assert launching <= 33, (dict(counts), launching)
    counts, _ = backward_ops({0})
    assert counts["baddbmm"] == 3 and counts["index_put_"] == 2, dict(counts)  # S, dP, d q; q and grad padded
    counts, _ = backward_ops({2})
    assert counts["baddbmm"] == 2 and counts["index_put_"] == 3, dict(counts)  # S, d V; d V summed into the cache


def test_the_dense_attention_gradient_is_the_routes_before_by_an_environment_variable(monkeypatch):
    """``BLOGGAP_ATTENTION_GRADIENT=dense`` (a benchmark's before: ``J:dense_attention`` in benchmarks.cost_by_size)
    gives every paged call the dense closed form, the prefill and the decode call given its rows too; the same
    gradients (fp32, to rounding). Another value is refused, naming the variable and the values it takes."""
    from bloggap_plugin.core.errors import UsageError
    from bloggap_plugin.core.vllm import autograd as vllm_autograd

    calls = _arm_j_paged_calls()
    shapes = []
    original = vllm_autograd._bmm
    monkeypatch.setattr(vllm_autograd, "_bmm",
                        lambda a, b, alpha=1.0: shapes.append(a.shape[0]) or original(a, b, alpha))
    for name, rows in (("prefill", ()), ("decode", (calls["rows"],))):
        args = [*calls[name], 0.3]
        upstream = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(13))
        got = []
        for value in ("", "dense", "by_entry"):
            monkeypatch.setenv(vllm_autograd.ATTENTION_GRADIENT_ENV, value)
            shapes.clear()
            got.append(vllm_autograd.paged_attention_gradient(upstream, *args, *rows)[:3])
            kv_heads = args[1].shape[2]
            assert (shapes[0] == kv_heads) == (value == "dense"), (name, value, shapes)  # dense: one batch per head
        for by_entry, dense in zip(got[0], got[1], strict=True):
            torch.testing.assert_close(by_entry, dense, rtol=1e-5, atol=1e-6 * float(dense.abs().max()))
    monkeypatch.setenv(vllm_autograd.ATTENTION_GRADIENT_ENV, "fast")
    with pytest.raises(UsageError, match=r"BLOGGAP_ATTENTION_GRADIENT='fast'.*by_entry.*dense"):
        vllm_autograd.paged_attention_gradient(upstream, *args, *rows)
