"""The arithmetic task for verl: parquet files in verl's RL dataset layout and a verl custom reward function.

verl's ``RLHFDataset`` reads parquet rows with the columns :data:`VERL_COLUMNS`: ``data_source`` (routes the
reward), ``prompt`` (chat messages, verl applies the tokenizer's chat template), ``ability``, ``reward_model``
(``{"style": "rule", "ground_truth": "<answer>"}``) and ``extra_info`` (``split``, ``index``, ``difficulty``,
``question``). The reward: ``reward.custom_reward_function.path=pkg://bloggap_plugin.tasks.verl_data``,
``reward.custom_reward_function.name=compute_score`` (the same rule as the TRL reward,
:func:`bloggap_plugin.tasks.arith.score_text`).

CLI: ``python -m bloggap_plugin.tasks.verl_data OUT_DIR [--train N] [--val N] [--seed S] [--difficulty L]`` writes
``OUT_DIR/train.parquet`` and ``OUT_DIR/val.parquet``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bloggap_plugin.core.errors import UsageError
from bloggap_plugin.tasks import arith

__all__ = ["DATA_SOURCE", "VERL_COLUMNS", "REWARD_PATH", "verl_rows", "write_verl_parquet", "compute_score", "main"]

DATA_SOURCE = "bloggap/arith"
VERL_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
REWARD_PATH = "pkg://bloggap_plugin.tasks.verl_data"
"""``reward.custom_reward_function.path`` for verl (``name=compute_score``)."""

_VAL_SEED_OFFSET = 1_000_003  # the validation problems come from their own generator stream


def verl_rows(n: int, seed: int = 0, difficulty: int = arith.DEFAULT_DIFFICULTY, split: str = "train") -> list[dict]:
    """``n`` arithmetic problems as verl dataset rows (dicts with exactly :data:`VERL_COLUMNS`)."""
    problems = arith.make_problems(n, seed=seed, difficulty=difficulty)
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": arith.build_messages(p, difficulty),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "extra_info": {"split": split, "index": i, "difficulty": int(difficulty), "question": p.question},
        }
        for i, p in enumerate(problems)
    ]


def write_verl_parquet(
    out_dir: str | os.PathLike, n_train: int = 1024, n_val: int = 64, seed: int = 0,
    difficulty: int = arith.DEFAULT_DIFFICULTY,
) -> tuple[Path, Path]:
    """Write ``train.parquet`` (``n_train`` rows, generator seed ``seed``) and ``val.parquet`` (``n_val`` rows,
    another seed) under ``out_dir``; returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if n_train < 1 or n_val < 1:
        raise UsageError(f"need at least 1 train and 1 val problem, got train={n_train} val={n_val}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n, split_seed in (("train", n_train, seed), ("val", n_val, seed + _VAL_SEED_OFFSET)):
        table = pa.Table.from_pylist(verl_rows(n, seed=split_seed, difficulty=difficulty, split=split))
        path = out / f"{split}.parquet"
        tmp = out / f".{split}.parquet.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, path)
        paths.append(path)
    return paths[0], paths[1]


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **kwargs) -> float:
    """verl custom reward: 1.0 when the last number of ``solution_str`` equals ``ground_truth``, else 0.0.

    Rows of another ``data_source`` are an error (a dataset mix-up would otherwise score silently)."""
    if data_source != DATA_SOURCE:
        raise ValueError(f"bloggap compute_score scores {DATA_SOURCE!r} rows only, got data_source={data_source!r}")
    return arith.score_text(solution_str, ground_truth)


def main(argv: list[str] | None = None) -> int:
    """CLI: write the parquet files; one-line error and exit 2 on bad input."""
    ap = argparse.ArgumentParser(prog="python -m bloggap_plugin.tasks.verl_data", description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--train", type=int, default=1024, help="train problems (default 1024)")
    ap.add_argument("--val", type=int, default=64, help="validation problems (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--difficulty", type=int, default=arith.DEFAULT_DIFFICULTY, help="arith level 1-5")
    args = ap.parse_args(argv)
    try:
        train, val = write_verl_parquet(args.out_dir, args.train, args.val, args.seed, args.difficulty)
    except (UsageError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {train} ({args.train} rows) and {val} ({args.val} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
