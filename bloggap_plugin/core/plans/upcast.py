"""Plans ``fp32_head`` (arm E) and ``guided`` (arm D): fp32 islands swapped into the live policy for one call.

For the duration of one ``token_logprobs`` call the chosen modules (the final norm and LM head; for ``guided`` also
the chosen decoder layers) are swapped for fp32 islands (fp32 copies, or the live module itself when its weights
are already fp32) that cast their inputs to fp32 and run with autocast disabled; a layer casts its output back to
the residual stream's dtype only where the next layer stays in low precision. The swap is undone in ``finally``;
no hook or module stays on the policy between calls. Memory: 4 bytes per upcast parameter (the head's ``V x H``
weight included) instead of a full copy of the model. A tied head is projected with a detached fp32 copy of the
shared weight, refreshed on ``sync``; the embedding is never mutated. Rotary position embeddings entering an fp32
layer are recomputed in fp32 (not the rounded bf16 cos/sin), so a plan with every layer upcast equals the fp32
shadow. Build them with :func:`~bloggap_plugin.core.plans.make_plan`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..model_parts import (
    FusedCopy,
    cast_floating,
    executed_numel,
    final_norm,
    first_floating,
    floating_dtype,
    layer_list_path,
    model_device,
    module_copy,
    parent_of,
    tensor_bytes,
)
from ..scoring import output_head
from ..sharding import full_value, is_dtensor
from .base import ScoringPlan
from .shadow import fp32_shadow

__all__ = ["UpcastPlan"]


class _Fp32Island(nn.Module):
    """Runs ``inner`` in fp32 (inputs cast, autocast off); casts the output back to the residual dtype when
    ``cast_back``. ``state`` is shared by the plan's islands during one call."""

    def __init__(self, inner: nn.Module, state: dict, starts_chain: bool, cast_back: bool) -> None:
        super().__init__()
        self.inner = inner
        self._state = state
        self._starts_chain = starts_chain
        self._cast_back = cast_back

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        first = first_floating((args, kwargs))
        if self._starts_chain and first is not None:
            self._state["residual_dtype"] = first.dtype
        rope = self._state.get("rope")
        if rope is not None and kwargs.get("position_embeddings") is rope[0]:
            kwargs["position_embeddings"] = rope[1]
        args = cast_floating(args, torch.float32)
        kwargs = cast_floating(kwargs, torch.float32)
        device_type = first.device.type if first is not None else "cpu"
        with contextlib.ExitStack() as stack:
            for dt in {device_type, "cpu"}:
                stack.enter_context(torch.autocast(device_type=dt, enabled=False))
            out = self.inner(*args, **kwargs)
        if self._cast_back:
            out = cast_floating(out, self._state.get("residual_dtype", torch.bfloat16))
        return out


class _Fp32Head(nn.Module):
    """fp32 projection with a detached fp32 copy of the head weight (never the shared tensor itself)."""

    def __init__(self, head: nn.Module, sharded: bool = False) -> None:
        """``sharded``: the policy is sharded (FSDP2), even if this head's unit holds gathered tensors right now."""
        super().__init__()
        self.in_features = head.weight.shape[1]
        self.out_features = head.weight.shape[0]
        # a sharded (FSDP2) weight: a full fp32 copy gathered from the shards, refreshed (gathered) on sync. Never
        # an alias under FSDP2: a unit left gathered holds a plain full tensor that its next reshard frees
        self.owns_weight = head.weight.dtype != torch.float32 or sharded or is_dtensor(head.weight)
        weight = full_value(head.weight.detach())
        self.register_buffer(
            "weight32", weight.float().clone() if self.owns_weight else weight, persistent=False
        )
        bias = getattr(head, "bias", None)
        self.owns_bias = bias is not None and (bias.dtype != torch.float32 or sharded or is_dtensor(bias))
        if bias is None:
            self.bias32 = None
        else:
            bias = full_value(bias.detach())
            self.register_buffer(
                "bias32", bias.float().clone() if self.owns_bias else bias, persistent=False
            )

    @property
    def weight(self) -> torch.Tensor:
        return self.weight32

    def refresh(self, head: nn.Module) -> None:
        if self.owns_weight:
            self.weight32.copy_(full_value(head.weight))
        if self.owns_bias:
            self.bias32.copy_(full_value(head.bias))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with contextlib.ExitStack() as stack:
            for dt in {hidden.device.type, "cpu"}:
                stack.enter_context(torch.autocast(device_type=dt, enabled=False))
            return nn.functional.linear(hidden.float(), self.weight32, self.bias32)

    def owned_tensors(self) -> list[torch.Tensor]:
        out = [self.weight32] if self.owns_weight else []
        return out + ([self.bias32] if self.owns_bias else [])


class UpcastPlan(ScoringPlan):
    """Arms E/D on the live policy: fp32 islands swapped in for one call (see the module docstring)."""

    def __init__(
        self, policy: nn.Module, name: str, layers: Sequence[int], fp16_guard: bool, tf32: bool | str = False
    ) -> None:
        super().__init__(policy, name, fp16_guard, tf32)
        source = self._source
        layer_path, layer_list = layer_list_path(source)
        self._layer_list = layer_list
        n_layers = len(layer_list)
        self.layers = sorted(int(i) for i in layers)
        self._low_dtype = floating_dtype(source)
        self._state: dict = {}
        self._owned: list[tuple[nn.Module, nn.Module]] = []  # (fp32 copy, live module) refreshed on sync
        self._copy = FusedCopy()
        self._swaps: list[tuple[nn.Module, str, nn.Module, nn.Module]] = []  # (parent, key, live, island)
        chosen = set(self.layers)
        device = model_device(source)
        for i in self.layers:
            live = layer_list[i]
            inner = self._fp32_version(live, device)
            island = _Fp32Island(
                inner,
                self._state,
                starts_chain=(i - 1) not in chosen,
                cast_back=(i + 1) in range(n_layers) and (i + 1) not in chosen,
            )
            self._swaps.append((layer_list, str(i), live, island))
        norm = final_norm(source)
        self._norm_numel = 0
        if norm is not None:
            parent, key, live = norm
            island = _Fp32Island(
                self._fp32_version(live, device), self._state, starts_chain=False, cast_back=False
            )
            self._swaps.append((parent, key, live, island))
            self._norm_numel = sum(p.numel() for p in live.parameters())
        parent, key, head = output_head(source)
        if getattr(head, "weight", None) is None or head.weight.dim() != 2:
            raise ValueError(
                f"the LM head {type(head).__name__} has no 2-D weight; fp32_head/guided cannot project it"
            )
        self._head = _Fp32Head(head, sharded=self.sharded)
        self._head_live = head
        self._swaps.append((parent, key, head, self._head))
        self._rope = self._find_rope(source, layer_path)
        self._layer_numel = sum(sum(p.numel() for p in layer_list[i].parameters()) for i in self.layers)

    @staticmethod
    def _find_rope(source: nn.Module, layer_path: str) -> nn.Module | None:
        base = parent_of(source, layer_path)
        rope = base._modules.get("rotary_emb")
        return rope if isinstance(rope, nn.Module) else None

    def _fp32_version(self, live: nn.Module, device: torch.device) -> nn.Module:
        params = list(live.parameters())
        # already fp32 (fp32 weights under autocast): run it as is, autocast off; a sharded (FSDP2) module is
        # copied (gathered) instead: FSDP's mixed precision would gather its fp32 shards in the compute dtype
        # (the plan's source decides: a unit left gathered holds plain tensors, see _Fp32Head)
        if params and all(p.dtype == torch.float32 for p in params if p.is_floating_point()) and not self.sharded:
            return live
        clone = module_copy(live, torch.float32, device)
        self._owned.append((clone, live))
        return clone

    def _score_model(self) -> Callable[..., Any]:
        return self._policy_call

    def _computes_fp16(self) -> bool:
        return self._low_dtype == torch.float16

    def _computes_fp32(self) -> bool:
        return True  # the fp32 islands and head

    def _new_fp32_fallback(self) -> ScoringPlan:
        return fp32_shadow(self._source, self._device(), self.tf32_option)

    @contextlib.contextmanager
    def _scoring_context(self) -> Iterator[None]:
        handle = None
        if self._rope is not None and self.layers:
            handle = self._rope.register_forward_hook(self._rope_hook, with_kwargs=True)
        for clone, live in self._owned:
            clone.train(live.training)
        installed = []
        try:
            for parent, key, live, island in self._swaps:
                if parent._modules.get(key) is not live:
                    raise RuntimeError(
                        f"the policy's module {key!r} changed since the plan was made; make a new plan after "
                        "replacing modules (e.g. after PEFT wrapping or torch.compile)"
                    )
                parent._modules[key] = island
                installed.append((parent, key, live))
            yield
        finally:
            for parent, key, live in reversed(installed):
                parent._modules[key] = live
            if handle is not None:
                handle.remove()
            self._state.clear()

    def _rope_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        x = args[0] if args else kwargs.get("x")
        if not isinstance(x, torch.Tensor) or x.dtype == torch.float32:
            return
        rest_args = args[1:]
        rest_kwargs = {k: v for k, v in kwargs.items() if k != "x"}
        with torch.autocast(device_type=x.device.type, enabled=False):
            fp32_output = type(module).forward(module, x.float(), *rest_args, **rest_kwargs)
        self._state["rope"] = (output, fp32_output)

    def _sync(self, source: nn.Module) -> None:
        if source is not self._source:
            raise ValueError(
                "arms fp32_head/guided run on the live policy they were made from; sync got a different model "
                f"({type(source).__name__} at {id(source):#x}); make a new plan for it"
            )
        self._copy(source, lambda: [pair for clone, live in self._owned
                                    for pair in zip(clone.parameters(), live.parameters())])
        self._head.refresh(self._head_live)

    def _bytes(self) -> int:
        tensors: list[torch.Tensor] = []
        for clone, _ in self._owned:
            tensors += list(clone.parameters()) + list(clone.buffers())
        return tensor_bytes(tensors + self._head.owned_tensors())

    def _fp32_share(self) -> float:
        numerator = self._layer_numel + self._norm_numel + self._head_live.weight.numel()
        bias = getattr(self._head_live, "bias", None)
        if bias is not None:
            numerator += bias.numel()
        return numerator / max(executed_numel(self._source), 1)

    def close(self) -> None:
        super().close()
        self._copy.clear()
        self._owned = []
        self._swaps = []
        self._head = None
        self._state.clear()

