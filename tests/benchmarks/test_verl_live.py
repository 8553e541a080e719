"""benchmarks.verl_live on CPU: every Hydra command it builds composes against verl 0.9.1's own config, and its
parsers read verl's logger output (the GPU run itself is issue 13)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _support import ROOT
from _support.verl_config import compose_ppo_trainer

from benchmarks import verl_live
from benchmarks._lib import verl_records


def test_every_run_composes_against_verls_config(tmp_path):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from bloggap_plugin.verl.config import load_settings

    for run in verl_records.RUNS:
        argv, env = verl_live.command(run, "/m/smollm2", tmp_path / "data", tmp_path, steps=25)
        assert argv[1:3] == ["-m", "verl.trainer.main_ppo"]
        cfg = compose_ppo_trainer(argv[3:])
        load_settings(cfg.get("bloggap"))
        # main_ppo's own checks before Ray starts (batch sizes against GPUs, micro-batch settings, ...)
        validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
        assert not need_reference_policy(cfg) and not need_critic(cfg) and cfg.trainer.use_v1
        rollout, corr = cfg.actor_rollout_ref.rollout, cfg.algorithm.rollout_correction
        assert cfg.actor_rollout_ref.model.path == "/m/smollm2" and rollout.name == "vllm"
        assert cfg.trainer.total_training_steps == 25 and cfg.trainer.n_gpus_per_node == 1
        assert list(cfg.trainer.logger) == ["console", "file"] and cfg.ray_kwargs.ray_init.include_dashboard is False
        assert cfg.reward.custom_reward_function.path == "pkg://bloggap_plugin.tasks.verl_data"
        assert cfg.data.train_files == str(tmp_path / "data" / "train.parquet")
        # a run without the plugin cannot use the plugin's loss: verl refuses "gap_vanilla" when nothing
        # registered it (seen on the H200, 2026-12-01); nofix runs use verl's own vanilla loss
        disabled = env["BLOGGAP_VERL_DISABLE"] == "1"
        assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == ("vanilla" if disabled else "gap_vanilla")
        if disabled:
            assert not [o for o in argv if "+bloggap." in o or "loss_mode=gap_" in o]
        truncated = run.endswith(("/nofix", "/fix", "/guard"))
        assert rollout.top_p == (0.8 if truncated else 1.0)
        assert env["BLOGGAP_VERL_DISABLE"] == ("1" if run.endswith("/nofix") else "0")
        if run.startswith("seq_mis/"):
            assert (corr.rollout_is, corr.rollout_is_threshold, corr.rollout_rs, corr.rollout_rs_threshold) == (
                "sequence", 2.0, "seq_sum_k1", "0.5_2.0")
        else:
            assert (corr.rollout_is, corr.rollout_rs, corr.rollout_rs_threshold) == (None, "seq_mean_k1", "0.999_1.001")
        if run.endswith("/fix"):
            assert cfg.bloggap.kept_source == "retruncate" and cfg.actor_rollout_ref.model.use_fused_kernels is False
        elif run.endswith("/guard"):  # the bug with the plugin on: no lift, so the guard meets it
            assert cfg.bloggap.fix_truncation is False and load_settings(cfg.bloggap).guard == "warn"
        else:
            assert "bloggap" not in cfg or "kept_source" not in cfg.bloggap
        if run == "arm_E":
            assert cfg.bloggap.fp32_head is True
        if run in ("arm_B", "arm_F"):
            assert cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == {"arm_B": "fp32", "arm_F": "fp16"}[run]


def test_geo_rs_preset_matches_verls_dataclass(tmp_path):
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    for preset, ref in (("geo_rs", RolloutCorrectionConfig.decoupled_geo_rs()),
                        ("seq_mis", RolloutCorrectionConfig.decoupled_seq_is_rs())):
        got = dict(o.split("=", 1) for o in verl_records.PRESETS[preset])
        got = {k.rsplit(".", 1)[1]: v.strip("'") for k, v in got.items()}
        assert got["rollout_rs"] == ref.rollout_rs and got["rollout_rs_threshold"] == ref.rollout_rs_threshold
        assert got["rollout_is"] == (ref.rollout_is or "null")
        assert verl_records.RS_OPTION[preset] == ref.rollout_rs


def test_parse_console_reads_verls_local_logger(capsys):
    from verl.utils.logger import LocalLogger

    LocalLogger().log({"critic/score/mean": np.float64(0.25), "gap/verl/all_rejected": 1.0, "n": np.int64(3),
                       "flag": True, "text": "skip", "timing_s/step": 2.5}, step=7)
    LocalLogger().log({"critic/score/mean": 0.5}, step=8)
    out = "(TaskRunner pid=12) " + capsys.readouterr().out
    assert verl_records.parse_console(out) == [
        {"step": 7, "critic/score/mean": 0.25, "gap/verl/all_rejected": 1.0, "n": 3.0, "flag": 1.0, "timing_s/step": 2.5},
        {"step": 8, "critic/score/mean": 0.5},
    ]


def test_parse_metrics_file_and_step_table(tmp_path, monkeypatch):
    from verl.utils.tracking import Tracking

    path = tmp_path / "m.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    tracker = Tracking(project_name="bloggap", experiment_name="t", default_backend=["file"])
    tracker.log(data={"rollout_corr/rollout_rs_seq_mean_k1_seq_masked_fraction": 1.0, "gap/verl/all_rejected": 1.0,
                      "gap/verl/log_kept_mass_mean": -0.5, "critic/score/mean": 0.125}, step=1)
    tracker.finish()
    rows = verl_records.parse_metrics_file(path)
    assert rows == [{"step": 1, "rollout_corr/rollout_rs_seq_mean_k1_seq_masked_fraction": 1.0,
                     "gap/verl/all_rejected": 1.0, "gap/verl/log_kept_mass_mean": -0.5, "critic/score/mean": 0.125}]
    table = verl_records.step_table(rows, "geo_rs")
    assert table[0]["rejected_seq_frac"] == 1.0 and table[0]["reward"] == 0.125 and table[0]["oob_frac"] is None
    assert table[0]["kept_mass_mean_geo"] == pytest.approx(np.exp(-0.5), abs=1e-12)


def test_registered_processes_from_ray_prefixed_lines():
    text = "\n".join([
        "bloggap verl plugin registered (pid 100): policy loss gap_vanilla, ...",
        "(TaskRunner pid=200) bloggap verl plugin registered (pid 200): policy loss ...",
        "(WorkerDict pid=300) bloggap verl plugin registered (pid 300): policy loss ...",
        "(WorkerDict pid=300) bloggap verl plugin registered (pid 300): policy loss ...",
        "(pid=400, ip=1.2.3.4) something else",
    ])
    assert verl_records.registered_processes(text) == {"driver": [100], "TaskRunner": [200], "WorkerDict": [300]}
    record = verl_records.summarise("geo_rs/nofix", text + "\nbloggap: rollout correction preset decoupled_geo_rs (...)",
                                 Path("/nonexistent"), 0, 1.0)
    assert record["registered_in_driver_and_workers"] and record["guard_warnings"] == 1
    assert record["plugin_disabled"] and record["top_p"] == 0.8 and record["steps"] == []


def test_entry_point_is_found_by_importlib(tmp_path):
    import importlib.metadata

    verl_live.write_entry_point(tmp_path)
    dists = list(importlib.metadata.distributions(path=[str(tmp_path)]))
    assert [d.metadata["Name"] for d in dists] == ["bloggap"]
    eps = [(e.group, e.name, e.value) for e in dists[0].entry_points]
    assert eps == [("verl.plugins", "bloggap", "bloggap_plugin.verl")]


def test_dry_run_prints_commands_and_bad_run_name_is_one_line(tmp_path, spawns):
    script = [sys.executable, "-m", "benchmarks.verl_live"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([*script, "run", "--model", "/m", "--out", str(tmp_path), "--dry-run",
                           "--runs", "geo_rs/nofix,arm_E"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and "BLOGGAP_VERL_DISABLE=1" in lines[0] and "+bloggap.fp32_head=true" in lines[1]
    assert "-m verl.trainer.main_ppo" in lines[0] and "actor_rollout_ref.rollout.top_p=0.8" in lines[0]
    bad = subprocess.run([*script, "run", "--model", "/m", "--out", str(tmp_path), "--runs", "geo/fix"],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 1 and bad.stderr.strip().startswith("error: unknown run 'geo/fix'")
    assert "Traceback" not in bad.stderr
    missing = subprocess.run([*script, "run", "--model", "/m", "--out", str(tmp_path)],
                             capture_output=True, text=True, env=env)
    assert missing.returncode == 1 and "run `python -m benchmarks.verl_live prepare" in missing.stderr


def test_probe_reports_missing_and_present_modules():
    found = verl_live.probe(("json", "bloggap_no_such_module_xyz", "bloggap_plugin.tasks.verl_data"))
    assert found["json"] == "ok" and found["bloggap_plugin.tasks.verl_data"] == "ok"
    assert found["bloggap_no_such_module_xyz"] == "ModuleNotFoundError: No module named 'bloggap_no_such_module_xyz'"


def test_verls_rl_dataset_reads_the_prepared_parquet(tmp_path):
    """verl's own RLHFDataset, with the data config the harness composes, reads what `prepare` writes."""
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from bloggap_plugin.models import tiny_tokenizer
    from bloggap_plugin.tasks import arith

    verl_live.cmd_prepare(type("A", (), {"out": str(tmp_path), "n_train": 6})())
    argv, _ = verl_live.command("geo_rs/fix", "/m", tmp_path / "data", tmp_path)
    cfg = compose_ppo_trainer(argv[3:])
    cfg.data.dataloader_num_workers = 0
    tokenizer = tiny_tokenizer()
    dataset = RLHFDataset(cfg.data.train_files, tokenizer, cfg.data)
    assert len(dataset) == 6
    item = dataset[0]
    first = arith.make_problems(6, seed=0)[0]
    assert item["data_source"] == "bloggap/arith" and item["reward_model"]["ground_truth"] == str(first.answer)
    assert item["raw_prompt"][-1] == {"role": "user", "content": first.question}


def test_registered_processes_ansi_coloured_and_nameless_prefixes():
    text = "\n".join([
        "\x1b[36m(TaskRunner pid=200)\x1b[0m bloggap verl plugin registered (pid 200): ...",
        "\x1b[33m(pid=500)\x1b[0m bloggap verl plugin registered (pid 500): ...",
        "(pid=600, ip=10.0.0.1) bloggap verl plugin registered (pid 600): ...",
    ])
    assert verl_records.registered_processes(text) == {"TaskRunner": [200], "ray_worker": [500, 600]}
    record = verl_records.summarise("geo_rs/fix", text, Path("/nonexistent"), 0, 1.0)
    assert not record["registered_in_driver_and_workers"]  # no driver line


FAKE_MAIN_PPO = """#!/bin/sh
# stands in for `python -m verl.trainer.main_ppo` (and `python -m ray.scripts.scripts stop`)
[ "$2" = "ray.scripts.scripts" ] && exit 0
echo "bloggap verl plugin registered (pid 11): ..."
echo "(TaskRunner pid=12) bloggap verl plugin registered (pid 12): ..."
echo "(WorkerDict pid=13) bloggap verl plugin registered (pid 13): ..."
echo "(TaskRunner pid=12) bloggap: rollout correction preset decoupled_geo_rs (...)"
echo "(TaskRunner pid=12) step:1 - critic/score/mean:0.25 - gap/verl/all_rejected:np.float64(1.0)"
printf '{"step": 1, "data": {"critic/score/mean": 0.25, "rollout_corr/rollout_rs_seq_mean_k1_seq_masked_fraction": 1.0}}\\n' > "$VERL_FILE_LOGGER_PATH"
echo "BLOGGAP_VERL_DISABLE=$BLOGGAP_VERL_DISABLE cwd=$(pwd)"
"""


def _fake_setup(tmp_path, script: str) -> tuple[Path, Path]:
    """``(fake python, out)``: ``script`` stands in for the python that runs ray and main_ppo; a model folder and
    the prepared parquet files and entry point under ``out``."""
    fake = tmp_path / "fakepy"
    fake.write_text(script)
    fake.chmod(0o755)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    out = tmp_path / "out"
    verl_live.cmd_prepare(type("A", (), {"out": str(out), "n_train": 4})())
    return fake, out


def test_run_loop_writes_json_per_run_and_skips_past_budget(tmp_path, monkeypatch):
    fake, out = _fake_setup(tmp_path, FAKE_MAIN_PPO)
    monkeypatch.setattr(verl_live, "POLL_S", 0.05)  # the stand-in runs end at once
    argv = ["run", "--model", str(tmp_path / "model"), "--out", str(out), "--python", str(fake),
            "--runs", "geo_rs/nofix,geo_rs/fix", "--budget", "100"]
    verl_live.main(argv)
    result = json.loads((out / "verl_live_runs.json").read_text())
    nofix = result["runs"]["geo_rs/nofix"]
    assert nofix["rc"] == 0 and nofix["metrics_source"] == "file" and nofix["guard_warnings"] == 1
    assert nofix["registered"] == {"driver": [11], "TaskRunner": [12], "WorkerDict": [13]}
    assert nofix["registered_in_driver_and_workers"] and nofix["plugin_disabled"]
    assert [(s["step"], s["reward"], s["rejected_seq_frac"]) for s in nofix["steps"]] == [(1, 0.25, 1.0)]
    log = (out / "geo_rs_nofix.log").read_text()
    assert f"BLOGGAP_VERL_DISABLE=1 cwd={out}" in log
    assert "BLOGGAP_VERL_DISABLE=0" in (out / "geo_rs_fix.log").read_text()
    verl_live.main(argv[:-1] + ["30"] + ["--runs", "geo_rs/nofix,seq_mis/fix"])  # < 60 s left: both skipped
    result = json.loads((out / "verl_live_runs.json").read_text())
    assert set(result["runs"]["seq_mis/fix"]) == {"run", "skipped"}
    assert result["runs"]["geo_rs/nofix"] == nofix  # a finished run's record is not replaced by a skip


FAKE_PARALLEL = """#!/bin/sh
# ray start/stop are logged; main_ppo reports its cluster, and seq_mis/fix's first start dies of vLLM's
# memory-profiling race (the second starts cleanly)
if [ "$2" = "ray.scripts.scripts" ]; then echo "$3 $5 disable=$BLOGGAP_VERL_DISABLE ${PYTHONPATH%%:*}" >> "$FAKE_LOG"; exit 0; fi
for a in "$@"; do case "$a" in trainer.experiment_name=*) tag=${a#*=};; esac; done
if [ "$tag" = seq_mis_fix ] && [ ! -f "$FAKE_LOG.raced" ]; then
  touch "$FAKE_LOG.raced"; echo "AssertionError: Error in memory profiling. Initial free memory 1 GiB"; exit 1
fi
if [ "$tag" = geo_rs_nofix ] && [ ! -f "$FAKE_LOG.nokv" ]; then
  touch "$FAKE_LOG.nokv"; echo "ValueError: No available memory for the cache blocks. Try increasing"; exit 1
fi
if [ "$tag" = arm_B ]; then echo "ValueError: No available memory for the cache blocks."; exit 1; fi
sleep 1
echo "bloggap verl plugin registered (pid 11): ..."
printf '{"step": 1, "data": {"critic/score/mean": 0.5}}\\n' > "$VERL_FILE_LOGGER_PATH"
echo "main_ppo $tag RAY_ADDRESS=$RAY_ADDRESS" >> "$FAKE_LOG"
"""


def test_parallel_runs_get_their_own_cluster_and_survive_the_profiling_race(tmp_path, monkeypatch):
    fake, out = _fake_setup(tmp_path, FAKE_PARALLEL)
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "calls"))
    monkeypatch.setattr(verl_live, "POLL_S", 0.05)  # the stand-in runs end within a second
    verl_live.main(["run", "--model", str(tmp_path / "model"), "--out", str(out), "--python", str(fake),
                    "--runs", "geo_rs/nofix,seq_mis/fix,arm_B", "--budget", "400", "--parallel", "2"])
    calls = (tmp_path / "calls").read_text().splitlines()
    starts = [c for c in calls if c.startswith("start")]
    # slots 0, 1, then 0 again; each cluster starts with its run's environment (Ray workers inherit the raylet's)
    assert starts == [f"start --port=20000 disable=1 {out}/site", f"start --port=21000 disable=0 {out}/site",
                      f"start --port=20000 disable=0 {out}/site"]
    assert "main_ppo geo_rs_nofix RAY_ADDRESS=127.0.0.1:20000" in calls
    assert "main_ppo seq_mis_fix RAY_ADDRESS=127.0.0.1:21000" in calls
    assert sum(c.startswith("stop") for c in calls) == 2  # once per batch, after its last run
    runs = json.loads((out / "verl_live_runs.json").read_text())["runs"]
    assert runs["seq_mis/fix"]["attempts"] == 2 and runs["geo_rs/nofix"]["attempts"] == 2
    assert runs["arm_B"]["attempts"] == 2 and runs["arm_B"]["rc"] == 1  # started again once, not more
    assert (out / "seq_mis_fix.attempt1.log").exists()
    assert runs["seq_mis/fix"]["concurrent_with"] == ["geo_rs/nofix"] and runs["arm_B"]["concurrent_with"] == []
    assert all(r["rc"] == 0 and [s["reward"] for s in r["steps"]] == [0.5] for n, r in runs.items() if n != "arm_B")
    assert runs["arm_B"]["gpu_memory_utilization"] == verl_live.PARALLEL_GPU_MEMORY
    # document keeps how each run ran
    records = verl_records.resummarise(out, json.loads((out / "verl_live_runs.json").read_text()))
    assert records["seq_mis/fix"]["parallel"] == 2 and records["seq_mis/fix"]["attempts"] == 2


def test_parallel_slots_use_disjoint_ports_and_temp_dirs():
    seen, temp_dirs = set(), set()
    for slot in range(8):
        argv, address = verl_live.ray_start_command(slot, "py")
        flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
        ports = {int(v) for k, v in flags.items() if k.endswith("port") and k not in ("min-worker-port", "max-worker-port")}
        lo, hi = int(flags["min-worker-port"]), int(flags["max-worker-port"])
        span = ports | set(range(lo, hi + 1))
        assert address == f"127.0.0.1:{flags['port']}" and not span & seen and min(span) >= 20000
        seen |= span
        temp_dirs.add(flags["temp-dir"])
    assert len(temp_dirs) == 8
    with pytest.raises(SystemExit, match="--parallel 0"):
        verl_live.main(["run", "--model", "/m", "--out", "/o", "--parallel", "0", "--dry-run"])


@pytest.mark.parametrize("dump_head", ["fp32", "bf16"])
def test_check_head_tells_the_fp32_head_from_the_bf16_head(tmp_path, tiny_model, dump_head):
    """A dump made through the engine's own fp32-head hook (or the plain bf16 head) from verl's padded layout
    (rows right-padded in one batch): check-head's independent scoring agrees with the matching head (|d| ~ 0)
    and names it the closer one."""
    import torch

    from bloggap_plugin.verl.engine import fp32_output_head

    model, _ = tiny_model("tiny-random-llama", "bf16")
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    generator = torch.Generator().manual_seed(0)
    lengths = (7, 12, 5)
    batch = torch.randint(3, model.config.vocab_size, (3, 12), generator=generator)
    mask = (torch.arange(12)[None] < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        context = fp32_output_head(model) if dump_head == "fp32" else torch.autocast("cpu", enabled=False)
        with context:
            logits = model(input_ids=batch, attention_mask=mask).logits.float()
    logp = logits.log_softmax(-1)[:, :-1].gather(-1, batch[:, 1:, None])[..., 0]
    rows = [batch[r, :n] for r, n in enumerate(lengths)]
    # verl's rolled label at a row's end is the next row's first token: a value the check must ignore
    log_probs = [torch.cat([logp[r, :n - 1], torch.tensor([-5.0])]) for r, n in enumerate(lengths)]
    torch.save({"input_ids": torch.cat(rows), "offsets": torch.tensor([0, 7, 19, 24]),
                "log_probs": torch.cat(log_probs), "fp32_head": dump_head == "fp32"}, tmp_path / "arm_E.dump.1.pt")
    report = verl_live.check_head([tmp_path / "arm_E.dump.1.pt"], str(model_dir), device="cpu")
    same, other = (report["vs_fp32_head"], report["vs_bf16_head"])[:: 1 if dump_head == "fp32" else -1]
    assert same["tokens"] == other["tokens"] == 24 - 3
    assert same["max_abs_dlogp"] < 1e-4 and other["mean_abs_dlogp"] > 10 * same["mean_abs_dlogp"], report
    assert report["fp32_head_closer"] is (dump_head == "fp32")
    assert report["dump_fp32_head"] == [dump_head == "fp32"]
    # the heads' own difference on these rows: what the dump differs by from the other head, up to the ~0 above
    head = report["independent_head_diff"]
    assert head["tokens"] == 21 and head["mean_abs_dlogp"] == pytest.approx(other["mean_abs_dlogp"], abs=1e-4)


def test_registered_processes_named_from_other_lines_of_the_same_pid():
    """The shape of the H200 log (2026-11-30): workers register at import, under ``(pid=N)``, before Ray names
    them; the name comes from their later lines; a line an actor prints for its child counts under that actor."""
    text = "\n".join([
        "WARNING:2026-11-30 21:21:32,713:bloggap verl plugin registered (pid 8323): policy loss gap_vanilla, ...",
        "\x1b[36m(pid=9376)\x1b[0m WARNING:...:bloggap verl plugin registered (pid 9376): policy loss ...",
        "\x1b[36m(pid=10031)\x1b[0m WARNING:...:bloggap verl plugin registered (pid 10031): policy loss ...",
        "\x1b[36m(pid=10115)\x1b[0m WARNING:...:bloggap verl plugin registered (pid 10115): policy loss ...",
        "\x1b[36m(vLLMHttpServer pid=10206)\x1b[0m WARNING:...:bloggap verl plugin registered (pid 10309): ...",
        "\x1b[36m(pid=10777)\x1b[0m WARNING:...:bloggap verl plugin registered (pid 10777): never named",
        "\x1b[36m(TaskRunnerV1 pid=9376)\x1b[0m step:1 - critic/score/mean:0.25",
        "\x1b[36m(WorkerDict pid=10031)\x1b[0m loading model",
        "\x1b[36m(RewardLoopWorker pid=10115)\x1b[0m ready",
    ])
    assert verl_records.registered_processes(text) == {
        "driver": [8323], "TaskRunnerV1": [9376], "WorkerDict": [10031], "RewardLoopWorker": [10115],
        "vLLMHttpServer": [10309], "ray_worker": [10777]}
    record = verl_records.summarise("geo_rs/fix", text, Path("/nonexistent"), 0, 1.0)
    assert record["registered_in_driver_and_workers"]


def test_document_tables_from_run_records(tmp_path):
    """result_tables/head_table on two small runs: the means and counts are the step values' own."""
    from bloggap_plugin.results import ResultDocument

    def step(n, rejected, reward, kept=None, all_rejected=0.0, scale=1.0, dlogp=0.0, is_weight=None):
        return {"step": n, "rejected_seq_frac": rejected, "all_rejected": all_rejected, "reward": reward,
                "oob_frac": 0.0, "step_s": (10.0 + n) * scale, "kept_mass_mean_geo": kept, "abs_dlogp_max": dlogp,
                "old_log_prob_s": 2.0 * scale, "update_actor_s": 5.0, "rollout_probs_diff_mean": 0.01,
                "abs_dlogp_mean": dlogp / 4, "grad_norm": 0.0 if rejected == 1.0 else 0.5, "response_length": 10.0 + n,
                "is_weight_mean": is_weight}

    records = {
        "geo_rs/control": {"rc": 0, "top_p": 1.0, "plugin_disabled": False, "guard_warnings": 0, "registered": {"driver": [1], "TaskRunnerV1": [2]},
                           "steps": [step(1, 0.5, 0.2), step(2, 0.25, 0.4), step(3, 0.0, 0.6)]},
        "geo_rs/fix": {"rc": 0, "top_p": 0.8, "plugin_disabled": False, "registered": {"driver": [5]},
                       "steps": [step(1, 1.0, 0.1, 0.9, all_rejected=1.0), step(2, 0.5, 0.3, 0.95)]},
        "geo_rs/nofix": {"run": "geo_rs/nofix", "skipped": "40 s of --budget 500 s left"},
        # plugin off: no gap/verl/all_rejected metric, so a step with every sequence rejected counts from verl's share
        "seq_mis/control": {"rc": 0, "top_p": 0.8, "plugin_disabled": True, "guard_warnings": 0,
                            "steps": [step(1, 1.0, 0.1, all_rejected=None, is_weight=0.7),
                                      step(2, 0.5, 0.1, all_rejected=None, is_weight=0.8)]},
        "geo_rs/guard": {"rc": 0, "top_p": 0.8, "plugin_disabled": False, "guard_warnings": 2,
                         "steps": [step(1, 1.0, 0.1, all_rejected=1.0), step(2, 1.0, 0.1, all_rejected=1.0)]},
        "geo_rs/guard@before-log-handler": {"rc": 0, "top_p": 0.8, "plugin_disabled": False, "guard_warnings": 0,
                                            "steps": [step(1, 1.0, 0.1, all_rejected=1.0)]},
        "seq_mis/nofix": {"rc": 1, "top_p": 0.8, "plugin_disabled": True, "steps": [], "failure": "ValueError: x",
                          "parallel": 2},
        "arm_A": {"rc": 0, "top_p": 1.0, "plugin_disabled": False, "parallel": 2,
                  "steps": [step(1, 0.5, 0.2), step(2, 0.5, 0.2), step(3, 0.5, 0.2)]},
        "arm_E": {"rc": 0, "top_p": 1.0, "plugin_disabled": False, "parallel": 2,
                  "steps": [step(1, 0.5, 0.2, scale=1.5), step(2, 0.5, 0.2, scale=1.5, dlogp=0.08),
                            step(3, 0.5, 0.3, scale=1.5, dlogp=0.02, all_rejected=1.0)]},
    }
    tables = verl_records.result_tables(records)
    assert [t["id"] for t in tables] == ["T13v", "T13v-steps", "T13v-steps-seqmis", "T13v-arms"]
    runs = {row[0]: row for row in tables[0]["rows"]}
    assert runs["geo_rs/control"][3:18] == ["on", "alone", 3, 0, 0.25, 0, 0, None, None, 0.2, 0.6, 0.0, 0.5, 12.0, 12.5]
    assert runs["geo_rs/guard"][15] == 0.0  # every sequence rejected: nothing to learn from
    assert runs["seq_mis/control"][3] == "off" and runs["seq_mis/control"][8:11] == [1, 0, 0.75]
    assert runs["geo_rs/guard"][3] == "on, lift off" and runs["geo_rs/guard"][7:10] == [1.0, 2, 2]
    # a variant keeps its own row (the guard fired, no warning reached the console) and is not a steps-table column
    assert runs["geo_rs/guard@before-log-handler"][3] == "on, lift off"
    assert runs["geo_rs/guard@before-log-handler"][8:10] == [1, 0]
    assert "geo_rs/guard@before-log-handler: before the plugin's logger had its own handler" in tables[0]["notes"]
    assert not [c for t in tables[1:3] for c in t["columns"] if "@" in c]
    assert "Guard fired with no warning line in: geo_rs/fix, geo_rs/guard@before-log-handler, arm_E " in tables[0]["notes"]
    assert runs["seq_mis/control"][-1] == "none: plugin disabled"
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        verl_live.overrides("geo_rs/fix@nope", "m", "d", "o")
    base, variant = (verl_live.overrides(run, "m", "d", "o") for run in ("geo_rs/fix", "geo_rs/fix@trl-visible"))
    assert len(base) == len(variant) and "trainer.experiment_name=geo_rs_fix@trl-visible" in variant
    assert [o for o in variant if "geo_rs_fix@trl-visible" not in o] == [o for o in base if "geo_rs_fix" not in o]
    assert runs["geo_rs/fix"][7:12] == [0.75, 1, None, None, 0.925]
    assert runs["geo_rs/nofix"][5] == 0 and runs["geo_rs/nofix"][-1] == "40 s of --budget 500 s left"
    assert runs["seq_mis/nofix"][4] == "2 at once" and runs["seq_mis/nofix"][-1] == "failed: ValueError: x"
    # one table per preset, runs in RUNS order (control, fix, guard): rejected (+ kept mass of fix runs), rewards
    assert tables[1]["rows"] == [[1, 0.5, 1.0, 0.9, 1.0, 0.2, 0.1, 0.1],
                                 [2, 0.25, 0.5, 0.95, 1.0, 0.4, 0.3, 0.1],
                                 [3, 0.0, None, None, None, 0.6, None, None]]
    # Seq-MIS also shows the mean IS weight per step
    assert tables[2]["columns"] == ["step", "seq_mis/control rejected", "seq_mis/control IS weight",
                                    "seq_mis/control reward"]
    assert tables[2]["rows"] == [[1, 1.0, 0.7, 0.1], [2, 0.5, 0.8, 0.1]]
    assert "seq_mis/control IS weight" in tables[2]["plot"]["y"]
    assert "seq_mis/nofix (ValueError: x)" in tables[2]["notes"] and "geo_rs/nofix" in tables[1]["notes"]
    assert "geo_rs/fix: alone" in tables[1]["notes"]
    arms = {row[0]: row for row in tables[3]["rows"]}
    # medians without step 1: A (12 + 13) / 2 = 12.5, E 1.5x that; E's old pass 3.0 s; max |dlogp| over steps
    assert arms["arm_A"][2:] == ["2 at once", 3, 12.5, 1.0, 2.0, 5.0, 0.5, 0, 0.0, 0.0, 0.0, 0.01, 0.2]
    assert arms["arm_E"][4:13] == [18.75, 1.5, 3.0, 5.0, 0.5, 1, 0.0, 0.0, 0.08]  # step 1's mean |dlogp|: 0
    head = verl_records.head_table({"arm_E": {"dump_fp32_head": [True], "scored_on": "cuda:0",
                                           "vs_fp32_head": {"tokens": 9, "mean_abs_dlogp": 1e-6, "p99_abs_dlogp": 2e-6},
                                           "vs_bf16_head": {"tokens": 9, "mean_abs_dlogp": 0.01, "p99_abs_dlogp": 0.02},
                                           "independent_head_diff": {"tokens": 9, "mean_abs_dlogp": 0.012}}})
    assert head["rows"] == [["arm_E", "fp32", "cuda:0", 9, 0.0, 0.01, 0.0, 0.02, 0.012]]
    ResultDocument(benchmark="verl_live", env={}, params={}, results={}, tables=tables + [head]).validate()


def test_failure_reason_names_the_root_cause_not_rays_wrappers():
    log = "\n".join([
        "\x1b[36m(TaskRunnerV1 pid=6565)\x1b[0m           'truncation': 'error',",
        "\x1b[36m(vLLMHttpServer pid=11478)\x1b[0m (EngineCore pid=12483) ERROR 12-01 00:01:32 [core.py:1231] ValueError: "
        "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the "
        "engine (this flag also controls CPU memory reservation on the CPU backend, despite its name).",
        "ray.exceptions.RayTaskError(RuntimeError): ray::TaskRunnerV1.run() (pid=6565)",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ])
    reason = verl_records.failure_reason(log)
    assert reason.startswith("ValueError: No available memory for the cache blocks.") and len(reason) == 140
    assert verl_records.failure_reason("ActorDiedError: The actor died\nValueError: Unsupported loss mode: gap_vanilla.") == (
        "ValueError: Unsupported loss mode: gap_vanilla.")
    assert verl_records.failure_reason("all fine\nstep:1 - a:1") is None
    assert verl_records.failure_reason("(pid=1) RpcError: Running out of retries to initialize the metrics agent.\n"
                                    "ValueError: Unsupported loss mode: gap_vanilla.") == (
        "ValueError: Unsupported loss mode: gap_vanilla.")
    assert verl_records.summarise("geo_rs/nofix", log, Path("/nonexistent"), 1, 1.0)["failure"] == reason
    assert verl_records.summarise("geo_rs/nofix", log, Path("/nonexistent"), 0, 1.0)["failure"] is None


def test_the_result_env_is_the_machine_the_probe_read():
    """``document`` takes the env the probe recorded on the GPU machine (GPU, driver, date with the versions); a probe
    that recorded none leaves only ``--gpu``, marked as given by hand, or says it was not recorded."""
    machine = {"gpu": "NVIDIA H200", "driver": "580.159.04", "date": "2026-12-02T00:00:00+00:00", "cuda": "13.0"}
    env = verl_live.document_env({"machine": machine, "versions": {"verl": "0.9.1"}}, gpu="something else")
    assert env == {**machine, "verl": "0.9.1"}
    assert verl_live.document_env({"versions": {"verl": "0.9.1"}}, gpu="NVIDIA H200") == {
        "verl": "0.9.1", "gpu": "NVIDIA H200", "gpu_source": "given by hand (--gpu): this probe did not read the machine"}
    assert verl_live.document_env({}, gpu=None) == {"gpu": None, "gpu_source": "not recorded"}
