"""verl 0.9.1 end to end with the bloggap plugin (issue 13, items 1-3). GPU machine only; ran on the H200 2026-11-30.

Each run is one ``python -m verl.trainer.main_ppo`` (single GPU, FSDP actor, vLLM rollout in the hybrid engine, Ray
local without dashboard, GRPO on the arithmetic task, SmolLM2-135M-Instruct) of ``--steps`` steps. After each run
``verl_live_runs.json`` under ``--out`` is rewritten (a time limit keeps what finished), beside ``<run>.log`` (the
driver's console: Ray forwards every worker's output there) and ``<run>.metrics.jsonl`` (verl's ``file`` logger).

    python -m benchmarks.verl_live probe                              # imports a run needs; names what is missing
    python -m benchmarks.verl_live prepare --out $OUT                 # parquet + bloggap entry point (CPU, seconds)
    python -m benchmarks.verl_live run --model /tmp/vx/smollm2 --out $OUT --runs geo_rs/control,geo_rs/nofix,geo_rs/fix
    python -m benchmarks.verl_live run ... --dry-run                  # print the commands, run nothing

Runs (``RUNS``): ``<preset>/control`` (untruncated, plugin on, arm A's ``gap_vanilla``: item 1 and item 3 arm A),
``<preset>/nofix`` (rollout top_p 0.8, ``BLOGGAP_VERL_DISABLE=1``), ``<preset>/fix`` (top_p 0.8 with
``recipes/verl/truncation_fix.yaml``), ``<preset>/guard`` (top_p 0.8, plugin on with its lift off: the bug, met by
the all-rejected guard) for the presets Geo-RS (``seq_mean_k1`` 0.999_1.001) and Seq-MIS (sequence IS
2.0 + ``seq_sum_k1`` 0.5_2.0); ``arm_E``, ``arm_B``, ``arm_F`` (untruncated Geo-RS with ``recipes/verl/arm_X.yaml``).

bloggap is not pip-installed on the GPU machine: ``prepare`` writes a ``bloggap-0.1.0.dist-info`` with the
``verl.plugins`` entry point under ``$OUT/site`` and every run puts that folder and the repo on ``PYTHONPATH``, so
verl loads the plugin in the driver, the TaskRunner and every Ray worker (checked: the "registered" line per process).

What the runs are and what their logs say (run specs, log parsing, run records, the T13v tables) is in
``benchmarks/_lib/verl_records.py``; this script runs verl and writes the files.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from benchmarks._lib.paths import ROOT
from benchmarks._lib.verl_records import (
    PRESETS,
    RUNS,
    TOP_P_TRUNCATED,
    head_table,
    result_tables,
    resummarise,
    run_spec,
    run_tag,
    summarise,
)

RUNS_JSON = "verl_live_runs.json"  # the run records under --out (document turns them into the result document)
DUMP_ENV = "BLOGGAP_VERL_DUMP_LOGPROBS"  # bloggap_plugin.verl.engine.DUMP_ENV (not imported: torch-free here)
# --parallel: each concurrent run gets its own Ray cluster (``ray start`` with its own ports and temp dir: two local
# ``ray.init()`` clusters would both bind the dashboard agent's fixed port 52365) and a smaller vLLM share of the GPU
PARALLEL_GPU_MEMORY = 0.12  # x 139 GiB = 16.7 GiB per engine; SmolLM2-135M needs < 1 GiB of weights
RAY_PORT_BASE = 20000  # slot k uses ports RAY_PORT_BASE + 1000 k ... + 999 (Ray's own defaults stay below 20000)
POLL_S = 2.0  # seconds between looks at the running runs (each runs for minutes)
# vLLM start-up failures caused by the other runs on the GPU, not by the run: its memory profiling saw another
# process free memory, or counted another process's growth as its own and left no KV cache (seen at 5 runs x 0.12)
START_RACES = ("Error in memory profiling", "No available memory for the cache blocks")


def recipe_overrides(name: str) -> list[str]:
    """The ``overrides`` list of ``recipes/verl/<name>``."""
    from bloggap_plugin._input_files import load_yaml_file

    path = ROOT / "recipes" / "verl" / name
    return list(load_yaml_file(path, str(path), "give a verl recipe with an overrides: list")["overrides"])


def overrides(run: str, model: str, data_dir: str | Path, out: str | Path, steps: int = 20,
              parallel: bool = False) -> list[str]:
    """Hydra overrides of ``run`` for ``verl.trainer.main_ppo`` (sized for SmolLM2-135M: 16 prompts x 8 samples x
    <= 64 tokens per step, one optimizer step per step; 8-10 s per step measured alone on the H200). ``parallel``:
    the run shares the GPU with others (``PARALLEL_GPU_MEMORY`` for its vLLM engine instead of 0.3)."""
    spec = run_spec(run)
    data_dir, out = Path(data_dir), Path(out)
    tag = run_tag(run)
    base = [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        f"data.train_files={data_dir / 'train.parquet'}",
        f"data.val_files={data_dir / 'val.parquet'}",
        "data.train_batch_size=16",
        "data.max_prompt_length=256",  # SmolLM2 chat template + 3 solved examples: 193-195 tokens
        "data.max_response_length=64",
        "data.dataloader_num_workers=2",
        "data.seed=0",
        f"actor_rollout_ref.model.path={model}",
        # the GPU image has no flash-attn package (verl's default flash_attention_2 needs it); sdpa cannot run
        # verl's packed (remove-padding) layout, so rows are padded instead
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.actor.strategy=fsdp",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.use_torch_compile=false",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.rollout.temperature=1.0",
        f"actor_rollout_ref.rollout.top_p={TOP_P_TRUNCATED if spec['truncated'] else 1.0}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={PARALLEL_GPU_MEMORY if parallel else 0.3}",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.agent.num_workers=2",
        "reward.num_workers=2",
        "reward.custom_reward_function.path=pkg://bloggap_plugin.tasks.verl_data",
        "reward.custom_reward_function.name=compute_score",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.logger=[console,file]",
        "trainer.project_name=bloggap",
        f"trainer.experiment_name={tag}",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=100",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.default_local_dir={out / 'ckpt' / tag}",
        "+ray_kwargs.ray_init.include_dashboard=false",
    ]
    extra = [o for recipe in spec["recipes"] for o in recipe_overrides(recipe)] + spec["extra"]
    return base + PRESETS[spec["preset"]] + extra


def ray_start_command(slot: int, python: str = sys.executable) -> tuple[list[str], str]:
    """``(argv, address)`` of the Ray cluster of parallel slot ``slot``: ``ray start --head`` with ports
    ``RAY_PORT_BASE + 1000 slot`` onwards, temp dir ``/tmp/ray_s<slot>``, one GPU, no dashboard."""
    base = RAY_PORT_BASE + 1000 * slot
    ports = {"port": base, "node-manager-port": base + 1, "object-manager-port": base + 2,
             "dashboard-agent-listen-port": base + 3, "dashboard-agent-grpc-port": base + 4,
             "runtime-env-agent-port": base + 5, "metrics-export-port": base + 6, "ray-client-server-port": base + 7,
             "min-worker-port": base + 100, "max-worker-port": base + 999}
    argv = [python, "-m", "ray.scripts.scripts", "start", "--head", *(f"--{k}={v}" for k, v in ports.items()),
            f"--temp-dir=/tmp/ray_s{slot}", "--num-gpus=1", "--include-dashboard=false",
            "--object-store-memory=4000000000", "--disable-usage-stats"]
    return argv, f"127.0.0.1:{base}"


def command(run: str, model: str, data_dir: str | Path, out: str | Path, steps: int = 20,
            python: str = sys.executable, ray_address: str | None = None) -> tuple[list[str], dict[str, str]]:
    """``(argv, environment additions)`` of one run; ``ray_address``: join that cluster (``--parallel``) instead
    of starting a local one."""
    out = Path(out)
    tag = run_tag(run)
    env = {
        "PYTHONPATH": os.pathsep.join([str(out / "site"), str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        "VERL_FILE_LOGGER_PATH": str(out / f"{tag}.metrics.jsonl"),
        "RAY_DEDUP_LOGS": "0",  # every worker's "registered" line reaches the driver's console
        "RAY_AUTH_MODE": "disabled",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",  # FlashInfer is not carried (VLLM.md)
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "BLOGGAP_VERL_DISABLE": "1" if run_spec(run)["disable"] else "0",
    }
    if run in ("geo_rs/control", "arm_E"):  # step 1's old log-probs of the first micro-batch, for check-head
        env[DUMP_ENV] = str(out / f"{tag}.dump")
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    argv = [python, "-m", "verl.trainer.main_ppo", *overrides(run, model, data_dir, out, steps, bool(ray_address))]
    return argv, env


# ------------------------------------------------------------------------------------------------ commands

PROBE_MODULES = (
    "ray", "vllm", "verl", "verl.trainer.main_ppo", "transfer_queue", "verl.trainer.ppo.v1.trainer_base",
    "verl.trainer.ppo.ray_trainer", "verl.workers.engine_workers", "verl.workers.engine.fsdp.transformer_impl",
    "verl.experimental.agent_loop", "verl.experimental.reward_loop", "verl.workers.rollout.vllm_rollout",
    "bloggap_plugin.verl", "bloggap_plugin.tasks.verl_data",
)
"""What a run imports (the first GPU check after the install: one call names every missing wheel)."""


def probe(modules: tuple[str, ...] = PROBE_MODULES) -> dict[str, str]:
    """``{module: "ok" | "<ExceptionType>: <message>"}`` importing each of ``modules``, each in this process."""
    import importlib

    found = {}
    for name in modules:
        try:
            importlib.import_module(name)
            found[name] = "ok"
        except BaseException as exc:  # noqa: BLE001 - SystemExit from a bad plugin setting is a finding too
            found[name] = f"{type(exc).__name__}: {exc}"
    return found


def cmd_probe(args) -> None:
    import importlib.metadata

    found = probe()
    versions = {}
    for dist in ("ray", "verl", "vllm", "torch", "transformers", "tensordict", "transferqueue", "peft", "hydra-core"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    eps = [e.value for e in importlib.metadata.entry_points(group="verl.plugins")]
    for name, status in found.items():
        print(f"{'ok  ' if status == 'ok' else 'FAIL'} {name}" + ("" if status == "ok" else f": {status}"))
    print("versions", json.dumps(versions), "verl.plugins entry points", eps, flush=True)
    if args.out:
        from bloggap_plugin.envinfo import environment_record

        machine = environment_record()  # read here, on the machine that runs verl: GPU, driver, CUDA, date
        _write_json(Path(args.out) / "verl_probe.json", {"imports": found, "versions": versions, "entry_points": eps,
                                                         "machine": machine})
    if any(status != "ok" for status in found.values()):
        sys.exit(1)


def write_entry_point(site: str | Path) -> Path:
    """A ``bloggap-0.1.0.dist-info`` under ``site`` declaring ``verl.plugins: bloggap = bloggap_plugin.verl`` (the
    repo itself goes on ``PYTHONPATH``); returns the dist-info folder."""
    info = Path(site) / "bloggap-0.1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bloggap\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[verl.plugins]\nbloggap = bloggap_plugin.verl\n")
    return info


def cmd_prepare(args) -> None:
    from bloggap_plugin.tasks.verl_data import write_verl_parquet

    out = Path(args.out).resolve()
    train, val = write_verl_parquet(out / "data", n_train=args.n_train, n_val=64, seed=0)
    info = write_entry_point(out / "site")
    print(f"wrote {train}, {val}, {info}")


def _write_json(path: Path, payload: dict) -> None:
    from bloggap_plugin._io import atomic_write_text

    atomic_write_text(path, json.dumps(payload, indent=1, allow_nan=False) + "\n")


def _launch(run: str, args, out: Path, ray_address: str | None, timeout: float) -> dict:
    """Start one run in the background (its own process group); its console goes to ``<tag>.log``."""
    argv, env = command(run, args.model, out / "data", out, args.steps, args.python, ray_address)
    tag = run_tag(run)
    (out / f"{tag}.metrics.jsonl").unlink(missing_ok=True)
    handle = open(out / f"{tag}.log", "w")
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=handle, stderr=subprocess.STDOUT, cwd=out,
                            start_new_session=True)
    return {"proc": proc, "handle": handle, "start": time.time(), "timeout": timeout}


def _wait(job: dict) -> int | None:
    """The run's exit code once it has ended, killed (``None``) once past its timeout; ``-1`` while it runs."""
    rc = job["proc"].poll()
    if rc is None and time.time() - job["start"] <= job["timeout"]:
        return -1
    if rc is None:
        try:
            os.killpg(job["proc"].pid, 9)
        except ProcessLookupError:
            pass
        job["proc"].wait()
    job["handle"].close()
    return rc


def _record(run: str, out: Path, rc: int | None, wall_s: float, result: dict, result_path: Path, **extra) -> None:
    tag = run_tag(run)
    record = summarise(run, (out / f"{tag}.log").read_text(errors="replace"), out / f"{tag}.metrics.jsonl", rc,
                       wall_s, extra)
    result["runs"][run] = record
    _write_json(result_path, result)
    last = record["steps"][-1] if record["steps"] else {}
    print(f"{run}: rc={rc} {record['wall_s']} s, {len(record['steps'])} steps, registered {record['registered']}, "
          f"guard warnings {record['guard_warnings']}, last step {last}", flush=True)


def _skip(run: str, left: float, budget: float, result: dict, result_path: Path) -> None:
    print(f"{run}: skipped, {left:.0f} s of --budget left", flush=True)
    if "rc" not in result["runs"].get(run, {}):  # keep a finished run's record from an earlier call
        result["runs"][run] = {"run": run, "skipped": f"{left:.0f} s of --budget {budget} s left"}
        _write_json(result_path, result)


def _ray_stop(python: str) -> None:
    # a run killed by its timeout leaves its Ray cluster up; ray stop ends every cluster on the machine
    subprocess.run([python, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True, check=False)


def _run_batch(batch: list[str], args, out: Path, result: dict, result_path: Path, deadline: float) -> None:
    """``batch`` at once on the one GPU, one Ray cluster each. A run whose vLLM engine failed to start because of
    the others (``START_RACES``) is started once more while the budget allows."""
    addresses = {}
    for slot, run in enumerate(batch):
        argv, addresses[run] = ray_start_command(slot, args.python)
        # Ray's workers inherit the raylet's environment, not the driver's: the cluster starts with the run's own
        # (PYTHONPATH with the entry point, BLOGGAP_VERL_DISABLE, ...), as a local ray.init() cluster would
        run_env = command(run, args.model, out / "data", out, args.steps, args.python)[1]
        started = subprocess.run(argv, capture_output=True, text=True, check=False, env={**os.environ, **run_env})
        if started.returncode:
            sys.exit(f"error: ray start for slot {slot} failed: {started.stderr.strip()[-400:]}")
    timeout = min(args.run_timeout, deadline - time.time())
    jobs = {run: _launch(run, args, out, address, timeout) for run, address in addresses.items()}
    attempts = dict.fromkeys(batch, 1)
    first_start = {run: job["start"] for run, job in jobs.items()}
    while jobs:
        time.sleep(POLL_S)
        for run, job in list(jobs.items()):
            rc = _wait(job)
            if rc == -1:
                continue
            tag = run_tag(run)
            log = out / f"{tag}.log"
            left = deadline - time.time()
            text = log.read_text(errors="replace")
            if rc and attempts[run] < 2 and left > 150 and any(race in text for race in START_RACES):
                log.rename(out / f"{tag}.attempt{attempts[run]}.log")
                attempts[run] += 1
                print(f"{run}: vLLM start-up failed on the shared GPU, started again ({left:.0f} s left)", flush=True)
                jobs[run] = _launch(run, args, out, addresses[run], min(args.run_timeout, left))
                continue
            del jobs[run]
            _record(run, out, rc, time.time() - first_start[run], result, result_path, parallel=len(batch),
                    concurrent_with=[r for r in batch if r != run], attempts=attempts[run],
                    gpu_memory_utilization=PARALLEL_GPU_MEMORY)
    _ray_stop(args.python)


def cmd_run(args) -> None:
    out = Path(args.out).resolve()  # the runs' cwd is out: every path in the commands is absolute
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    for run in runs:
        run_spec(run)  # every name checked before anything starts
    if args.parallel < 1:
        raise ValueError(f"--parallel {args.parallel}: give 1 (one run after another) or more (runs at once)")
    if args.dry_run:
        for index, run in enumerate(runs):
            address = ray_start_command(index % args.parallel, args.python)[1] if args.parallel > 1 else None
            argv, env = command(run, args.model, out / "data", out, args.steps, args.python, address)
            print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv))
        return
    missing = [p for p in (out / "data" / "train.parquet", out / "site") if not p.exists()]
    if missing:
        sys.exit(f"error: {missing[0]} is missing: run `python -m benchmarks.verl_live prepare --out {out}` first")
    if not Path(args.model, "config.json").exists():
        sys.exit(f"error: {args.model}/config.json not found: --model must be a HF folder (VLLM.md: mk_smollm2.py)")
    result_path = out / RUNS_JSON
    result = json.loads(result_path.read_text()) if result_path.exists() else {"runs": {}}
    deadline = time.time() + args.budget
    if args.parallel > 1:
        for first in range(0, len(runs), args.parallel):
            batch, left = runs[first:first + args.parallel], deadline - time.time()
            if left < 60:
                for run in batch:
                    _skip(run, left, args.budget, result, result_path)
                continue
            _run_batch(batch, args, out, result, result_path, deadline)
        return
    for run in runs:
        left = deadline - time.time()
        if left < 60:
            _skip(run, left, args.budget, result, result_path)
            continue
        job = _launch(run, args, out, None, min(args.run_timeout, left))
        while (rc := _wait(job)) == -1:
            time.sleep(POLL_S)
        _ray_stop(args.python)
        _record(run, out, rc, time.time() - job["start"], result, result_path)


def score_rows_independently(model, input_ids: torch.Tensor, offsets: torch.Tensor) -> dict:
    """The rows of a dump scored by ``model`` (bf16 HF causal LM, sdpa) in the layout verl's engine used with
    ``use_remove_padding=false``: one batch, rows right-padded to the longest, attention mask, positions 0..n-1.
    Per-token log-probs of ``input_ids[t+1]`` at ``t`` with the bf16 head and with an fp32 head (``hidden.float() @
    W.float().T``, written out here, not bloggap's), flat ``[total]`` in the dump's layout (last token of a row: NaN)."""
    import torch

    head = model.get_output_embeddings().weight
    lengths = offsets.diff().tolist()
    batch = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(batch)
    for row, (start, length) in enumerate(zip(offsets[:-1].tolist(), lengths)):
        batch[row, :length] = input_ids[start:start + length]
        mask[row, :length] = 1
    with torch.no_grad():
        out = model(input_ids=batch.to(head.device), attention_mask=mask.to(head.device), output_hidden_states=True)
        hidden = out.hidden_states[-1]
        scored = {}
        for name, logits in (("bf16_head", out.logits.float()), ("fp32_head", hidden.float() @ head.float().T)):
            values = torch.full(input_ids.shape, float("nan"))
            logp = logits.log_softmax(-1)[:, :-1].gather(-1, batch[:, 1:, None].to(head.device))[..., 0].cpu()
            for row, (start, length) in enumerate(zip(offsets[:-1].tolist(), lengths)):
                values[start:start + length - 1] = logp[row, :length - 1]
            scored[name] = values
    return scored


def check_head(dump_paths: list[Path], model_dir: str, device: str = "cuda") -> dict:
    """Arm E's old log-probs (dumped by the engine override at step 1, before any update) against an independent
    scoring of the same tokens with the fp32 head and with the bf16 head: mean and max |dlogp| over every
    position of every row. The fp32-head difference must be the smaller: what is left of it is the bf16 body
    (verl's padded FSDP batch vs batch 1 here)."""
    import torch
    from transformers import AutoModelForCausalLM

    if Path(model_dir, "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    else:  # a bloggap model spec, e.g. "smollm2" (the GGUF the GPU machine's folder was made from)
        from bloggap_plugin.models import load_model

        model = load_model(model_dir, dtype="bf16", attn_implementation="sdpa")[0]
    model = model.to(device).eval()
    report = {"files": [p.name for p in dump_paths]}
    diffs: dict[str, list] = {"fp32_head": [], "bf16_head": []}
    head_parts = []  # |fp32 head - bf16 head| of this forward
    flags = []
    for path in dump_paths:
        dump = torch.load(path, weights_only=True)
        flags.append(bool(dump["fp32_head"]))
        scored = score_rows_independently(model, dump["input_ids"], dump["offsets"])
        keep = torch.isfinite(scored["fp32_head"])
        for name, values in scored.items():
            diffs[name].append((dump["log_probs"][keep] - values[keep]).abs())
        head_parts.append((scored["fp32_head"][keep] - scored["bf16_head"][keep]).abs())
    head = torch.cat(head_parts).double()
    # what the two heads differ by on these rows in this forward: the size arm E's old pass should differ from
    # a bf16-head forward of the same rows (gap_vanilla's |dlogp| in verl)
    report["independent_head_diff"] = {"tokens": int(head.numel()), "mean_abs_dlogp": float(head.mean()),
                                       "max_abs_dlogp": float(head.max())}
    for name, parts in diffs.items():
        d = torch.cat(parts).double()
        report[f"vs_{name}"] = {"tokens": int(d.numel()), "mean_abs_dlogp": float(d.mean()), "max_abs_dlogp": float(d.max()),
                                "p99_abs_dlogp": float(d.quantile(0.99))}
    report["dump_fp32_head"] = flags
    report["fp32_head_closer"] = report["vs_fp32_head"]["mean_abs_dlogp"] < report["vs_bf16_head"]["mean_abs_dlogp"]
    report["scored_on"] = str(next(model.parameters()).device)
    return report


def cmd_check_head(args) -> None:
    out = Path(args.out).resolve()
    dumps = sorted(out.glob(f"{run_tag(args.run)}.dump.*.pt"))
    if not dumps:
        sys.exit(f"error: no {args.run} dump under {out}: run it with `python -m benchmarks.verl_live run` (it sets {DUMP_ENV})")
    report = check_head(dumps, args.model, args.device)
    result_path = out / RUNS_JSON
    result = json.loads(result_path.read_text()) if result_path.exists() else {"runs": {}}
    result.setdefault("head_check", {})[args.label or args.run] = report
    _write_json(result_path, result)
    print("check-head", json.dumps(report), flush=True)


def document_env(probe: dict, gpu: str | None) -> dict:
    """The result's ``env``: the machine record the probe read on the GPU machine, with the package versions; a
    probe written before it recorded the machine leaves only ``--gpu``, marked as given by hand."""
    env = {**probe.get("machine", {}), **probe.get("versions", {})}
    if "gpu" not in env:
        env["gpu"] = gpu
        env["gpu_source"] = "given by hand (--gpu): this probe did not read the machine" if gpu else "not recorded"
    return env


def cmd_document(args) -> None:
    from bloggap_plugin.results import ResultDocument

    folder = Path(args.folder).resolve()
    runs_json = json.loads((folder / RUNS_JSON).read_text())
    records = resummarise(folder, runs_json)
    probe = json.loads((folder / "verl_probe.json").read_text()) if (folder / "verl_probe.json").exists() else {}
    document = ResultDocument(
        benchmark="verl_live",
        env=document_env(probe, args.gpu),
        params={"model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantised, fp32)", "task": "arith",
                "overrides": {run: overrides(run, "MODEL", "DATA", "OUT", len(r.get("steps", [])) or 20,
                                             r.get("parallel", 1) > 1) for run, r in records.items()},
                "command": "bash benchmarks/gpu/verl_call.sh RUNS STEPS BUDGET RUN_TIMEOUT (one device call)"},
        results={"runs": records, "head_check": runs_json.get("head_check", {}), "probe": probe},
        tables=result_tables(records) + ([head_table(runs_json["head_check"])] if runs_json.get("head_check") else []))
    print(f"wrote {document.write(args.json)}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="write the parquet files and the bloggap entry point under --out")
    prep.add_argument("--out", required=True)
    prep.add_argument("--n-train", type=int, default=1024)
    doc = sub.add_parser("document", help="the result document for bloggap report, from a folder of run files")
    doc.add_argument("folder", help="folder with verl_live_runs.json, <run>.log, <run>.metrics.jsonl, verl_probe.json")
    doc.add_argument("--json", required=True, help="where to write it, e.g. benchmarks/results/h200/verl_live.json")
    doc.add_argument("--gpu", default=None, help="the GPU's name, for a probe that did not read the machine")
    chk = sub.add_parser("check-head", help="arm E's dumped step-1 old log-probs vs an independent fp32-head scoring")
    chk.add_argument("--out", required=True)
    chk.add_argument("--model", required=True, help="HF folder, or a bloggap model spec such as smollm2")
    chk.add_argument("--run", default="arm_E")
    chk.add_argument("--device", default="cuda")
    chk.add_argument("--label", default=None, help="the record's name in head_check (default: --run)")
    pro = sub.add_parser("probe", help="import every module a run needs; name the missing ones (exit 1 if any)")
    pro.add_argument("--out", default=None, help="also write verl_probe.json here")
    run = sub.add_parser("run", help="run verl main_ppo for each of --runs")
    run.add_argument("--out", required=True)
    run.add_argument("--model", required=True, help="SmolLM2 HF folder, e.g. /tmp/vx/smollm2")
    run.add_argument("--runs", default="geo_rs/control,geo_rs/nofix,geo_rs/fix", help=f"comma list of {', '.join(RUNS)}")
    run.add_argument("--steps", type=int, default=20)
    run.add_argument("--run-timeout", type=float, default=280.0, help="seconds per run before it is killed")
    run.add_argument("--budget", type=float, default=540.0,
                     help="seconds for all --runs together (a device call has 600 s); a run not started with < 60 s left is skipped")
    run.add_argument("--parallel", type=int, default=1,
                     help="runs at once on the one GPU, each with its own Ray cluster and a "
                          f"{PARALLEL_GPU_MEMORY} vLLM memory share (step times then include the sharing)")
    run.add_argument("--python", default=sys.executable)
    run.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    try:
        {"prepare": cmd_prepare, "probe": cmd_probe, "run": cmd_run, "check-head": cmd_check_head,
         "document": cmd_document}[args.cmd](args)
    except ValueError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
