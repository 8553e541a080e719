"""Scoring plans (core/plans/): they really run in their precision, equal independent models, stay
fresh after sync without re-allocating, and never touch the policy.

"Bit for bit" here means: the plan's fp32 (fp16) log-probs are ``torch.equal`` to those of a separately
loaded model of the same class in fp32 (fp16) holding the policy's weights cast to that dtype (for a bf16
policy these are the bf16-rounded weights; no plan can recover precision the policy never had), scored by
the same ``token_logprobs`` with the same rows and chunking.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bloggap_plugin.core.arms import PLAN_ALIASES, PLAN_NAMES, plan_name
from bloggap_plugin.core.model_parts import decoder_layers
from bloggap_plugin.core.plans import PLANS, make_plan
from bloggap_plugin.core.plans.policy import PolicyPlan
from bloggap_plugin.core.plans.shadow import ShadowPlan
from bloggap_plugin.core.plans.upcast import UpcastPlan
from bloggap_plugin.core.scoring import DEFAULT_CHUNK_TOKENS, gather_logprobs, output_head, token_logprobs
from bloggap_plugin.core.truncation import kept_reducer
from bloggap_plugin.models import load_model

TEXTS = [
    "The capital of France is Paris, and the river is the Seine.",
    "2 + 3 = 5",
    "Once upon a time there was a small robot who liked to count stars at night.",
    "def add(a, b): return a + b",
]
K = 6


def _rows(tok, texts=TEXTS):
    enc = tok(texts, padding=True, return_tensors="pt")
    assert tok.padding_side == "left"
    return enc.input_ids, enc.attention_mask


def _independent(spec_model, dtype, weights_from):
    """A separately constructed model of the same class with its parameters in ``dtype`` (buffers as loaded)
    holding ``weights_from``'s weights."""
    model = spec_model
    for p in model.parameters():
        p.data = p.data.to(dtype)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights_from.state_dict().items()}
    model.load_state_dict(state)
    return model


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _assert_same(model, snap):
    for n, p in model.named_parameters(remove_duplicate=False):
        assert torch.equal(p.detach(), snap[n]), f"{n} changed"


# ----------------------------------------------------------------------------------------------- names


def test_plan_names_and_aliases(tiny_model):
    assert PLAN_NAMES == ("bf16", "fp32", "fp16", "fp32_head", "guided", "vllm")
    assert tuple(PLANS) == PLAN_NAMES  # the registry builds exactly the plans the arm records name
    assert {plan_name(a) for a in "ABDEFI"} == set(PLAN_NAMES)
    assert plan_name("B") == "fp32" and plan_name("F") == "fp16" and plan_name("E") == "fp32_head"
    assert plan_name("D") == "guided" and plan_name("A") == "bf16" and plan_name("FP16") == "fp16"
    assert PLAN_ALIASES["B"] == "fp32"
    with pytest.raises(ValueError, match=r"unknown scoring arm 'fp8'.*bf16, fp32, fp16, fp32_head, guided"):
        plan_name("fp8")
    model, _ = tiny_model("tiny-random-llama", "bf16")
    with pytest.raises(ValueError, match="unknown scoring arm 'Z'"):
        make_plan(model, "Z")


def test_bad_options_give_clear_errors(tiny_model):
    model, tok = tiny_model("tiny-random-llama", "bf16")
    with pytest.raises(ValueError, match=r"bad layer id 2: the model has 2 decoder layers.*0\.\.1"):
        make_plan(model, "guided", layers=[0, 2])
    with pytest.raises(ValueError, match="bad layer id -1"):
        make_plan(model, "D", layers=[-1])
    with pytest.raises(ValueError, match="duplicate layer ids"):
        make_plan(model, "guided", layers=[1, 1])
    with pytest.raises(ValueError, match=r"needs layers=\[ids\]"):
        make_plan(model, "guided")
    with pytest.raises(ValueError, match="needs calibration="):
        make_plan(model, "guided", layers="auto")
    with pytest.raises(ValueError, match="list of decoder layer ids or 'auto'"):
        make_plan(model, "guided", layers="top")
    with pytest.raises(ValueError, match="for arm 'guided' only"):
        make_plan(model, "fp32", layers=[0])
    with pytest.raises(ValueError, match="k must be an integer in"):
        make_plan(model, "guided", layers="auto", k=5, calibration=_rows(tok))
    with pytest.raises(ValueError, match="device= places an fp32/fp16 shadow"):
        make_plan(model, "fp32_head", device="cpu")
    plan = make_plan(model, "fp32")
    plan.close()
    with pytest.raises(RuntimeError, match="closed"):
        plan.token_logprobs(*_rows(tok), K)


def test_registry_builds_each_plan_class_under_its_name(tiny_model):
    """Each plan name builds its module's class; ``plan.name`` and the ``arm`` key of its stats (the key result
    files carry) are the plan name, whatever letter asked for it."""
    model, _ = tiny_model("tiny-random-llama", "bf16")
    expected = {"A": ("bf16", PolicyPlan), "fp32": ("fp32", ShadowPlan), "F": ("fp16", ShadowPlan),
                "E": ("fp32_head", UpcastPlan), "guided": ("guided", UpcastPlan)}
    for asked, (name, cls) in expected.items():
        with make_plan(model, asked, layers=[0] if name == "guided" else None) as plan:
            assert type(plan) is cls and plan.name == name and plan.stats()["arm"] == name


# ------------------------------------------------------------------------------- bit-for-bit vs independent


def test_fp32_plan_equals_independent_fp32_model_bitwise(smollm2_bf16):
    policy, tok = smollm2_bf16
    ids, mask = _rows(tok)
    independent = _independent(load_model("smollm2", dtype="fp32")[0], torch.float32, policy)
    expected = token_logprobs(independent, ids, mask, K, batch_size=2)
    with make_plan(policy, "B") as plan:
        got = plan.token_logprobs(ids, mask, K, batch_size=2)
        assert plan.name == "fp32"
        # the shadow holds 4 bytes per parameter (tied weight once) plus the fp32 rotary buffers
        n_params = sum(p.numel() for p in policy.parameters())
        buffers = sum(b.numel() * b.element_size() for b in plan.shadow.buffers())
        assert plan.stats()["bytes_added"] == 4 * n_params + buffers
        assert plan.stats()["fp32_param_share"] == 1.0
    assert got.dtype == torch.float32 and got.shape == (len(TEXTS), K)
    assert torch.equal(got, expected)
    # and the plan is not just the bf16 policy: bf16 scoring differs from it
    assert not torch.equal(token_logprobs(policy, ids, mask, K, batch_size=2), got)


def _save_tiny(tmp_path, spec):
    model, tok = load_model(spec, dtype="fp32")
    model.save_pretrained(tmp_path)
    return type(model), tok


def test_fp16_plan_equals_independent_fp16_model_bitwise(tmp_path):
    # from_pretrained on both sides, as a user loads models (rotary buffers in fp32 in every dtype)
    cls, tok = _save_tiny(tmp_path, "tiny-random-qwen2")
    policy = cls.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    independent = _independent(
        cls.from_pretrained(tmp_path, dtype=torch.float16).eval(), torch.float16, policy
    )
    ids, mask = _rows(tok)
    expected = token_logprobs(independent, ids, mask, K, batch_size=3)
    with make_plan(policy, "F") as plan:
        got = plan.token_logprobs(ids, mask, K, batch_size=3)
        assert plan.shadow.lm_head.weight is plan.shadow.model.embed_tokens.weight  # still tied
        assert plan.shadow.lm_head.weight.dtype == torch.float16
        assert plan.stats()["fp32_param_share"] == 0.0 and plan.fp16_fallbacks == 0
    assert torch.equal(got, expected)
    assert not torch.equal(token_logprobs(policy, ids, mask, K, batch_size=3), got)


# ----------------------------------------------------------------------------- really runs in that precision


class _Wrapper(nn.Module):
    """Stands in for DDP / accelerate's prepared model: the policy under ``.module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.calls = 0

    def forward(self, **kwargs):
        self.calls += 1
        return self.module(**kwargs)


def _patch_like_accelerate(model):
    """What accelerate's mixed precision does: an instance-level forward that re-enters bf16 autocast."""
    original = model.forward

    def forward(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return original(*args, **kwargs)

    model._original_forward = original
    model.forward = forward
    return model


def _record_linear_dtypes(module):
    seen = []

    def hook(mod, args, out):
        seen.append((args[0].dtype, out.dtype))

    return seen, module.register_forward_hook(hook)


@pytest.mark.parametrize("arm,dtype", [("fp32", torch.float32), ("fp16", torch.float16)])
def test_shadow_runs_in_its_dtype_under_autocast_and_patched_forward(arm, dtype):
    # TRL-like policy: fp32 weights, forward patched to run under bf16 autocast, wrapped like DDP
    policy, tok = load_model("tiny-random-llama", dtype="fp32")
    reference = token_logprobs(policy, *_rows(tok), K)
    independent = _independent(load_model("tiny-random-llama", dtype="fp32")[0], dtype, policy)
    expected = token_logprobs(independent, *_rows(tok), K)
    wrapped = _Wrapper(_patch_like_accelerate(policy))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        baseline = make_plan(wrapped, "bf16").token_logprobs(*_rows(tok), K)
        assert wrapped.calls == 1  # arm A calls exactly what it was given
        plan = make_plan(wrapped, arm)
        assert "forward" not in plan.shadow.__dict__ and "_original_forward" not in plan.shadow.__dict__
        seen, handle = _record_linear_dtypes(plan.shadow.model.layers[0].mlp.down_proj)
        got = plan.token_logprobs(*_rows(tok), K)
        handle.remove()
    assert wrapped.calls == 1  # the shadow never calls the wrapped policy
    assert seen and all(s == (dtype, dtype) for s in seen)
    assert torch.equal(got, expected)
    assert not torch.equal(baseline, reference)  # the patched policy itself really runs in bf16
    if dtype == torch.float32:
        assert torch.equal(got, reference)


def test_fp32_head_and_guided_run_fp32_inside_bf16_autocast():
    policy, tok = load_model("tiny-random-llama", dtype="fp32")
    _patch_like_accelerate(policy)
    layers = decoder_layers(policy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = make_plan(policy, "guided", layers=[1])
        seen0, h0 = _record_linear_dtypes(layers[0].mlp.down_proj)
        seen1, h1 = _record_linear_dtypes(
            layers[1].mlp.down_proj
        )  # fp32 weights already: runs the live layer
        plan.token_logprobs(*_rows(tok), K)
        h0.remove(), h1.remove()
    assert seen0 and all(s == (torch.bfloat16, torch.bfloat16) for s in seen0)  # autocast: bf16 matmul
    assert seen1 and all(s == (torch.float32, torch.float32) for s in seen1)  # island: autocast off
    assert plan.stats()["bytes_added"] == 0  # fp32 weights are used in place, nothing copied


# ---------------------------------------------------------------------------------------- guided == fp32


@pytest.mark.parametrize(
    "spec", ["tiny-random-llama", "tiny-random-qwen2", "tiny-random-gpt_neox", "tiny-random-qwen2_moe"]
)
def test_guided_with_every_layer_equals_fp32_plan(tiny_model, spec):
    policy, tok = tiny_model(spec, "bf16")
    ids, mask = _rows(tok)
    n = len(decoder_layers(policy))
    fp32 = make_plan(policy, "fp32").token_logprobs(ids, mask, K, batch_size=3)
    guided = make_plan(policy, "guided", layers=list(range(n))).token_logprobs(ids, mask, K, batch_size=3)
    assert (guided - fp32).abs().max().item() <= 1e-6
    head_only = make_plan(policy, "fp32_head").token_logprobs(ids, mask, K, batch_size=3)
    assert (head_only - fp32).abs().max().item() > 1e-6  # the layers matter: the comparison can fail


def test_guided_every_layer_equals_fp32_on_smollm2(smollm2_bf16):
    policy, tok = smollm2_bf16
    ids, mask = _rows(tok)
    fp32 = make_plan(policy, "fp32").token_logprobs(ids, mask, K, batch_size=2)
    plan = make_plan(policy, "guided", layers=list(range(30)))
    guided = plan.token_logprobs(ids, mask, K, batch_size=2)
    assert (guided - fp32).abs().max().item() <= 1e-6
    # every decoder parameter, the final norm and the (tied) head run in fp32; only the embedding lookup does not
    total = sum(p.numel() for p in policy.parameters())
    embed = policy.get_input_embeddings().weight.numel()
    assert plan.stats()["fp32_param_share"] == pytest.approx((total - embed + embed) / (total + embed))


def test_fp32_head_accounting_on_tied_smollm2(smollm2_bf16):
    policy, _ = smollm2_bf16
    plan = make_plan(policy, "E")
    vocab, hidden = 49152, 576
    stats = plan.stats()
    assert stats["bytes_added"] == 4 * (vocab * hidden + hidden)  # fp32 head weight + fp32 final norm
    assert stats["fp32_param_share"] == pytest.approx(
        (vocab * hidden + hidden) / (134_515_008 + vocab * hidden)
    )
    assert stats["layers"] == []
    plan.close()


# ------------------------------------------------------------------------------------ sync after a step


def _train_step(policy, tok, optimizer):
    ids, mask = _rows(tok)
    loss = -token_logprobs(policy, ids, mask, K).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


@pytest.mark.parametrize("arm", ["fp32", "fp16"])
def test_shadow_sync_after_optimizer_step_in_place(arm):
    policy, tok = load_model("tiny-random-qwen2", dtype="fp32")  # tied embeddings
    dtype = torch.float32 if arm == "fp32" else torch.float16
    plan = make_plan(policy, arm)
    ptrs = {n: p.data_ptr() for n, p in plan.shadow.named_parameters()}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    _train_step(policy, tok, optimizer)
    stale = dict(plan.shadow.named_parameters())["model.embed_tokens.weight"]
    assert not torch.equal(stale, policy.model.embed_tokens.weight.to(dtype))  # the step changed the policy
    seconds = plan.sync(policy)
    assert seconds > 0 and plan.stats()["sync_seconds"] == seconds
    for name, p in plan.shadow.named_parameters():
        assert p.data_ptr() == ptrs[name], f"{name} was re-allocated"
        assert torch.equal(p, policy.get_parameter(name).detach().to(dtype)), name
    assert plan.shadow.lm_head.weight is plan.shadow.model.embed_tokens.weight
    fresh = make_plan(policy, arm).token_logprobs(*_rows(tok), K)
    assert torch.equal(plan.token_logprobs(*_rows(tok), K), fresh)


def _copy_ops_during(fn):
    """The aten ops whose name contains ``copy`` that ``fn()`` dispatches, with how many tensors each touched."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: list = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "copy" in str(func):
                ops.append((str(func), len(args[0]) if isinstance(args[0], (list, tuple)) else 1))
            return func(*args, **(kwargs or {}))

    with Log():
        fn()
    return ops


@pytest.mark.parametrize(("arm", "policy_dtype"), [("fp32", "fp32"), ("fp16", "fp32"), ("fp32", "bf16"),
                                                   ("fp16", "bf16")])
def test_shadow_sync_is_one_fused_copy_per_dtype(arm, policy_dtype):
    """sync copies every shadow tensor in one ``_foreach_copy_`` per (dtype, device) group, not a per-tensor loop;
    the result is bitwise an independent cast of the policy, in the same storage (tied embeddings once)."""
    policy, tok = load_model("tiny-random-qwen2", dtype=policy_dtype)  # tied embeddings
    dtype = torch.float32 if arm == "fp32" else torch.float16
    plan = make_plan(policy, arm)
    ptrs = {n: p.data_ptr() for n, p in plan.shadow.named_parameters()}
    _train_step(policy, tok, torch.optim.AdamW(policy.parameters(), lr=1e-2))
    ops = _copy_ops_during(lambda: plan.sync(policy))
    n_tensors = len(list(plan.shadow.parameters())) + len(list(plan.shadow.buffers()))
    # parameters in the policy's dtype, buffers (rotary inv_freq) in fp32: at most two groups
    assert {name for name, _ in ops} == {"aten._foreach_copy_.default"} and len(ops) <= 2, ops
    assert sum(count for _, count in ops) == n_tensors
    for name, p in plan.shadow.named_parameters():
        assert p.data_ptr() == ptrs[name], f"{name} was re-allocated"
        assert torch.equal(p, policy.get_parameter(name).detach().to(dtype)), name
    assert plan.shadow.lm_head.weight is plan.shadow.model.embed_tokens.weight


def test_shadow_sync_follows_replaced_parameters_and_refuses_other_shapes():
    """The copy list is cached per policy; a replaced parameter object (or another model) is picked up, and a
    policy of another shape still gets the one-line error."""
    policy, _ = load_model("tiny-random-llama", dtype="fp32")
    plan = make_plan(policy, "fp16")
    plan.sync(policy)
    layer = decoder_layers(policy)[0].mlp.up_proj
    layer.weight = nn.Parameter(torch.randn_like(layer.weight))
    plan.sync(policy)
    assert torch.equal(decoder_layers(plan.shadow)[0].mlp.up_proj.weight, layer.weight.detach().half())
    other, _ = load_model("tiny-random-llama", dtype="fp32")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    plan.sync(other)
    for name, p in plan.shadow.named_parameters():
        assert torch.equal(p, other.get_parameter(name).detach().half()), name
    wrong, _ = load_model("tiny-random-llama", dtype="fp32")
    up = decoder_layers(wrong)[1].mlp.up_proj
    up.weight = nn.Parameter(torch.zeros(up.weight.shape[0] + 1, up.weight.shape[1]))
    with pytest.raises(ValueError, match="up_proj.weight' is missing or has shape"):
        plan.sync(wrong)


@pytest.mark.parametrize("arm", ["fp32_head", "guided"])
def test_upcast_sync_after_optimizer_step_in_place(arm):
    policy, tok = load_model("tiny-random-qwen2", dtype="bf16")  # tied, low precision: copies are owned
    plan = make_plan(policy, arm, layers=[1]) if arm == "guided" else make_plan(policy, arm)
    owned = [p for clone, _ in plan._owned for p in clone.parameters()] + plan._head.owned_tensors()
    ptrs = [t.data_ptr() for t in owned]
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    _train_step(policy, tok, optimizer)
    assert not torch.equal(plan._head.weight32, policy.model.embed_tokens.weight.float())
    plan.sync(policy)
    assert [t.data_ptr() for t in owned] == ptrs
    assert torch.equal(plan._head.weight32, policy.model.embed_tokens.weight.float())
    for clone, live in plan._owned:
        for a, b in zip(clone.parameters(), live.parameters()):
            assert torch.equal(a, b.float())
    fresh = make_plan(policy, arm, layers=[1]) if arm == "guided" else make_plan(policy, arm)
    assert torch.equal(plan.token_logprobs(*_rows(tok), K), fresh.token_logprobs(*_rows(tok), K))


# ---------------------------------------------------------------------------- the policy is never touched


@pytest.mark.parametrize("arm", ["bf16", "fp32", "fp16", "fp32_head", "guided"])
def test_scoring_leaves_policy_grads_optimizer_and_tied_embedding_unchanged(arm):
    policy, tok = load_model("tiny-random-qwen2", dtype="bf16")
    embed, head = policy.model.embed_tokens.weight, policy.lm_head.weight
    assert embed is head
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    _train_step(policy, tok, optimizer)
    loss = -token_logprobs(policy, *_rows(tok), K).mean()
    loss.backward()  # grads present when scoring happens
    params = _snapshot(policy)
    grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    opt_state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    structure = [(n, id(m)) for n, m in policy.named_modules()]
    ptr = embed.data_ptr()
    plan = make_plan(policy, arm, layers=[0] if arm == "guided" else None)
    plan.token_logprobs(*_rows(tok), K, batch_size=2)
    plan.sync(policy)
    plan.token_logprobs(*_rows(tok), K)
    plan.close()
    _assert_same(policy, params)
    for n, p in policy.named_parameters():
        assert torch.equal(p.grad, grads[n]), f"grad of {n} changed"
    for p, s in optimizer.state.items():
        for key, value in s.items():
            assert torch.equal(value, opt_state[id(p)][key])
    assert policy.lm_head.weight is policy.model.embed_tokens.weight is embed and embed.data_ptr() == ptr
    assert embed.dtype == torch.bfloat16
    assert [(n, id(m)) for n, m in policy.named_modules()] == structure  # swaps undone
    for m in policy.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, f"hook left on {type(m).__name__}"
    assert output_head(policy)[2] is policy.lm_head


def test_upcast_swap_restored_when_scoring_raises():
    policy, tok = load_model("tiny-random-llama", dtype="bf16")
    structure = [(n, id(m)) for n, m in policy.named_modules()]
    plan = make_plan(policy, "guided", layers=[0, 1])
    ids, mask = _rows(tok)

    def bad_reduce(logits, targets, index):
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        plan.token_logprobs(ids, mask, K, reduce=bad_reduce)
    assert [(n, id(m)) for n, m in policy.named_modules()] == structure
    assert all(not m._forward_hooks for m in policy.modules())


# -------------------------------------------------------------------------------------------- fp16 guard


def _overflowing_policy():
    """A bf16 tiny model whose fp16 forward overflows on rows containing one token: that token's embedding
    row is scaled past fp16's max (65504), which bf16 (max ~3.4e38) holds; RMSNorm keeps bf16 finite."""
    policy, tok = load_model("tiny-random-llama", dtype="bf16")
    token = tok.convert_tokens_to_ids("Z")
    with torch.no_grad():
        policy.model.embed_tokens.weight[token] *= 1e8
    assert policy.model.embed_tokens.weight[token].abs().max() > 65504
    return policy, tok


@pytest.mark.parametrize("chunk_tokens", [None, 2])
@pytest.mark.parametrize("custom_reduce", [False, True])
def test_fp16_guard_rescores_overflowing_chunk_in_fp32(custom_reduce, chunk_tokens):
    """One re-score per overflowing chunk of rows, also when the chunk is scored in several tiles."""
    policy, tok = _overflowing_policy()
    texts = ["abc def", "Zebra crossing", "plain words", "the Z row"]
    ids, mask = _rows(tok, texts)
    bf16 = token_logprobs(policy, ids, mask, K, batch_size=1)
    assert torch.isfinite(bf16).all()
    calls = []

    def reduce(logits, targets, index):
        calls.append(index)
        return gather_logprobs(logits, targets)

    kwargs = {"reduce": reduce} if custom_reduce else {}
    kwargs["chunk_tokens"] = chunk_tokens
    unguarded = make_plan(policy, "fp16", fp16_guard=False).token_logprobs(
        ids, mask, K, batch_size=1, **kwargs
    )
    overflow_rows = [i for i in range(4) if not torch.isfinite(unguarded[i]).all()]
    assert overflow_rows == [1, 3]  # the rows with "Z" (the test's premise: fp16 really overflows there)
    calls.clear()
    plan = make_plan(policy, "fp16")
    with pytest.warns(RuntimeWarning, match="re-scoring that chunk in fp32"):
        got = plan.token_logprobs(ids, mask, K, batch_size=1, **kwargs)
    assert plan.fp16_fallbacks == 2 and plan.stats()["fp16_fallbacks"] == 2
    assert torch.isfinite(got).all()
    fp32 = make_plan(policy, "fp32").token_logprobs(ids, mask, K, batch_size=1, chunk_tokens=chunk_tokens)
    assert torch.equal(got[[1, 3]], fp32[[1, 3]])
    assert torch.equal(got[[0, 2]], unguarded[[0, 2]])
    if custom_reduce:  # the re-score passes the caller's reduce the rows of the full batch, tile by tile
        tiles = [(0, K)] if chunk_tokens is None else [(0, 2), (2, 4), (4, 6)]
        expected = [(r, r + 1, c0, c1) for r in (0, 1, 2, 3, 1, 3) for c0, c1 in tiles]
        assert [(r.start, r.stop, c.start, c.stop) for r, c in calls] == expected
    # the fallback copy is kept, counted and synced
    assert plan.stats()["bytes_added"] > 2 * sum(p.numel() for p in policy.parameters())
    plan.token_logprobs(ids, mask, K, batch_size=4)
    assert plan.fp16_fallbacks == 3  # one chunk of four rows
    plan.sync(policy)
    plan.close()


# --------------------------------------------------------------------- tiles of completion positions

PLAN_OPTIONS = {"bf16": {}, "fp32": {}, "fp16": {}, "fp32_head": {}, "guided": {"layers": [1]}}


def _kept_reducer(ids, keep, vocab):
    """A kept-set reducer over the last ``keep`` tokens: the target plus two other ids (some positions as
    sizes only)."""
    g = torch.Generator().manual_seed(0)
    targets = ids[:, -keep:]
    others = (targets.unsqueeze(-1) + torch.tensor([1, 2])) % vocab  # distinct from the target
    kept_ids = torch.cat([targets.unsqueeze(-1), others], dim=-1)
    kept_ids[:, 1::3] = -1
    return kept_reducer(kept_ids=kept_ids, sizes=torch.randint(1, 5, targets.shape, generator=g))


@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("arm", list(PLAN_OPTIONS))
def test_every_plan_tiled_equals_untiled_bit_for_bit(tiny_model, row_invariant_linear, arm, kept):
    """With a row-count-invariant matmul (conftest), tiles change nothing at all, for every plan, with and
    without kept-set renormalisation, for tiles of 1 .. K positions (K = 6; 4 and 5 do not divide it)."""
    policy, tok = tiny_model("tiny-random-llama", "bf16")
    ids, mask = _rows(tok)
    reduce = _kept_reducer(ids, K, policy.config.vocab_size) if kept else None
    plan = make_plan(policy, arm, **PLAN_OPTIONS[arm])
    untiled = plan.token_logprobs(ids, mask, K, batch_size=2, temperature=0.8, reduce=reduce, chunk_tokens=None)
    assert torch.isfinite(untiled).all()
    for chunk_tokens in (2, 8, 10, 12):  # 2 rows per chunk: tiles of 1, 4, 5 and 6 positions
        tiled = plan.token_logprobs(ids, mask, K, batch_size=2, temperature=0.8, reduce=reduce,
                                    chunk_tokens=chunk_tokens)
        assert torch.equal(tiled, untiled), chunk_tokens
    plan.close()


@pytest.mark.parametrize("arm", list(PLAN_OPTIONS))
def test_every_plan_bounds_its_largest_logits_tensor(tiny_model, largest_vocab_tensor, arm):
    """Real kernels: the largest vocabulary-wide tensor of a plan's pass is rows x tile x V, and the values
    equal the untiled pass (bit for bit for bf16 logits; fp32 matmuls may differ in the last bit when the
    row count changes, as between any two batch shapes)."""
    policy, tok = tiny_model("tiny-random-llama", "bf16")
    vocab = policy.config.vocab_size
    ids, mask = _rows(tok)
    plan = make_plan(policy, arm, **PLAN_OPTIONS[arm])
    reduce = _kept_reducer(ids, K, vocab)
    with largest_vocab_tensor(vocab) as untiled_probe:
        untiled = plan.token_logprobs(ids, mask, K, batch_size=2, reduce=reduce, chunk_tokens=None)
    with largest_vocab_tensor(vocab) as tiled_probe:
        tiled = plan.token_logprobs(ids, mask, K, batch_size=2, reduce=reduce, chunk_tokens=8)
    assert untiled_probe.largest == 2 * (K + 1) * vocab  # the full [rows, K + 1, V] logits
    assert tiled_probe.largest == 2 * 4 * vocab  # 8 tokens: 2 rows x 4 positions (tiles of 4 and 2)
    if arm == "bf16":
        assert torch.equal(tiled, untiled)
    torch.testing.assert_close(tiled, untiled, rtol=0, atol=1e-6)
    plan.close()


def test_bf16_plan_is_the_policy_itself(tiny_model):
    policy, tok = tiny_model("tiny-random-gpt_neox", "bf16")
    ids, mask = _rows(tok)
    plan = make_plan(policy, "A")
    assert torch.equal(
        plan.token_logprobs(ids, mask, K, batch_size=2), token_logprobs(policy, ids, mask, K, batch_size=2)
    )
    assert plan.sync(policy) >= 0 and plan.stats()["bytes_added"] == 0
    assert plan.stats()["fp32_param_share"] == 0.0
    plan.close()


# ------------------------------------------------------------------------------------ the cost benchmark


def _check_tables(payload, name):
    assert payload["benchmark"] == name and payload["schema_version"] == 1
    assert {"env", "params", "results", "tables"} <= set(payload)
    for table in payload["tables"]:
        assert {"id", "title", "columns", "rows", "notes", "reference", "random_init"} <= set(table)
        assert all(len(row) == len(table["columns"]) for row in table["rows"])


def test_cost_benchmark_quick(tmp_path):
    import json

    from benchmarks import cost as module

    seq = 16  # tokens a row, the last seq // 2 scored; one timed pass per arm, no warm-up (the structure is checked)
    # 7 decoder layers: the fewest for which the guided plan's layers (0-4, 8, 9 and the last) leave one out (layer
    # 5), so its fp32 share lies strictly between the fp32 head's and all fp32's
    argv = ["--quick", "--passes", "1", "--warmup", "0", "--seq", str(seq), "--layers", "7", "--device", "cpu",
            "--out", str(tmp_path)]
    assert module.main(argv) == 0
    payload = json.loads((tmp_path / "cost.json").read_text())
    _check_tables(payload, "cost")
    for shape in payload["results"]["shapes"]:
        arms = {a["plan"]: a for a in shape["arms"]}
        assert arms["bf16"]["rel_time"] == 1.0 and arms["bf16"]["sync_seconds"] is None
        assert arms["all fp32"]["fp32_param_share"] == 1.0 and arms["all fp32"]["sync_seconds"] > 0
        # the fused sync next to the per-tensor loop it replaced, as shares of a generation-batch pass
        for label in ("all fp32", "fp16 plan"):
            assert arms[label]["sync_loop_seconds"] > 0 and 0 < arms[label]["sync_frac_of_gen_batch_pass"]
        assert arms["fp32 head"]["sync_loop_seconds"] is None  # no shadow: nothing to compare
        # every fp32 plan with the plan option tf32 off and on
        for label in ("all fp32", "fp32 head", f"guided-{len(shape['guided_layers'])} + head"):
            assert arms[label]["tf32"] is False and arms[f"{label} (TF32)"]["tf32"] is True
        # the fp32 shadow holds 4 bytes per (unique) parameter plus fp32 buffers
        assert arms["all fp32"]["bytes_added"] >= 4 * shape["n_params"]
        assert shape["n_layers"] == 7 and shape["guided_layers"] == [0, 1, 2, 3, 4, 6]
        assert 0 < arms["fp32 head"]["fp32_param_share"] < arms["guided-6 + head"]["fp32_param_share"] < 1
        assert shape["fp16_plan_over_raw_fp16"] > 0
        # memory columns: TRL's own pass is the baseline; on CPU the peak of live tensor bytes (TensorPeak)
        trl = arms["TRL fused head (baseline)"]
        assert trl["arm"] == "trl" and trl["chunk_tokens"] is None and trl["tokens_per_s"] > 0
        assert trl["pass_peak_vs_trl"] == 1.0 and "TensorPeak" in trl["memory_method"]
        assert arms["fp32 head"]["chunk_tokens"] == DEFAULT_CHUNK_TOKENS
        assert arms["fp32 head (untiled)"]["chunk_tokens"] == 0
        assert all(a["pass_peak_abs_gib"] is None and a["pass_peak_gib"] > 0 for a in shape["arms"])
        # TRL's [min(N, 4096), 32768] bf16 tile buffer is live during its pass (N = 2 rows x (seq - 1) positions)
        assert trl["pass_peak_gib"] * 2**30 >= 2 * (seq - 1) * 32768 * 2
        # the untiled fp32-head pass holds the fp32 [2, K + 1, V] logits (K = seq // 2 scored) at least
        untiled_bytes = arms["fp32 head (untiled)"]["pass_peak_gib"] * 2**30
        assert untiled_bytes >= 2 * (seq // 2 + 1) * shape["vocab"] * 4
        # the CUDA memory model drops TRL's fp32 fold copies, never adds
        assert 0 < arms["TRL fused head, CUDA memory model"]["pass_peak_gib"] < trl["pass_peak_gib"]
    assert {"pass peak GiB", "pass peak vs TRL", "TF32", "sync loop ms"} <= set(payload["tables"][0]["columns"])


# ------------------------------------------------------------------------------------------------------- TF32


def _matmul_settings() -> dict:
    """Every TF32-related torch setting as readable now (``"unreadable"`` where torch refuses a mixed state)."""
    getters = {
        "legacy_precision": torch._C._get_float32_matmul_precision,
        "cuda.matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
    }
    for path in ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv"):
        owner = torch.backends
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part)
        getters[f"{path or 'backends'}.fp32_precision"] = lambda owner=owner: owner.fp32_precision
    out = {}
    for name, get in getters.items():
        try:
            out[name] = get()
        except RuntimeError:
            out[name] = "unreadable"
    return out


CALLER_SETTINGS = {
    "default": lambda: None,
    "legacy on": lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
    "new api cuda on": lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
    "transformers tf32": lambda: setattr(torch.backends, "fp32_precision", "tf32"),  # enable_tf32(True), torch>=2.9
    "medium": lambda: torch.set_float32_matmul_precision("medium"),
}


@pytest.fixture
def caller_tf32():
    """Yields a setter of the caller's TF32 state; the process's state is put back afterwards (in a fresh order)."""
    saved_legacy = torch._C._get_float32_matmul_precision()
    saved = {path: _owner_precision(path) for path in ("", "cuda.matmul", "cudnn", "mkldnn")}
    yield lambda name: CALLER_SETTINGS[name]()
    torch.set_float32_matmul_precision(saved_legacy)
    for path, value in saved.items():
        _set_owner_precision(path, value)


def _owner_precision(path):
    owner = torch.backends
    for part in filter(None, path.split(".")):
        owner = getattr(owner, part)
    return owner.fp32_precision


def _set_owner_precision(path, value):
    owner = torch.backends
    for part in filter(None, path.split(".")):
        owner = getattr(owner, part)
    owner.fp32_precision = value


@pytest.mark.parametrize("caller", list(CALLER_SETTINGS))
@pytest.mark.parametrize(("arm", "tf32"), [("fp32", True), ("fp32", False), ("fp32_head", True), ("guided", False),
                                           ("fp32", "auto")])
def test_tf32_set_inside_the_plans_forward_only(tiny_model, caller_tf32, caller, arm, tf32):
    """A forward hook sees the plan's TF32 choice (legacy flag and new API agree, as cuBLAS requires); after the
    call, and after a call whose forward raises, every setting is the caller's again."""
    policy, tok = tiny_model("tiny-random-llama", "bf16")  # shared: the hooks put on it are taken off again
    plan = make_plan(policy, arm, tf32=tf32, **({"layers": [0]} if arm == "guided" else {}))
    expected = False if tf32 == "auto" else tf32  # auto on a CPU: no TF32 units
    assert plan.tf32 is expected and plan.stats()["tf32"] is expected
    caller_tf32(caller)
    before = _matmul_settings()
    seen = []
    model = plan.shadow if arm == "fp32" else policy

    def look(module, args, output):
        seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cuda.matmul.fp32_precision))

    handle = model.register_forward_hook(look)
    try:
        plan.token_logprobs(*_rows(tok), K)
    finally:
        handle.remove()
    assert seen and all(s == (expected, "tf32" if expected else "ieee") for s in seen), seen
    assert _matmul_settings() == before

    def fail(module, args, output):
        raise RuntimeError("forward failed")

    handle = model.register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="forward failed"):
            plan.token_logprobs(*_rows(tok), K)
    finally:
        handle.remove()
    assert _matmul_settings() == before
    plan.close()


def test_tf32_left_alone_by_bf16_and_fp16_plans_and_checked(caller_tf32):
    policy, tok = load_model("tiny-random-llama", dtype="fp32")
    caller_tf32("legacy on")
    for arm in ("bf16", "fp16"):
        plan = make_plan(policy, arm, tf32=False)
        assert plan.tf32 is None
        seen: list = []
        handle = (plan.shadow if arm == "fp16" else policy).register_forward_hook(
            lambda m, a, o, seen=seen: seen.append(torch.backends.cuda.matmul.allow_tf32))
        plan.token_logprobs(*_rows(tok), K)
        handle.remove()
        assert seen and all(seen), arm  # the caller's TF32 stays on inside
    # the fp16 guard's fp32 re-score takes the plan's choice
    with pytest.warns(RuntimeWarning, match="re-scoring that chunk in fp32"):
        assert make_plan(policy, "fp16", tf32=True)._fp32_fallback().tf32 is True
    with pytest.raises(ValueError, match="tf32 must be True, False or 'auto'"):
        make_plan(policy, "fp32", tf32="yes")


def test_cost_benchmark_memory_only(tmp_path):
    import json

    from benchmarks import cost as module

    argv = ["--quick", "--memory-only", "--skip-fp16", "--shapes", "tiny-llama", "--layers", "1", "--seq", "16"]
    assert module.main([*argv, "--device", "cpu", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "cost_memory.json").read_text())
    _check_tables(payload, "cost_memory")
    assert not (tmp_path / "cost.json").exists()
    (table,) = payload["tables"]
    assert table["id"] == "T7c-memory" and "CPU" in table["notes"] and "30-80x" in table["notes"]
    (shape,) = payload["results"]["shapes"]
    assert shape["n_layers"] == 1
    letters = [a["arm_letter"] for a in shape["arms"]]
    assert letters == ["C", "A", "A", "E", "E", "D", "B", "D", "B"]  # no F: --skip-fp16
    assert all(a["pass_seconds"] is None and a["sync_seconds"] is None for a in shape["arms"])
    assert [a["rows_per_forward"] for a in shape["arms"]] == [2] * 7 + [1, 1]  # --batch 2, then half
    by_plan = {row[2]: row for row in table["rows"]}
    assert by_plan["TRL fused head (baseline)"][4] == 1.0
    assert by_plan["TRL fused head, CUDA memory model"][5] == 1.0


def test_cost_memory_without_matmul_arithmetic_measures_the_same_tensors(tmp_path):
    """--skip-matmul-arithmetic (zeros of the real size instead of computing) gives every arm exactly the
    pass peak of the real computation, fp16 included."""
    import json

    from benchmarks import cost as module

    # one decoder layer: every op a layer runs is compared; more layers repeat the same ops
    argv = ["--quick", "--memory-only", "--shapes", "tiny-qwen2-tied", "--layers", "1", "--seq", "16", "--device", "cpu"]
    peaks = {}
    for extra in ([], ["--skip-matmul-arithmetic"]):
        out = tmp_path / ("skip" if extra else "real")
        assert module.main([*argv, *extra, "--out", str(out)]) == 0
        (shape,) = json.loads((out / "cost_memory.json").read_text())["results"]["shapes"]
        peaks[bool(extra)] = {a["plan"]: a["pass_peak_gib"] for a in shape["arms"]}
    assert "fp16 plan" in peaks[False] and len(peaks[False]) == 11
    assert peaks[True] == peaks[False]


def test_cost_trl_cuda_memory_model_keeps_trl_values_and_drops_only_the_fold_copies():
    """The CUDA memory model of TRL's pass (labelled positions only, fold untracked) scores the same log-probs
    as TRL's CPU pass, and is restored afterwards."""
    import trl.kernels.chunked_logprob as kernels
    import trl.trainer.utils as trl_utils

    from benchmarks import cost as module
    from benchmarks._lib.shapes import build_shape

    policy = build_shape("tiny-llama", torch.device("cpu"), layers=2)
    ids = torch.randint(100, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    fold, use_triton = kernels._forward_tile, trl_utils._use_triton
    values = {}
    for cuda_like in (False, True):
        fn, remove = module.trl_old_logprob_pass(policy, ids, mask, 16, 2, cuda_like=cuda_like)
        values[cuda_like] = fn()
        remove()
    assert values[True].shape == (2, 16)
    assert torch.equal(values[True], values[False])  # bf16 head tiles: same values whatever the row count here
    assert kernels._forward_tile is fold and trl_utils._use_triton is use_triton
    assert "forward" not in policy.__dict__


def test_plans_that_copy_weights_refuse_deepspeed_zero3_slices():
    """ZeRO-3 leaves each parameter an empty slice outside its module's forward (``ds_id`` marks it): a copy made
    from it is empty or stale (by hand on CPU: B failed to build, E's fp32 head froze at the first weights)."""
    model, _ = load_model("tiny-random-llama", dtype="fp32")
    for index, param in enumerate(model.parameters()):
        param.ds_id = index  # what deepspeed.zero.Init sets on every parameter it partitions
    for name in ("fp32", "fp16", "fp32_head", "guided"):
        with pytest.raises(ValueError, match=rf"plan '{name}' copies the policy's weights, but its parameters are "
                                              r"DeepSpeed ZeRO-3 slices .*FSDP2"):
            make_plan(model, name, layers=[0] if name == "guided" else None)
    make_plan(model, "bf16").close()  # the policy as called: no copy, allowed
