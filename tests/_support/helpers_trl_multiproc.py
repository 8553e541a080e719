"""A tiny GapGRPOTrainer run for ``tests/trl/test_trl_multiproc.py``; works alone or under ``accelerate launch``.

``python tests/_support/helpers_trl_multiproc.py OUT.json [--per-device-batch 4] [--grad-accum 2]`` trains
tiny-random-llama (fp32 unless ``--dtype``, CPU) for 2 GRPO steps with ``num_iterations 2``, arm C and top_p 0.8, and writes
``OUT.json`` from process 0: ``{"num_processes", "log_history", "reduces"}``. Every other process r writes
``OUT.json.rank<r>`` with its own ``reduces``. ``reduces`` lists, in call order, every cross-process reduction
the plugin made on that process: ``{"kind": "sum" | "max", "site": the calling method, "step": global step,
"local": this process's values, "reduced": the values every process received}``, so a test can check the
logged metrics against the per-process sums they were made from.

``python tests/_support/helpers_trl_multiproc.py --scenarios PLAN.json`` runs several such runs in one launch (one
start-up of Python, torch and the trainer stack, instead of one per run): ``PLAN.json`` is a list of argument
lists, each exactly what would follow the script's name on its own command line (its own ``OUT`` first), run in
turn, each writing its own files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

PROMPTS = ["1+1=", "2+3=", "4+4=", "9+1="]


def reward(completions, **kwargs):
    """Deterministic: completion length mod 3."""
    return [float(len(c) % 3) for c in completions]


def _nan_to_none(value):
    return None if isinstance(value, float) and value != value else value


@contextlib.contextmanager
def _prefer_own_layer(enabled: bool):
    """While open (if ``enabled``): every divergence profile of process r ranks layer r first (processes that
    choose different layers); the measured profile is restored on leaving, for the next run of a plan."""
    from bloggap_plugin.core import divergence

    measured = divergence.divergence_profile

    def profile(*args, **kwargs):
        result = measured(*args, **kwargs)
        rank = int(os.environ.get("RANK", "0"))
        result.increments = [1.0 if i == rank % result.n_layers else 0.0 for i in range(result.n_layers)]
        return result

    if enabled:
        divergence.divergence_profile = profile
    try:
        yield
    finally:
        divergence.divergence_profile = measured


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON path written by process 0 (others add .rank<r>)")
    parser.add_argument("--per-device-batch", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--arm", default="C")
    parser.add_argument("--probe-rows", type=int, default=4)
    parser.add_argument("--dtype", default="fp32", help="policy dtype for load_model")
    parser.add_argument("--k", type=int, default=8, help="arm D: layers chosen by the guided plan")
    parser.add_argument("--top-p", type=float, default=0.8, help="< 1 truncates sampling: gap/kept/* metrics")
    parser.add_argument("--top-k", type=int, default=0, help="1: every process samples the argmax (same tokens)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--num-iterations", type=int, default=2)
    parser.add_argument("--mask-rank", type=int, default=None,
                        help="this process's completion masks are all zero (as mask_truncated_completions does "
                             "when every row is truncated)")
    parser.add_argument("--drop-record-rank", type=int, default=None,
                        help="this process's sampler record is lost (as when generate was replaced: a warning)")
    parser.add_argument("--cpu-fsdp", action="store_true",
                        help="under `accelerate launch --use_fsdp`: let accelerate shard on CPU (gloo)")
    parser.add_argument("--bf16", action="store_true", help="GRPOConfig bf16 (under FSDP2: bf16 mixed precision)")
    parser.add_argument("--disagree-layers", action="store_true",
                        help="arm D with layers chosen automatically: process r's profile prefers layer r")
    return parser


def _recording_trainer(args: argparse.Namespace) -> type:
    """``GapGRPOTrainer`` (with ``--mask-rank``: also masking that process's completions) recording every
    cross-process reduction of the plugin in ``gap_reduces`` (dropping ``--drop-record-rank``'s sampler record)."""
    from trl import GRPOTrainer

    from bloggap_plugin.trl import GapGRPOTrainer

    class MaskingGRPOTrainer(GRPOTrainer):
        """TRL with process ``--mask-rank``'s completion masks zeroed before the plugin sees the batch."""

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            if self.model.training and self.accelerator.process_index == args.mask_rank:
                output["completion_mask"] = torch.zeros_like(output["completion_mask"])
            return output

    base = GapGRPOTrainer if args.mask_rank is None else type("GapMaskingTrainer", (GapGRPOTrainer, MaskingGRPOTrainer), {})

    class RecordingTrainer(base):
        """Records the local and reduced values of every cross-process reduction of the plugin."""

        def _gap_record(self, kind: str, local: list[float], reduced: list[float]) -> None:
            site = sys._getframe(2).f_code.co_name
            self.gap_reduces = getattr(self, "gap_reduces", [])
            self.gap_reduces.append({"kind": kind, "site": site, "step": self.state.global_step,
                                     "local": [float(v) for v in local], "reduced": reduced})

        def _gap_attach(self, *attach_args, **attach_kwargs):
            super()._gap_attach(*attach_args, **attach_kwargs)
            session = self._gap_session
            keep_record, reduce, reduce_pair = session.keep_record, session.stats.reduce, session.stats.reduce_pair

            def keep(recorder, sequences, prompt_width):
                if self.accelerator.process_index == args.drop_record_rank:
                    return  # what a SamplerRecordError leaves: no record, so no sampler or kept-set keys this time
                keep_record(recorder, sequences, prompt_width)

            def reduce_recorded(values):
                reduced = reduce(values)
                self._gap_record("sum", values, reduced)
                return reduced

            def reduce_pair_recorded(sums, maxima):
                reduced_sums, reduced_maxima = reduce_pair(sums, maxima)
                self._gap_record("sum", sums.to_tensor("cpu").tolist(), reduced_sums)
                self._gap_record("max", maxima.to_tensor("cpu").tolist(), reduced_maxima)
                return reduced_sums, reduced_maxima

            session.keep_record = keep
            session.stats.reduce, session.stats.reduce_pair = reduce_recorded, reduce_pair_recorded

    return RecordingTrainer


def main(argv: list[str] | None = None) -> None:
    from benchmarks._lib.launch import run_scenarios

    run_scenarios(sys.argv[1:] if argv is None else argv, lambda scenario: run(_parser().parse_args(scenario)))


def run(args: argparse.Namespace) -> None:
    """One run: a trainer per arm of ``--arm``, each writing its records (see the module docstring)."""
    with _prefer_own_layer(args.disagree_layers):
        _train_arms(args)


def _train_arms(args: argparse.Namespace) -> None:
    if args.cpu_fsdp:
        from benchmarks.fsdp_scale import force_cpu_fsdp

        force_cpu_fsdp()

    from datasets import Dataset
    from trl import GRPOConfig

    from bloggap_plugin.models import load_model
    from bloggap_plugin.recipes import GapConfig

    trainer_class = _recording_trainer(args)
    arms = args.arm.split(",")
    for arm in arms:  # several arms: one trainer each, a fresh model each, OUT with _<arm> before .json
        out = args.out if len(arms) == 1 else args.out.removesuffix(".json") + f"_{arm}.json"
        model, tokenizer = load_model("tiny-random-llama", dtype=args.dtype)
        config = GRPOConfig(
            output_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), "trainer_out"),
            per_device_train_batch_size=args.per_device_batch, num_generations=4,
            gradient_accumulation_steps=args.grad_accum, max_completion_length=8, max_steps=args.steps,
            logging_steps=1, report_to="none", use_cpu=True, bf16=args.bf16, save_strategy="no",
            num_iterations=args.num_iterations, seed=0, learning_rate=1e-3, top_p=args.top_p, top_k=args.top_k,
        )
        trainer = trainer_class(
            model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
            processing_class=tokenizer, gap=GapConfig(arm=arm, probe_rows=args.probe_rows, k=args.k),
        )
        trainer.train()
        _write_record(trainer, out)


def _write_record(trainer, out: str) -> None:
    """Process 0 writes ``out``, process r ``out.rank<r>`` (see the module docstring)."""
    from bloggap_plugin.core.sharding import is_dtensor

    rank = trainer.accelerator.process_index
    reduces = [{**r, "local": [_nan_to_none(v) for v in r["local"]], "reduced": [_nan_to_none(v) for v in r["reduced"]]}
               for r in getattr(trainer, "gap_reduces", [])]
    state = trainer._gap_session.state
    plans = {"plan": state.resources.plan, "ref_plan": state.resources.ref_plan}
    record = {"num_processes": trainer.accelerator.num_processes, "rank": rank, "reduces": reduces,
              "distributed_type": str(trainer.accelerator.distributed_type),
              "plan_layers": getattr(state.resources.plan, "layers", None),
              "sharded_params": sum(is_dtensor(p) for p in trainer.model.parameters()),
              "policy_bytes": sum(p.to_local().nbytes if is_dtensor(p) else p.nbytes for p in trainer.model.parameters()),
              "policy_full_bytes": sum(p.nbytes for p in trainer.model.parameters()),
              "plan_bytes": {k: p.stats()["bytes_added"] for k, p in plans.items() if p is not None},
              "shadow_sharded": {k: any(is_dtensor(t) for t in p.shadow.parameters())
                                 for k, p in plans.items() if getattr(p, "shadow", None) is not None}}
    if rank == 0:
        record["log_history"] = [{k: _nan_to_none(v) for k, v in h.items()} for h in trainer.state.log_history]
        path = out
    else:
        path = f"{out}.rank{rank}"
    with open(path, "w") as handle:
        json.dump(record, handle, indent=1, allow_nan=True)
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
