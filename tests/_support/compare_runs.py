"""What the compare tests share: a stand-in for run_training, recipe files, and the CLI called in-process."""

from __future__ import annotations

from pathlib import Path

# A stand-in for run_training with the same signature: rewards are a closed form of (arm, seed, step), so the
# expected table is known without running the code under test. FAKE_HANG=<run id> makes that run hang after
# its first line (to be killed); FAKE_SLOW=<run id> makes it sleep 0.5 s after each step; FAKE_CRASH=<run id>
# makes it raise (FAKE_CRASH_ONCE=<run id>: its first call, after its first line); FAKE_SHA=<hex> makes it report that model sha256. Every call is recorded in FAKE_CALLS (with its
# pid). Like the real JsonlLogger it opens the log by path for every line (so a process that outlives its sweep
# keeps appending to whatever file has that name).
FAKE_TRAIN = '''
import json, os, time, yaml

ARM_BASE = {"A": 0.25, "B": 0.5, "C": 0.0}

def run_training(recipe_path, *, model, task, max_steps, output_dir, report_to="none", seed, log_jsonl,
                 extra_overrides, task_kwargs=None):
    arm = yaml.safe_load(open(recipe_path))["gap"]["arm"]
    run_id = f"{arm}_s{seed}"
    with open(os.environ["FAKE_CALLS"], "a") as f:
        f.write(json.dumps({"run": run_id, "overrides": extra_overrides, "task": task, "model": model,
                            "task_kwargs": task_kwargs, "max_steps": max_steps, "pid": os.getpid()}) + "\\n")
    if os.environ.get("FAKE_CRASH") == run_id:
        raise RuntimeError("fake crash")
    for step in range(1, max_steps + 1):
        reward = ARM_BASE[arm] + 0.125 * seed + (0.25 if step % 2 else 0.0)
        with open(log_jsonl, "a") as log:
            # num_iterations 2: odd steps are a generation's first iteration (the gap), even ones the update
            ratio = {"gap/ratio/oob_frac": 0.5 if arm == "B" else 0.0} if step % 2 else {"gap/update/oob_frac": 0.75}
            log.write(json.dumps({"step": step, "reward": reward, "clip_ratio/region_mean": 0.01 * step, **ratio,
                                  "step_time": 2.0}) + "\\n")
        if os.environ.get("FAKE_HANG") == run_id:
            time.sleep(600)
        if os.environ.get("FAKE_CRASH_ONCE") == run_id and not os.path.exists(os.environ["FAKE_CALLS"] + ".crashed"):
            open(os.environ["FAKE_CALLS"] + ".crashed", "w").close()
            raise RuntimeError("fake crash, once")
        if os.environ.get("FAKE_SLOW") == run_id:
            time.sleep(0.5)
    if os.environ.get("FAKE_SHA"):  # the hash run_training records of a model folder
        return {"arm": arm, "steps": max_steps, "model_sha256": os.environ["FAKE_SHA"]}
    return {"arm": arm, "steps": max_steps}
'''


def write_recipes(tmp_path: Path, arms=("A", "B")) -> list[str]:
    paths = []
    for arm in arms:
        path = tmp_path / f"arm_{arm}.yaml"
        path.write_text(f"learning_rate: 1.0e-6\ngap:\n  arm: {arm}\n")
        paths.append(str(path))
    return paths


def compare_cli(args, capsys) -> tuple[int, str, str]:
    from bloggap_plugin.cli import main

    code = main(["compare", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


FAKE_SWITCHES = ("FAKE_HANG", "FAKE_CRASH", "FAKE_CRASH_ONCE", "FAKE_SLOW", "FAKE_SHA", "FAKE_EVAL_CRASH",
                 "FAKE_EVAL_CRASH_ONCE")
"""The environment variables that make the fake training (or its evaluation) misbehave: cleared for each test."""


def install_fake_train(tmp_path: Path, monkeypatch, **modules: str) -> dict:
    """``tmp_path/fake_pkg/fake_train.py`` (:data:`FAKE_TRAIN`) and any ``NAME=SOURCE`` modules beside it, on
    ``sys.path``; ``FAKE_CALLS`` set to ``tmp_path/calls.jsonl``; :data:`FAKE_SWITCHES` cleared. Returns ``{"dir",
    "calls", "run_fn"}`` (``run_fn``: ``fake_train:run_training``)."""
    module_dir = tmp_path / "fake_pkg"
    module_dir.mkdir()
    (module_dir / "fake_train.py").write_text(FAKE_TRAIN)
    for name, source in modules.items():
        (module_dir / f"{name}.py").write_text(source)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_CALLS", str(calls))
    monkeypatch.syspath_prepend(str(module_dir))  # for the sweep's own check of --run-fn
    for name in FAKE_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    return {"dir": str(module_dir), "calls": calls, "run_fn": "fake_train:run_training"}
