"""The arm registry: one frozen record per old-logprob arm A..J, read by recipes, precision plans and the adapters.

An *arm* is how the plugin obtains the old log-probs of a GRPO step (DESIGN notes in README/docs). Code decides
arm behaviour by reading an :class:`ArmSpec`'s fields, never by comparing letters::

    arm = get_arm("matched")          # -> ARMS["G"]
    if arm.scores_after_shuffle: ...

Pure Python (no torch, no TRL): the plans and everything above them read it.

Two vocabularies share the names, and both resolve here:

- **arm names** (:func:`get_arm`): the letters A..J, case-insensitive, or an arm's aliases (``bf16`` = C,
  ``fp32`` = B, ``fp16`` = F, ``fp32_head`` = E, ``guided`` = D, ``matched`` = G, ``default`` = A, ``vllm`` = I, ``onpolicy`` = J);
- **precision-plan names** (:func:`plan_name`, what ``core.plans.make_plan`` accepts): the plan names
  :data:`PLAN_NAMES`, or the letter of an arm that has a plan (B, C, D, E, F, I, J -> its ``plan``). ``make_plan``
  also keeps accepting ``A`` for the ``bf16`` plan (:data:`PLAN_ALIASES`): arm A itself builds no plan and
  keeps TRL's forward, which is the policy run as called, exactly what the ``bf16`` plan does.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ArmSpec", "ARMS", "ARM_LETTERS", "PLAN_NAMES", "PLAN_ALIASES", "get_arm", "plan_name"]


@dataclass(frozen=True)
class ArmSpec:
    """What one arm does; every field is read by the code that branches on it."""

    letter: str
    """``A`` .. ``J``."""
    description: str
    """What the arm does in the old-logprob pass (one line)."""
    plan: str | None = None
    """The precision plan (:data:`PLAN_NAMES`) that scores the arm's old log-probs; ``None``: no plan (TRL's
    forward scores them)."""
    keeps_trl_forward: bool = False
    """TRL's training forward stays untouched (positions 0..L-1, whatever ``gap.positions`` says) and TRL's own
    old log-probs are used where TRL computes them."""
    scores_after_shuffle: bool = False
    """Scores each buffered training micro-batch after TRL's shuffle, as one chunk, in place of TRL's own pass."""
    replaces_trl_old_pass: bool = False
    """Where TRL runs its own old-logprob pass, it is skipped (a placeholder stands in) and the arm's scores take
    its place; the replacing pass's time is TRL's cost (``gap/time/old_pass_s``), not the plugin's."""
    needs_fp16_training: bool = False
    """Rollout, old log-probs and training all in fp16 (``GRPOConfig.fp16: true``; vLLM samples in fp16)."""
    scores_above_fp16: bool = False
    """The plan scores in more than fp16 precision (fp32 body or fp32 head)."""
    takes_layers: bool = False
    """``gap.layers`` / ``gap.k`` choose the decoder layers its plan runs in fp32."""
    copies_weights: bool = False
    """Its plan holds its own copy of (some of) the policy's weights, a shadow or fp32 islands, built from the
    policy's parameters and synced with them (refused under DeepSpeed ZeRO-3, whose parameters are slices)."""
    vllm_engine: tuple[tuple[str, object], ...] = ()
    """Settings the arm needs in TRL's colocate vLLM engine, as ``(LLM keyword, value)`` pairs: the engine
    :class:`~bloggap_plugin.trl.GapGRPOTrainer` builds gets them, and attaching to a trainer whose engine differs
    is refused, naming each one."""
    prefill_in_one_step: bool = False
    """The arm computes a generation's prompts as one prefill launch: the colocate engine must prefill every prompt
    of a generation in its first step (``max_num_batched_tokens`` of ``max_num_seqs x max_model_len``, capped by the
    TRL adapter), not in chunks mixed with decode steps."""
    onpolicy_forward: bool = False
    """The policy's training forward (TRL's ``_get_per_token_logps_and_entropies`` inside the loss) is the arm's
    vLLM-form forward over the policy's own parameters (:class:`~bloggap_plugin.core.plans.vllm_shadow.OnPolicyForward`)
    instead of TRL's: the new log-probs are computed as the old ones are, so the PPO ratio is exactly 1 at each
    generation's first iteration."""
    aliases: tuple[str, ...] = ()
    """Other names a recipe may use for this arm (lower case)."""


_VLLM_FORM = dict(
    # eager: vLLM's compiled forward (torch.compile, CUDA graphs) fuses the norms and activations into kernels the
    # vLLM-form forward does not run; no prefix caching: a cache hit changes a prefill's launch size, which sets the
    # RMSNorm kernel's summation order for every prompt token's keys and values; one prefill step: TRL's 4096 tokens
    # per step chunk a larger generation's prompts into steps mixed with decodes
    vllm_engine=(("enforce_eager", True), ("enable_prefix_caching", False)), prefill_in_one_step=True,
    replaces_trl_old_pass=True,
)
"""What arms I and J (old log-probs computed as vLLM computes them) need of TRL's engine and pass."""

_RECORDS = (
    ArmSpec("A", "trainer default: TRL's own old log-probs (bf16 autocast, chunks of per_device_train_batch_size)",
            keeps_trl_forward=True, aliases=("default",)),
    ArmSpec("B", "fp32 shadow copy of the policy", plan="fp32", scores_above_fp16=True, copies_weights=True,
            aliases=("fp32",)),
    ArmSpec("C", "policy as is, chunk = micro-batch, through the plugin's scoring (gap.positions)", plan="bf16",
            aliases=("bf16",)),
    ArmSpec("D", "bf16 + divergence-guided fp32 layers + fp32 norm/head", plan="guided", scores_above_fp16=True,
            takes_layers=True, copies_weights=True, aliases=("guided",)),
    ArmSpec("E", "bf16 + fp32 final norm and LM head", plan="fp32_head", scores_above_fp16=True,
            copies_weights=True, aliases=("fp32_head",)),
    ArmSpec("F", "fp16 shadow copy of the policy", plan="fp16", copies_weights=True, aliases=("fp16",)),
    ArmSpec("G", "matched: each buffered training micro-batch scored as one chunk after TRL's shuffle",
            scores_after_shuffle=True, replaces_trl_old_pass=True, aliases=("matched",)),
    ArmSpec("H", "fp16 everywhere: rollout, old log-probs and training in fp16 autocast with loss scaling",
            keeps_trl_forward=True, needs_fp16_training=True),
    ArmSpec("I", "vLLM's numbers: bf16 shadow scored the way vLLM computes (batch-invariant kernels, its "
            "FlashAttention, norms, RoPE; gap.i_pieces)", plan="vllm", copies_weights=True, aliases=("vllm",),
            **_VLLM_FORM),
    ArmSpec("J", "exactly on-policy: old log-probs and the training forward in vLLM's numbers", plan="vllm",
            aliases=("onpolicy",), onpolicy_forward=True,
            # arm I's old log-probs (scored over the policy's own parameters: no copy), engine and replaced TRL pass;
            # the training forward in the same form
            **_VLLM_FORM),
)

ARMS: dict[str, ArmSpec] = {arm.letter: arm for arm in _RECORDS}
"""Letter -> record, in order A..J."""
ARM_LETTERS: tuple[str, ...] = tuple(ARMS)
PLAN_NAMES: tuple[str, ...] = ("bf16", "fp32", "fp16", "fp32_head", "guided", "vllm")
"""The precision plans ``core.plans.make_plan`` builds."""
PLAN_ALIASES: dict[str, str] = {"A": "bf16", **{arm.letter: arm.plan for arm in _RECORDS if arm.plan is not None}}
"""Letters ``make_plan`` accepts for a plan: each planned arm's letter, plus ``A`` for the policy as called."""
_BY_ALIAS = {alias: arm for arm in _RECORDS for alias in arm.aliases}


def _accepted() -> str:
    aliases = ", ".join(f"{alias}={arm.letter}" for alias, arm in _BY_ALIAS.items())
    return f"{', '.join(ARM_LETTERS)} (or an alias: {aliases})"


def get_arm(name: str | ArmSpec) -> ArmSpec:
    """The record of arm ``name``: a letter (any case), an alias, or a record (returned as is).

    Raises ``ValueError`` naming the valid arms for anything else."""
    if isinstance(name, ArmSpec):
        return name
    if isinstance(name, str):
        found = ARMS.get(name.upper()) or _BY_ALIAS.get(name.lower())
        if found is not None:
            return found
    raise ValueError(f"unknown arm {name!r}; use one of {_accepted()}")


def plan_name(name: str) -> str:
    """The precision-plan name for ``name``: a plan name (any case) or an arm letter with a plan (see the module
    docstring). Raises ``ValueError`` listing what is accepted."""
    if isinstance(name, str):
        if name.lower() in PLAN_NAMES:
            return name.lower()
        if name.upper() in PLAN_ALIASES:
            return PLAN_ALIASES[name.upper()]
    accepted = ", ".join(PLAN_NAMES) + " (or " + ", ".join(f"{k}={v}" for k, v in PLAN_ALIASES.items()) + ")"
    raise ValueError(
        f"unknown scoring arm {name!r}; accepted: {accepted}. Arms G and H are trainer-level "
        "(matched batches, fp16 everywhere) and have no plan of their own"
    )
