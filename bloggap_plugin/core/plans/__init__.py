"""Scoring plans for the old-logprob pass: in which precision the policy scores its own tokens.

``make_plan(policy, name)`` returns a :class:`ScoringPlan`; ``plan.token_logprobs(...)`` scores through
:func:`bloggap_plugin.core.scoring.token_logprobs` (the one scoring function) and returns ``[B, K]`` fp32.

Plans (:data:`PLANS`: each entry's builder and capabilities, :class:`PlanEntry`; recipes may use the arm letters,
:mod:`bloggap_plugin.core.arms`), one module each:

- ``bf16`` (:mod:`.policy`, arm A/C): the policy as is, whatever dtype / autocast it runs in. Adds nothing.
- ``fp32`` / ``fp16`` (:mod:`.shadow`, arms B/F): a clean copy of the policy in that dtype, refreshed in place.
- ``fp32_head`` / ``guided`` (:mod:`.upcast`, arms E/D): fp32 islands swapped into the live policy for one call.
- ``vllm`` (:mod:`.vllm_shadow`, arm I): a bf16 shadow scored the way vLLM computes (pieces switchable,
  docs/arm_i.md).

:mod:`.base` holds what they share: the fp16 guard (when a plan computes in fp16, a chunk with a non-finite value
is re-scored in fp32 through the same ``token_logprobs`` and counted in ``plan.fp16_fallbacks``; the fp32 model for
this is built on the first overflow and kept, and synced) and TF32 (:mod:`.tf32`; ``make_plan(..., tf32=)``,
``gap.tf32``): plans that compute in fp32 (``fp32``, ``fp32_head``, ``guided`` and the fp16 guard's re-score) set
CUDA's fp32 matmul precision for their own forward only. ``True``: TF32; ``False`` (default): IEEE fp32 whatever
the process-wide flag says; ``"auto"``: TF32 on a GPU with TF32 units (compute capability >= 8.0), IEEE fp32
otherwise. Plan ``bf16`` runs the policy as called, under the caller's setting, and the fp16 shadow has no fp32
matmuls: neither touches the setting.

Scoring always runs under ``torch.no_grad()`` (old log-probs are constants), and never changes the policy's
parameters, gradients, optimizer state or tied embeddings.
"""

from .base import ScoringPlan
from .registry import PLANS, REFERENCE_PLAN, PlanEntry, PlanOptions, arm_plan_entry, make_plan, plan_entry
from .tf32 import TF32_MODES, cuda_matmul_tf32, resolve_tf32

__all__ = ["PLANS", "REFERENCE_PLAN", "TF32_MODES", "PlanEntry", "PlanOptions", "ScoringPlan", "arm_plan_entry",
           "cuda_matmul_tf32", "make_plan", "plan_entry", "resolve_tf32"]
