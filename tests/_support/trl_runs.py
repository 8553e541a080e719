"""Tiny GRPO runs in real TRL 1.16 for the adapter's tests (CPU): the trainer builder, its logs, spies and counters."""

from __future__ import annotations

import dataclasses

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from bloggap_plugin.models import load_model
from bloggap_plugin.trl import GapCallback, GapGRPOTrainer
from bloggap_plugin.trl.state import GenerationSums

PROMPTS = ["1+1=", "12+30=", "4+40=", "100+200="]  # 4, 6, 5 and 8 tokens: distinct prompts are left-padded


def reward(completions, **kwargs):
    return [float(len(c) % 3) for c in completions]


def grpo_args(tmp_path, **overrides) -> GRPOConfig:
    kwargs = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
        gradient_accumulation_steps=2, max_completion_length=8, max_steps=2, logging_steps=1, report_to="none",
        use_cpu=True, bf16=False, save_strategy="no", num_iterations=2, seed=0, learning_rate=1e-3,
    )
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def make(tmp_path, gap=None, mode="trainer", dtype="fp32", trainer_cls=None, model_name="tiny-random-llama",
         prompts=PROMPTS, peft_config=None, prepare=None, **overrides):
    """A GRPO trainer on a tiny model (``model_name``: a tiny spec or a saved folder): plain, GapCallback or class;
    ``prepare(model)`` edits the model first (e.g. sharpens its logits)."""
    model, tokenizer = load_model(model_name, dtype=dtype)
    if prepare is not None:
        prepare(model)
    dataset = Dataset.from_dict({"prompt": list(prompts) * 4})
    common = dict(model=model, args=grpo_args(tmp_path, **overrides), train_dataset=dataset, reward_funcs=reward,
                  processing_class=tokenizer)
    if peft_config is not None:
        common["peft_config"] = peft_config
    if mode == "plain" or mode == "callback":
        trainer = GRPOTrainer(**common)
        if mode == "callback":
            trainer.add_callback(GapCallback(trainer, gap=gap))
        return trainer
    return (trainer_cls or GapGRPOTrainer)(**common, gap=gap)


def logs_of(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


def first_log(trainer) -> dict:
    return logs_of(trainer)[0]


class Spy(GapGRPOTrainer):
    """Records the generation batches after the plugin (what the loss will read)."""

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.spied = getattr(self, "spied", []) + [{k: v for k, v in output.items() if torch.is_tensor(v)}]
        return output


def count_no_grad_scoring_rows(trainer) -> list:
    """Append, per grad-free teacher-forced forward of the policy (TRL's old pass, the plugin's scoring), its rows."""
    rows: list = []

    def hook(module, args, kwargs):
        if not torch.is_grad_enabled() and ("labels" in kwargs or kwargs.get("use_cache") is False):
            rows.append(int(kwargs["input_ids"].shape[0]))

    trainer.model.register_forward_pre_hook(hook, with_kwargs=True)
    return rows


def saved_model_dir(tmp_path, name: str = "tiny-random-llama", dtype: str = "fp32") -> str:
    """A tiny model saved to a folder: TRL builds its reference model from the policy's ``name_or_path``."""
    from bloggap_plugin.models import load_model

    model, tokenizer = load_model(name, dtype=dtype)
    folder = tmp_path / f"saved-{name}"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


GENERATION_FIELDS = [f.name for f in dataclasses.fields(GenerationSums)]
"""GenerationSums' fields in reduction order (a generation's sums are the reduce of exactly this many values)."""


def gen_index(name: str) -> int:
    return GENERATION_FIELDS.index(name)
