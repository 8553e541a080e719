"""T11 on the HF path: the truncated-sampling term in the sampler ratio, before and after renormalising.

Protocol (reference study section 5, HF ``generate`` instead of vLLM): the first 4 stems x 8 topics = 32 raw
prompts, 64 sampled tokens each (EOS does not stop generation), temperature 1, sampled in one left-padded
batch by the bf16 model with :class:`bloggap_plugin.sampling.SamplerRecorder` doing the truncation
(top_p 0.8, top_k 20, min_p 0.05) or only recording (untruncated control). The same bf16 model then scores
the tokens teacher-forced with ``core.scoring.token_logprobs`` in chunks of 8: over the full vocabulary,
and renormalised over the recorded kept set (ids where ``|S| <= store_ids_max``, else the size). Ratio =
``exp(trainer logp - sampler processed logp)``; OOB = outside [0.9, 1.1]. The size-only reconstruction
(the trainer's top-``|S|``) is compared with the recorded ids.

    python -m benchmarks.trunc_bias --out benchmarks/results/h200          # GPU, ~1 min on an H200
    python -m benchmarks.trunc_bias --quick --device cpu --out /tmp/tb     # CPU smoke run, < 60 s
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks._lib.paths import RESULTS

ARMS = [
    ("top_p=0.8", dict(top_p=0.8), True),
    ("top_k=20", dict(top_k=20), True),
    ("min_p=0.05", dict(min_p=0.05), True),
    ("untruncated (control)", dict(), False),
]


def prompts(n: int) -> list[str]:
    """The reference study's prompt list (stems 0-3 x 8 topics for n <= 32): the probe's grid, first ``n``."""
    from bloggap_plugin.core.probe import builtin_prompts

    return builtin_prompts(n)


def _quantile(values: torch.Tensor, q: float) -> float:
    ordered = torch.sort(values.double().flatten()).values
    return float(ordered[min(int(q * ordered.numel()), ordered.numel() - 1)])


def ratio_stats(logp_trainer: torch.Tensor, logp_sampler: torch.Tensor) -> dict:
    """mean / median of exp(trainer - sampler), OOB (band 0.1) count and percent, mean |dlogp|."""
    from bloggap_plugin.core.metrics import abs_dlogp_stats, oob_count

    ratio = torch.exp(logp_trainer.double() - logp_sampler.double())
    out, n = oob_count(logp_trainer, logp_sampler)
    return {
        "mean": float(ratio.mean()),
        "median": float(ratio.median()),
        "oob": out,
        "n": n,
        "oob_pct": round(100.0 * out / n, 2),
        "abs_dlogp": abs_dlogp_stats(logp_trainer, logp_sampler),
    }


def sample(model, batch: dict, recorder, args):
    """``(sequences, record)``: ``--new-tokens`` tokens per prompt sampled by HF ``generate`` with ``recorder``
    truncating or only recording (EOS does not stop generation); ``sequences`` is ``[B, width + new_tokens]``."""
    width = batch["input_ids"].shape[1]
    torch.manual_seed(args.seed)
    with torch.no_grad():
        sequences = model.generate(
            **batch,
            do_sample=True,
            max_new_tokens=args.new_tokens,
            eos_token_id=None,
            logits_processor=[recorder],
            **recorder.neutral_generation_kwargs(),
        )
    if sequences.shape[1] != width + args.new_tokens:
        raise RuntimeError(f"generation stopped early ({sequences.shape[1] - width} of {args.new_tokens} tokens)")
    return sequences, recorder.finalize(sequences, width)


def recording_reducer(record, ids_tensor: torch.Tensor, truncate: bool):
    """``(reduce, extras)``: a ``token_logprobs`` reducer renormalising over the recorded kept set (the full
    vocabulary when ``truncate`` is off) that also records, per tile of scored tokens, the full-vocabulary
    log-probs, the size-only reconstruction, both log kept masses and whether the trainer's top-``|S|`` equals
    the recorded ids (``extras``: name -> ``(index, value)`` pairs, joined into ``[B, K]`` by ``join_tiles``)."""
    from bloggap_plugin.core.scoring import gather_logprobs
    from bloggap_plugin.core.truncation import kept_reducer, log_kept_mass_from_ids, log_kept_mass_from_size

    extras: dict[str, list] = {"full": [], "size_only": [], "log_mass_ids": [], "log_mass_size": [], "same_set": []}
    product = kept_reducer(kept_ids=ids_tensor, sizes=record.kept_sizes) if truncate else None
    size_only = kept_reducer(sizes=record.kept_sizes) if truncate else None

    def reduce(logits, targets, index):
        full = gather_logprobs(logits, targets)
        extras["full"].append((index, full))
        if product is None:
            return full
        extras["size_only"].append((index, size_only(logits, targets, index)))
        chunk_ids, chunk_sizes = ids_tensor[index], record.kept_sizes[index]
        extras["log_mass_ids"].append((index, log_kept_mass_from_ids(logits, chunk_ids)))
        extras["log_mass_size"].append((index, log_kept_mass_from_size(logits, chunk_sizes)))
        s_max = chunk_ids.shape[-1]
        top = torch.topk(logits, s_max, dim=-1).indices
        rank = torch.arange(s_max, device=top.device)
        top = torch.where(rank < chunk_sizes.unsqueeze(-1), top, -1)
        same_set = (torch.sort(top, dim=-1).values == torch.sort(chunk_ids, dim=-1).values).all(-1)
        extras["same_set"].append((index, same_set))
        return product(logits, targets, index)

    return reduce, extras


def kept_set_stats(record, ids_tensor: torch.Tensor, extras: dict, sampler: torch.Tensor) -> dict:
    """Kept mass and size, where the ids were recorded, ids vs size-only log mass, and the size-only ratio."""
    from bloggap_plugin.core.scoring import join_tiles

    sizes = record.kept_sizes.cpu()
    has_ids = (ids_tensor >= 0).any(-1).cpu()
    log_ids = join_tiles(extras["log_mass_ids"]).cpu()
    log_size = join_tiles(extras["log_mass_size"]).cpu()
    same = join_tiles(extras["same_set"]).cpu() & has_ids
    gap = (log_ids - log_size).abs()[has_ids]
    trainer_log_mass = torch.where(has_ids, log_ids, log_size)
    return {
        "kept_mass_sampler_mean": float(record.log_kept_mass.exp().mean().cpu()),
        "kept_mass_sampler_min": float(record.log_kept_mass.exp().min().cpu()),
        "kept_mass_trainer_mean": float(trainer_log_mass.exp().mean()),
        "kept_size_mean": float(sizes.double().mean()),
        "kept_size_p99": _quantile(sizes, 0.99),
        "kept_size_max": int(sizes.max()),
        "positions_with_ids": int(has_ids.sum()),
        "sets_equal": int(same.sum()),
        "abs_log_mass_ids_vs_size": {
            "mean": float(gap.mean()) if gap.numel() else None,
            "p99": _quantile(gap, 0.99) if gap.numel() else None,
            "max": float(gap.max()) if gap.numel() else None,
        },
        "ratio_size_only": ratio_stats(join_tiles(extras["size_only"]).cpu(), sampler),
    }


def run_arm(model, batch, name, truncation, truncate, args, device) -> dict:
    """One sampling setting: sample with ``SamplerRecorder``, score the tokens teacher-forced over the full
    vocabulary and over the recorded kept set; the ratios, times (s) and kept-set statistics."""
    from bloggap_plugin.core.scoring import join_tiles, token_logprobs
    from bloggap_plugin.sampling import SamplerRecorder

    recorder = SamplerRecorder(temperature=1.0, truncate=truncate, store_ids_max=args.store_ids_max, **truncation)
    t0 = time.perf_counter()
    sequences, record = sample(model, batch, recorder, args)
    t_gen = time.perf_counter() - t0
    width = batch["input_ids"].shape[1]
    attention = torch.cat([batch["attention_mask"], torch.ones_like(sequences[:, width:])], dim=1)
    ids_tensor = record.kept_ids_tensor()
    reduce, extras = recording_reducer(record, ids_tensor, truncate)
    t0 = time.perf_counter()
    with torch.no_grad():
        renorm = token_logprobs(
            model, sequences, attention, args.new_tokens, batch_size=args.score_batch, temperature=1.0, reduce=reduce
        )
    t_score = time.perf_counter() - t0
    full = join_tiles(extras["full"]).cpu()
    renorm = renorm.cpu()
    sampler = record.processed_logps.cpu()
    result = {
        "arm": name,
        "truncation": truncation,
        "truncate": truncate,
        "tokens": int(full.numel()),
        "seconds": {"generate": round(t_gen, 3), "score": round(t_score, 3)},
        "ratio_full_vocab": ratio_stats(full, sampler),
        "ratio_kept_set": ratio_stats(renorm, sampler),
        # the sampler-side identity: its full-vocabulary log-prob minus its processed log-prob is log S
        "sampler_mass_identity_max_abs": float(
            (record.logps - record.processed_logps - record.log_kept_mass).abs().max().cpu()
        ),
    }
    if truncate:
        result.update(kept_set_stats(record, ids_tensor, extras, sampler))
    else:
        result.update({"kept_mass_sampler_mean": 1.0, "kept_mass_trainer_mean": 1.0, "kept_size_mean": None, "kept_size_max": None})
    return result


def _r4(x):
    return None if x is None else round(float(x), 4)


def t11_table(results: list[dict], params: dict, random_init: bool) -> dict:
    """T11: the sampler ratio over the full vocabulary and over the kept set, per sampling setting."""
    rows = []
    for res in results:
        full, kept = res["ratio_full_vocab"], res["ratio_kept_set"]
        rows.append(
            [
                res["arm"],
                res["tokens"],
                _r4(res["kept_mass_sampler_mean"]),
                _r4(res["kept_size_mean"]) if res["kept_size_mean"] is not None else "-",
                res["kept_size_max"] if res["kept_size_max"] is not None else "-",
                _r4(full["mean"]),
                _r4(full["median"]),
                full["oob_pct"],
                _r4(kept["mean"]),
                _r4(kept["median"]),
                kept["oob_pct"],
                _r4(full["abs_dlogp"]["mean"]),
                _r4(kept["abs_dlogp"]["mean"]),
            ]
        )
    return {
        "id": "T11",
        "title": "Truncated-sampling term in the sampler ratio (HF generate + SamplerRecorder), before/after renormalising",
        "columns": [
            "sampling",
            "tokens",
            "kept mass",
            "mean |S|",
            "max |S|",
            "full vocab: mean",
            "median",
            "OOB %",
            "kept set: mean",
            "median",
            "OOB %",
            "mean |dlogp| full",
            "mean |dlogp| kept",
        ],
        "rows": rows,
        "notes": (
            f"{params['model']} {params['dtype']}, {params['prompts']} prompts x {params['new_tokens']} tokens, T=1. "
            "Sampler = HF generate in one left-padded batch with SamplerRecorder applying the truncation (vLLM order); "
            f"trainer = the same model teacher-forced in chunks of {params['score_batch']}. Ratio = exp(trainer logp - "
            "sampler processed logp); OOB = outside [0.9, 1.1]. Kept mass = the sampler's S per token (mean). "
            "'kept set' renormalises the trainer over the recorded ids (or the size where |S| > "
            f"{params['store_ids_max']}). The reference used vLLM 0.28 as sampler and top_k=1024 caps."
        ),
        "reference": "T11",
        "random_init": random_init,
    }


def t11b_table(results: list[dict], random_init: bool) -> dict:
    """T11b: the size-only kept set (the trainer's top-``|S|``) against the recorded ids."""
    size_rows = []
    for res in results:
        if not res["truncate"]:
            continue
        with_ids = res["positions_with_ids"]
        gap = res["abs_log_mass_ids_vs_size"]
        size_rows.append(
            [
                res["arm"],
                res["tokens"],
                round(100.0 * with_ids / res["tokens"], 2),
                round(100.0 * res["sets_equal"] / with_ids, 2) if with_ids else None,
                None if gap["mean"] is None else float(f"{gap['mean']:.3g}"),
                None if gap["p99"] is None else float(f"{gap['p99']:.3g}"),
                None if gap["max"] is None else float(f"{gap['max']:.3g}"),
                _r4(res["ratio_size_only"]["mean"]),
                res["ratio_size_only"]["oob_pct"],
                res["ratio_kept_set"]["oob_pct"],
            ]
        )
    return {
        "id": "T11b",
        "title": "Size-only kept set (trainer top-|S|) vs recorded ids",
        "columns": [
            "sampling",
            "tokens",
            "ids recorded %",
            "sets equal %",
            "|dlog M| mean",
            "|dlog M| p99",
            "|dlog M| max",
            "size-only ratio mean",
            "size-only OOB %",
            "ids OOB %",
        ],
        "rows": size_rows,
        "notes": (
            "Among positions whose ids were recorded: share where the trainer's top-|S| equals the recorded set "
            "(bf16 logit ties at the edge count as different), and |log M_ids - log M_size|. The reference study's "
            "support-size experiment (section 5) found sets equal 72-99.9% and |dlog M| p99 <= 6.8e-5 on vLLM."
        ),
        "reference": None,
        "random_init": random_init,
    }


def tables(results: list[dict], params: dict, random_init: bool) -> list[dict]:
    """The T11 and T11b tables of the runs ``results``."""
    return [t11_table(results, params, random_init), t11b_table(results, random_init)]


def print_tables(tables_: list[dict]) -> None:
    from bloggap_plugin.results import format_text_table

    for table in tables_:
        print()
        print(format_text_table(table))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output folder (default benchmarks/results/<device>)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--score-batch", type=int, default=8)
    parser.add_argument("--store-ids-max", type=int, default=4096, help="record ids of kept sets up to this size")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--quick", action="store_true", help="4 prompts x 16 tokens (CPU, < 60 s)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.device == "cpu":
        torch.set_num_threads(1)
    if args.quick:
        args.prompts, args.new_tokens, args.score_batch = 4, 16, 2
    from bloggap_plugin.envinfo import device_tag, environment_record
    from bloggap_plugin.models import TINY_MODELS, load_model
    from bloggap_plugin.results import ResultDocument

    device = torch.device(args.device)
    out_dir = Path(args.out) if args.out else RESULTS / device_tag(device)
    t_start = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=device)
    texts = prompts(args.prompts)
    batch = {k: v.to(device) for k, v in tokenizer(texts, return_tensors="pt", padding=True).items()}
    params = {
        "model": args.model,
        "dtype": args.dtype,
        "prompts": len(texts),
        "new_tokens": args.new_tokens,
        "score_batch": args.score_batch,
        "generate_batch": len(texts),
        "store_ids_max": args.store_ids_max,
        "temperature": 1.0,
        "seed": args.seed,
        "quick": args.quick,
        "arms": [{"name": n, **t} for n, t, _ in ARMS],
    }
    results = []
    for name, truncation, truncate in ARMS:
        res = run_arm(model, batch, name, truncation, truncate, args, device)
        results.append(res)
        print(
            f"[trunc_bias] {name}: ratio full {res['ratio_full_vocab']['mean']:.4f} "
            f"(OOB {res['ratio_full_vocab']['oob_pct']}%) -> kept {res['ratio_kept_set']['mean']:.4f} "
            f"(OOB {res['ratio_kept_set']['oob_pct']}%), {time.perf_counter() - t_start:.1f}s",
            flush=True,
        )
    random_init = args.model in TINY_MODELS
    document = ResultDocument(
        benchmark="trunc_bias",
        env=environment_record(device, model=args.model, dtype=args.dtype),
        params=params,
        results={"arms": results, "wall_s": round(time.perf_counter() - t_start, 2)},
        tables=tables(results, params, random_init),
    )
    path = document.write(out_dir / "trunc_bias.json")
    print(f"[trunc_bias] wrote {path}")
    print_tables(document.tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
