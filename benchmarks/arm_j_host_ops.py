"""Host work of arm J's training forward and backward on CPU: aten ops dispatched and host wall time, before and
after a change of ``bloggap_plugin/core/vllm/autograd.py``, in ONE run:

    python -m benchmarks.arm_j_host_ops [--base main] [--repeats 30] [--out benchmarks/results/arm_j_host_ops.json]

``before`` is ``core/vllm/autograd.py`` as committed at ``--base`` (read with ``git show`` into a temporary module of
the same package), ``after`` the working tree's; each wraps the plain-torch stand-ins for vLLM's kernels
(``TORCH_KERNELS``) for :class:`~bloggap_plugin.core.plans.vllm_shadow.OnPolicyForward` in arm J's form (``all``) on
the tiny random Llama of the CPU tests, over a TRL-shaped batch (left-padded prompts of different lengths, the
completion appended). Per implementation: the aten ops a :class:`OpCounter` sees in the forward (with gradients) and
in the backward of ``sum(logps)`` (total, views apart, per op name with the top 15; the backward's also inside each
wrapped piece's backward, by formula), and the median host seconds of the forward + backward over ``--repeats``
runs, the two implementations interleaved run by run. On CPU the kernels are torch stand-ins, so the forward's counts
differ from a GPU's; the pieces' backward is the same code on both.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
MODULE = "bloggap_plugin/core/vllm/autograd.py"
RESULT = ROOT / "benchmarks" / "results" / "arm_j_host_ops.json"
TOP = 15
ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
"""Ops that allocate and launch nothing."""


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active (``counts[name]``; views in ``views``, allocations in
    ``allocations``: neither launches a kernel); ``scope`` names the bucket ``by_scope[scope][name]`` the next ops
    also count in (``None``: none), their launching ones in ``launching_by_scope[scope]``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.views: collections.Counter = collections.Counter()
        self.allocations: collections.Counter = collections.Counter()
        self.by_scope: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.scope: str | None = None
        self.launching_by_scope: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] += 1
        if func.is_view:
            self.views[name] += 1
        elif name in ALLOCATIONS:
            self.allocations[name] += 1
        elif self.scope is not None:
            self.launching_by_scope[self.scope] += 1
        if self.scope is not None:
            self.by_scope[self.scope][name] += 1
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict:
        total, views, allocations = (sum(c.values()) for c in (self.counts, self.views, self.allocations))
        return {"total": total, "views": views, "allocations": allocations,
                "launching": total - views - allocations, "top": dict(self.counts.most_common(TOP))}


def load_base(ref: str) -> tuple[ModuleType, str]:
    """``core.vllm.autograd`` as committed at ``ref`` (a module of ``bloggap_plugin.core.vllm``, so its relative
    imports resolve), and ``ref``'s commit. A ``ref`` from before the module moved into ``core/vllm/`` is refused."""
    commit = subprocess.run(["git", "rev-parse", ref], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    shown = subprocess.run(["git", "show", f"{commit}:{MODULE}"], cwd=ROOT, capture_output=True, text=True)
    if shown.returncode != 0:
        raise SystemExit(f"--base {ref}: {MODULE} is not in that commit (it predates core/vllm/); give a later base")
    source = shown.stdout
    name = f"bloggap_plugin.core.vllm._autograd_{commit[:12]}"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    module.__package__ = "bloggap_plugin.core.vllm"
    sys.modules[name] = module
    exec(compile(source, f"{ref}:{MODULE}", "exec"), module.__dict__)  # noqa: S102
    return module, commit


def revision() -> str:
    """HEAD's commit, ``+dirty`` when the working tree's ``core/vllm/autograd.py`` differs from it."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", MODULE], cwd=ROOT).returncode != 0
    return head + ("+dirty" if dirty else "")


def batch(rows: int = 6, keep: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's layout: left-padded prompts of different lengths, ``keep`` completion tokens appended."""
    from benchmarks._lib.logprobs import teacher_forced_batch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 24, (rows,), generator=gen).tolist()
    prompts = [torch.randint(5, 90, (n,), generator=gen).tolist() for n in lengths]
    return teacher_forced_batch(prompts, torch.randint(5, 90, (rows, keep), generator=gen), 0, "cpu")


class Arm:
    """Arm J's training forward over ``model`` with one implementation of ``core.vllm.autograd``."""

    def __init__(self, module: ModuleType, model, ids, mask, keep: int, spec: str) -> None:
        from bloggap_plugin.core.plans import vllm_shadow
        from bloggap_plugin.core.vllm.form import TORCH_KERNELS, parse_form

        original = vllm_shadow.autograd_kernels
        vllm_shadow.autograd_kernels = module.autograd_kernels  # OnPolicyForward wraps the kernels with it
        try:
            self.forward = vllm_shadow.OnPolicyForward(model, parse_form(spec), TORCH_KERNELS)
        finally:
            vllm_shadow.autograd_kernels = original
        self.module, self.model, self.ids, self.mask, self.keep = module, model, ids, mask, keep

    def step(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        self.model.zero_grad(set_to_none=True)
        logps = self.forward.token_logprobs(self.ids, self.mask, self.keep)[0]
        logps.sum().backward()
        return logps.detach(), [p.grad for p in self.model.parameters()]

    def timed(self) -> dict:
        """Host seconds of one forward, its backward, and the part of the backward inside the wrapped pieces'
        backward (``_KernelPiece.backward``, summed over its calls)."""
        piece = self.module._KernelPiece
        original = piece.backward
        inside = [0.0]

        def clocked(ctx, grad):
            started = time.perf_counter()
            try:
                return original(ctx, grad)
            finally:
                inside[0] += time.perf_counter() - started

        self.model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        logps = self.forward.token_logprobs(self.ids, self.mask, self.keep)[0]
        forward = time.perf_counter() - started
        piece.backward = staticmethod(clocked)
        try:
            started = time.perf_counter()
            logps.sum().backward()
            backward = time.perf_counter() - started
        finally:
            piece.backward = staticmethod(original)
        return {"forward_s": forward, "backward_s": backward, "piece_backwards_s": inside[0]}

    def counted(self) -> dict:
        """Ops of one forward and one backward; the backward's also per wrapped piece (by formula)."""
        piece = self.module._KernelPiece
        original = piece.backward
        counter = OpCounter()
        calls: collections.Counter = collections.Counter()

        def scoped(ctx, grad):
            name = getattr(ctx.formula, "__name__", str(ctx.formula))
            calls[name] += 1
            counter.scope = name
            try:
                return original(ctx, grad)
            finally:
                counter.scope = None

        self.model.zero_grad(set_to_none=True)
        with counter:
            logps = self.forward.token_logprobs(self.ids, self.mask, self.keep)[0]
        forward = counter.summary()
        for counts in (counter.counts, counter.views, counter.allocations):
            counts.clear()
        piece.backward = staticmethod(scoped)
        try:
            with counter:
                logps.sum().backward()
        finally:
            piece.backward = staticmethod(original)
        backward = counter.summary()
        pieces = {name: {"calls": calls[name], "ops": sum(ops.values()), "ops_per_call": sum(ops.values()) / calls[name],
                         "launching_per_call": counter.launching_by_scope[name] / calls[name],
                         "top": dict(ops.most_common(TOP))} for name, ops in sorted(counter.by_scope.items())}
        backward["in_piece_backwards"] = sum(p["ops"] for p in pieces.values())
        backward["piece_backward_calls"] = sum(calls.values())
        backward["by_formula"] = pieces
        return {"forward": forward, "backward": backward}


def piece_cases(gen: torch.Generator) -> dict:
    """Piece -> ``(kernels -> (wrapped piece, args, indices of the args wanting a gradient))`` on tiny bf16 inputs
    (the host's work dominates, as on the GPU): each closed-form piece as arm J's forward calls it."""
    from bloggap_plugin.core.vllm.form import vllm_cos_sin_cache

    def bf(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    cache = vllm_cos_sin_cache(8, 10000.0, 64, torch.bfloat16, torch.device("cpu"))
    positions = torch.randint(0, 64, (16,), generator=gen)
    tokens = torch.randint(0, 50, (16,), generator=gen)
    return {
        "linear": lambda k: (k.linear, [bf(16, 32), bf(24, 32), None], [0, 1]),
        "rms_norm": lambda k: (k.rms_norm, [bf(16, 32), bf(32), 1e-6], [0, 1]),
        "rotary": lambda k: (k.rotary, [bf(16, 4, 8), positions, cache], [0]),
        "silu_and_mul": lambda k: (k.silu_and_mul, [bf(16, 64)], [0]),
        "token_logprobs": lambda k: (k.token_logprobs, [bf(16, 50), tokens], [0]),
    }


def piece_host_us(modules: dict[str, ModuleType], repeats: int, calls: int = 100) -> dict:
    """``{piece: {implementation: {"forward_us", "backward_us"}}}``: host microseconds per call of the wrapped
    piece's forward (with gradients) and of its backward alone (``retain_graph``, the same graph each call), the
    minimum over ``repeats`` rounds of ``calls`` calls, the implementations interleaved round by round."""
    from bloggap_plugin.core.vllm.form import TORCH_KERNELS

    out: dict = {}
    for piece, case in piece_cases(torch.Generator().manual_seed(0)).items():
        built = {}
        for name, module in modules.items():
            fn, args, wanted = case(module.autograd_kernels(TORCH_KERNELS))
            args = [a.clone().requires_grad_(True) if i in wanted else a for i, a in enumerate(args)]
            result = fn(*args)
            built[name] = (fn, args, [args[i] for i in wanted], result, torch.ones_like(result))
        best = {name: {"forward_us": float("inf"), "backward_us": float("inf")} for name in modules}
        for _ in range(repeats):
            for name, (fn, args, leaves, result, upstream) in built.items():
                started = time.perf_counter()
                for _ in range(calls):
                    fn(*args)
                forward = (time.perf_counter() - started) / calls * 1e6
                started = time.perf_counter()
                for _ in range(calls):
                    torch.autograd.grad(result, leaves, upstream, retain_graph=True)
                backward = (time.perf_counter() - started) / calls * 1e6
                best[name]["forward_us"] = min(best[name]["forward_us"], forward)
                best[name]["backward_us"] = min(best[name]["backward_us"], backward)
        out[piece] = best
    return out


def run(base: str, repeats: int, spec: str = "all", keep: int = 16) -> dict:
    from bloggap_plugin.core.vllm import autograd as vllm_autograd
    from bloggap_plugin.models import load_model

    torch.manual_seed(0)
    model, _ = load_model("tiny-random-llama")
    model.train()
    ids, mask = batch(keep=keep)
    old, commit = load_base(base)
    arms = {"before": Arm(old, model, ids, mask, keep, spec), "after": Arm(vllm_autograd, model, ids, mask, keep, spec)}
    out: dict = {}
    steps = {name: arm.step() for name, arm in arms.items()}
    (logps_a, grads_a), (logps_b, grads_b) = steps["before"], steps["after"]
    diff = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(grads_a, grads_b))
    for name, arm in arms.items():
        out[name] = arm.counted()
    seconds: dict[str, list[dict]] = {name: [] for name in arms}
    for arm in arms.values():
        arm.timed()  # warm-up
    for _ in range(repeats):
        for name, arm in arms.items():
            seconds[name].append(arm.timed())
    for name in arms:
        out[name]["host_s_median"] = {key: statistics.median(run[key] for run in seconds[name])
                                      for key in seconds[name][0]}
        out[name]["host_s_min"] = {key: min(run[key] for run in seconds[name]) for key in seconds[name][0]}
    pieces = piece_host_us({"before": old, "after": vllm_autograd}, repeats)
    return {
        "benchmark": "arm_j_host_ops",
        "revision": revision(),
        "what": {
            "before": f"{MODULE} as committed at {base} ({commit})",
            "after": f"{MODULE} of the working tree at `revision`",
            "forward / backward": "aten ops an OpCounter (TorchDispatchMode) saw in one training forward (with "
                                  "gradients) / in the backward of sum(logps): total, views (no kernel launch), "
                                  "not_views, top 15 by name",
            "backward.in_piece_backwards": "the backward's ops inside the wrapped pieces' backward "
                                           "(_KernelPiece.backward), by_formula per piece formula; the rest is "
                                           "autograd of the ops outside the pieces (casts, concatenations, gathers)",
            "host_s_median / host_s_min": "median / minimum host wall seconds on CPU over `repeats` runs, the two "
                                          "implementations interleaved: the forward, the backward, and the part of "
                                          "the backward inside the wrapped pieces' backward (summed over its calls); "
                                          "on CPU the stand-in kernels' compute is in these too (a shared machine: "
                                          "noisy)",
            "piece_host_us": "per closed-form piece on tiny bf16 inputs (host-bound): microseconds per call of the "
                             "wrapped forward and of the backward alone (retain_graph), the minimum over `repeats` "
                             "rounds of 100 calls, before/after interleaved",
            "same_logprobs": "the two forwards' log-probs bit for bit equal",
            "grad_max_rel_diff": "max over parameters of max|g_before - g_after| / max|g_after|",
        },
        "params": {"model": "tiny-random-llama (fp32, CPU)", "form": spec, "rows": int(ids.shape[0]),
                   "width": int(ids.shape[1]), "logits_to_keep": keep, "kernels": "TORCH_KERNELS",
                   "repeats": repeats, "torch": torch.__version__, "threads": torch.get_num_threads()},
        "same_logprobs": bool(torch.equal(logps_a, logps_b)),
        "grad_max_rel_diff": diff,
        **out,
        "piece_host_us": pieces,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="main", help="git revision of the 'before' core/vllm/autograd.py")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the tests run single-threaded)")
    parser.add_argument("--out", default=str(RESULT))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    doc = run(args.base, args.repeats)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for name in ("before", "after"):
        back = doc[name]["backward"]
        print(name, "forward ops", doc[name]["forward"]["total"], "backward ops", back["total"], "launching",
              back["launching"], "in pieces", back["in_piece_backwards"], "host s",
              {k: round(v, 5) for k, v in doc[name]["host_s_median"].items()})
    print("same log-probs", doc["same_logprobs"], "grad max rel diff", doc["grad_max_rel_diff"])
    for piece, times in doc["piece_host_us"].items():
        print(piece, {name: {k: round(v, 1) for k, v in t.items()} for name, t in times.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
