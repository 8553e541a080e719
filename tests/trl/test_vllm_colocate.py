"""Arm H on TRL's vLLM colocate path: the engine's dtype is set while the trainer is built and checked at attach."""

from __future__ import annotations

import json
import subprocess
import sys
import types
import warnings

import pytest
import torch
from _support import ROOT
from _support.events import HANG_S

from bloggap_plugin.recipes import RecipeError
from bloggap_plugin.trl.attach import check_vllm_fp16
from bloggap_plugin.trl.mixin import GapMixin
from bloggap_plugin.trl.vllm_colocate import colocate_engine_dtype, vllm_colocate_dtype


@pytest.fixture
def fake_llm(monkeypatch):
    from trl.generation import vllm_generation

    calls = []

    def llm(*args, **kwargs):
        calls.append(kwargs)
        return types.SimpleNamespace(kwargs=kwargs)

    monkeypatch.setattr(vllm_generation, "LLM", llm, raising=False)
    monkeypatch.delenv("BLOGGAP_VLLM_KV_CACHE_GIB", raising=False)  # a user's setting must not change these tests
    return vllm_generation, llm, calls


def test_dtype_is_added_inside_the_block_only(fake_llm):
    module, original, calls = fake_llm
    with vllm_colocate_dtype("fp16"):
        module.LLM(model="m")
        module.LLM(model="m", dtype="bfloat16")  # an explicit dtype wins
    module.LLM(model="m")
    assert [c.get("dtype") for c in calls] == ["float16", "bfloat16", None]
    assert module.LLM is original


def test_original_llm_restored_after_an_error(fake_llm):
    module, original, _ = fake_llm
    with pytest.raises(KeyError), vllm_colocate_dtype(torch.float16):
        raise KeyError("boom")
    assert module.LLM is original


def test_bad_dtype_and_missing_vllm(monkeypatch):
    with pytest.raises(ValueError, match="unsupported vLLM dtype 'int8'"):
        with vllm_colocate_dtype("int8"):
            pass
    from trl.generation import vllm_generation

    monkeypatch.delattr(vllm_generation, "LLM", raising=False)
    with pytest.raises(RuntimeError, match="vLLM is not installed"):
        with vllm_colocate_dtype("float16"):
            pass


def _trainer(dtype, mode="colocate", as_string=False):
    config = types.SimpleNamespace(dtype=str(dtype).replace("torch.", "") if as_string else dtype)
    engine = types.SimpleNamespace(model_config=config)
    return types.SimpleNamespace(vllm_mode=mode, vllm_generation=types.SimpleNamespace(llm=types.SimpleNamespace(llm_engine=engine)))


def test_engine_dtype_read_from_vllm_objects():
    assert colocate_engine_dtype(_trainer(torch.float16)) == torch.float16
    assert colocate_engine_dtype(_trainer(torch.bfloat16, as_string=True)) == torch.bfloat16
    assert colocate_engine_dtype(types.SimpleNamespace()) is None


def test_arm_h_refuses_a_bf16_engine_and_accepts_fp16():
    with pytest.raises(RecipeError, match="arm H .* needs vLLM to sample in fp16.*bfloat16.*vllm_colocate_dtype"):
        check_vllm_fp16(_trainer(torch.bfloat16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_vllm_fp16(_trainer(torch.float16))
    with pytest.warns(UserWarning, match="--dtype float16"):
        check_vllm_fp16(_trainer(None, mode="server"))
    with pytest.warns(UserWarning, match="could not read"):
        check_vllm_fp16(types.SimpleNamespace(vllm_mode="colocate"))


def test_gap_grpo_trainer_builds_the_colocate_engine_in_fp16_for_arm_h(fake_llm, monkeypatch):
    """GapGRPOTrainer wraps TRL's construction (where TRL calls LLM(...)) for arm H with use_vllm colocate only."""
    from trl import GRPOTrainer

    from bloggap_plugin.recipes import GapConfig
    from bloggap_plugin.trl.callback import GapGRPOTrainer

    module, _, calls = fake_llm

    def fake_init(self, *args, **kwargs):
        module.LLM(model="m")

    monkeypatch.setattr(GRPOTrainer, "__init__", fake_init)
    monkeypatch.setattr(GapMixin, "_gap_attach", lambda self, *a, **k: None)
    vllm_args = types.SimpleNamespace(use_vllm=True, vllm_mode="colocate")
    GapGRPOTrainer(args=vllm_args, gap=GapConfig(arm="H"))
    GapGRPOTrainer(args=vllm_args, gap=GapConfig(arm="A"))
    GapGRPOTrainer(args=types.SimpleNamespace(use_vllm=True, vllm_mode="server"), gap=GapConfig(arm="H"))
    assert [c.get("dtype") for c in calls] == ["float16", None, None]


def test_engine_kwargs_from_the_environment():
    from bloggap_plugin.core.errors import UsageError
    from bloggap_plugin.trl.vllm_colocate import KV_CACHE_ENV, engine_kwargs_from_env

    assert engine_kwargs_from_env({}) == {} and engine_kwargs_from_env({KV_CACHE_ENV: " "}) == {}
    assert engine_kwargs_from_env({KV_CACHE_ENV: "2"}) == {"kv_cache_memory_bytes": 2 * 1024**3}
    assert engine_kwargs_from_env({KV_CACHE_ENV: "0.5"}) == {"kv_cache_memory_bytes": 512 * 1024**2}
    for bad in ("abc", "0", "-1", "inf", "nan"):
        with pytest.raises(UsageError, match=f"{KV_CACHE_ENV}='{bad}' is not valid"):
            engine_kwargs_from_env({KV_CACHE_ENV: bad})


def test_gap_grpo_trainer_passes_the_kv_cache_setting_to_the_colocate_engine(fake_llm, monkeypatch):
    from trl import GRPOTrainer

    from bloggap_plugin.recipes import GapConfig
    from bloggap_plugin.trl.callback import GapGRPOTrainer
    from bloggap_plugin.trl.vllm_colocate import KV_CACHE_ENV

    module, _, calls = fake_llm
    monkeypatch.setattr(GRPOTrainer, "__init__", lambda self, *a, **k: module.LLM(model="m"))
    monkeypatch.setattr(GapMixin, "_gap_attach", lambda self, *a, **k: None)
    monkeypatch.setenv(KV_CACHE_ENV, "1")
    vllm_args = types.SimpleNamespace(use_vllm=True, vllm_mode="colocate")
    GapGRPOTrainer(args=vllm_args, gap=GapConfig(arm="A"))
    GapGRPOTrainer(args=vllm_args, gap=GapConfig(arm="H"))
    GapGRPOTrainer(args=types.SimpleNamespace(use_vllm=False, vllm_mode="colocate"), gap=GapConfig(arm="H"))
    assert calls == [{"model": "m", "kv_cache_memory_bytes": 1 << 30},
                     {"model": "m", "kv_cache_memory_bytes": 1 << 30, "dtype": "float16"}, {"model": "m"}]


def test_compare_runs_get_a_fixed_kv_cache_when_several_share_the_gpu():
    from bloggap_plugin.compare import CompareConfig, worker_environment
    from bloggap_plugin.trl.vllm_colocate import KV_CACHE_ENV

    def config(**kw):
        return types.SimpleNamespace(**{"use_vllm": True, "parallel": 2, "pythonpath": [], **kw})

    assert worker_environment(config(), {})[KV_CACHE_ENV] == "2"
    assert worker_environment(config(), {KV_CACHE_ENV: "3"})[KV_CACHE_ENV] == "3"
    assert KV_CACHE_ENV not in worker_environment(config(parallel=1), {})
    assert KV_CACHE_ENV not in worker_environment(config(use_vllm=False), {})
    assert {f.name for f in __import__("dataclasses").fields(CompareConfig)} >= {"use_vllm", "parallel"}


def test_a_sweep_without_vllm_loads_no_trl_for_its_runs_environment(spawns):
    """The sweep process (``bloggap compare``) builds each run's environment; without --use-vllm that must not
    import the TRL integration (seconds of imports per sweep, for a name only vLLM runs use)."""
    code = ("import json, sys, types; from bloggap_plugin.compare.sweep import worker_environment; "
            "env = worker_environment(types.SimpleNamespace(use_vllm=False, parallel=2, pythonpath=[]), {}); "
            "print(json.dumps([env, sorted(m for m in sys.modules if m.split('.')[0] == 'trl' "
            "or m.startswith('bloggap_plugin.trl'))]))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=HANG_S,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr
    env, loaded = json.loads(run.stdout.strip().splitlines()[-1])
    assert env == {} and loaded == []


def test_parallel_colocate_runs_each_get_their_own_free_master_port():
    """Found on the H200 (issue 15 smoke, 12 runs at once): TRL's colocate engine takes MASTER_PORT from the
    environment, else the first free of 29500, 23456, ...; runs that start together all saw 29500 free, and 11 of 12
    failed with EADDRINUSE. Each run of a parallel vLLM sweep gets a port of its own, free when chosen, none of those
    the runs in flight hold, also when the sweep itself inherited a MASTER_PORT."""
    import socket

    from bloggap_plugin.compare import worker_environment

    def config(**kw):
        return types.SimpleNamespace(**{"use_vllm": True, "parallel": 12, "pythonpath": [], **kw})

    ports = []
    for _ in range(12):
        env = worker_environment(config(), {"MASTER_PORT": "29500"}, ports_in_use=set(ports))
        ports.append(int(env["MASTER_PORT"]))
        assert env["MASTER_ADDR"] == "localhost"
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:  # free when chosen
            probe.bind(("127.0.0.1", ports[-1]))
    assert len(set(ports)) == 12 and 29500 not in ports
    assert worker_environment(config(parallel=1), {"MASTER_PORT": "29500"})["MASTER_PORT"] == "29500"
    assert "MASTER_PORT" not in worker_environment(config(use_vllm=False), {})


EAGER = {"enforce_eager": True}
DECODE_GRAPHS = {"enforce_eager": False, "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}
GRAPHS_ENGINE = {"eager": False, "prefix": False, "mode": 0}
"""The engine arms I and J get by default (gap.vllm_launch: auto), as ``_engine_trainer`` settings."""


def _gap_grpo_engine_calls(fake_llm, monkeypatch, gaps):
    """The ``LLM(...)`` keyword arguments of the colocate engine GapGRPOTrainer builds for each of ``gaps``."""
    from trl import GRPOTrainer

    from bloggap_plugin.trl.callback import GapGRPOTrainer

    module, _, calls = fake_llm
    monkeypatch.setattr(GRPOTrainer, "__init__", lambda self, *a, **k: module.LLM(model="m"))
    monkeypatch.setattr(GapMixin, "_gap_attach", lambda self, *a, **k: None)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    vllm_args = types.SimpleNamespace(use_vllm=True, vllm_mode="colocate")
    for gap in gaps:
        GapGRPOTrainer(args=vllm_args, gap=gap)
    return calls


def test_gap_grpo_trainer_builds_arm_i_an_engine_without_prefix_caching_and_leaves_other_arms_alone(
        fake_llm, monkeypatch):
    """Arm I computes vLLM's eager kernels and each prefill's launch size: GapGRPOTrainer builds TRL's colocate engine
    without prefix caching and with those kernels' launch (by default decode CUDA graphs, no torch.compile) for arm I
    only (arm A keeps TRL's engine)."""
    from bloggap_plugin.recipes import GapConfig

    calls = _gap_grpo_engine_calls(fake_llm, monkeypatch, [
        GapConfig(arm="I", positions="mask"), GapConfig(arm="A"),
        GapConfig(arm="I", positions="mask", i_pieces="torch")])
    assert calls == [{"model": "m", "enable_prefix_caching": False, **DECODE_GRAPHS}, {"model": "m"},
                     {"model": "m", "enable_prefix_caching": False, **DECODE_GRAPHS}]


def test_arms_i_and_j_launch_decode_graphs_by_default_and_eager_when_set(fake_llm, monkeypatch):
    """``gap.vllm_launch`` defaults to ``auto``: ``decode_graphs`` for arms I and J, whose engine runs vLLM's eager
    kernels (no torch.compile: compilation mode 0, decode steps replayed from full CUDA graphs; T16-armI-engine,
    variant graphs_one_prefill; live in T16-armI-live / T16-armJ-live); prefix caching stays off. ``eager`` set
    explicitly gives the eager engine; ``auto`` and ``decode_graphs`` set explicitly give the default's."""
    from bloggap_plugin.recipes import GapConfig
    from bloggap_plugin.trl.vllm_colocate import engine_kwargs_for

    calls = _gap_grpo_engine_calls(fake_llm, monkeypatch, [
        GapConfig(arm="I", positions="mask"), GapConfig(arm="J"), GapConfig(arm="J", vllm_launch="auto"),
        GapConfig(arm="J", vllm_launch="decode_graphs"), GapConfig(arm="I", vllm_launch="eager"),
        GapConfig(arm="J", vllm_launch="eager")])
    assert calls == ([{"model": "m", "enable_prefix_caching": False, **DECODE_GRAPHS}] * 4
                     + [{"model": "m", "enable_prefix_caching": False, **EAGER}] * 2)
    for arm in ("I", "J"):
        gap = GapConfig(arm=arm)
        assert (gap.vllm_launch, gap.resolved_vllm_launch) == ("auto", "decode_graphs")
        assert engine_kwargs_for(gap, {}) == {"enforce_eager": False, "enable_prefix_caching": False,
                                              "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
                                              "prefill_in_one_step": True}
        for launch in ("auto", "decode_graphs"):
            assert engine_kwargs_for(GapConfig(arm=arm, vllm_launch=launch), {}) == engine_kwargs_for(gap, {})
        eager = GapConfig(arm=arm, vllm_launch="eager")
        assert eager.resolved_vllm_launch == "eager"
        assert engine_kwargs_for(eager, {}) == {"enforce_eager": True, "enable_prefix_caching": False,
                                                "prefill_in_one_step": True}


def test_vllm_launch_is_checked_by_name_and_auto_leaves_other_arms_engines_alone():
    """``auto`` on any arm but I and J asks nothing of the engine; an explicit launch there is refused."""
    from bloggap_plugin.recipes import ARMS, GapConfig
    from bloggap_plugin.trl.vllm_colocate import engine_kwargs_for, engine_settings_for

    with pytest.raises(RecipeError, match=r"gap.vllm_launch must be one of auto, eager, decode_graphs, got 'graphs'"):
        GapConfig(arm="I", vllm_launch="graphs")
    for launch in ("eager", "decode_graphs"):
        with pytest.raises(RecipeError, match=r"gap.vllm_launch only applies to arms I and J.*arm is A: drop it"):
            GapConfig(arm="A", vllm_launch=launch)
    assert GapConfig(arm="A").vllm_launch == "auto" and GapConfig(arm="A").resolved_vllm_launch is None
    assert engine_kwargs_for(GapConfig(arm="A"), {}) == {}
    assert engine_kwargs_for(GapConfig(arm="A", vllm_launch="auto"), {}) == {}
    assert engine_kwargs_for(GapConfig(arm="H"), {}) == {"dtype": "float16"}
    for arm in ARMS:
        if arm in ("I", "J"):
            continue
        gap = GapConfig(arm=arm)
        assert gap.resolved_vllm_launch is None, arm
        assert engine_settings_for(gap) == {}, arm


def test_arm_i_and_j_recipes_load_with_the_decode_graphs_default():
    from _support import ROOT

    from bloggap_plugin.recipes import load_recipe
    from bloggap_plugin.trl.vllm_colocate import engine_kwargs_for

    for arm in ("I", "J"):
        _, gap = load_recipe(ROOT / "recipes" / f"arm_{arm}.yaml")
        assert (gap.arm, gap.vllm_launch, gap.resolved_vllm_launch) == (arm, "auto", "decode_graphs")
        assert engine_kwargs_for(gap, {}) == {"enable_prefix_caching": False, **DECODE_GRAPHS,
                                              "prefill_in_one_step": True}


def test_bloggap_train_gap_overrides_still_select_the_eager_engine(tmp_path):
    """``bloggap train recipes/arm_I.yaml --gap_overrides "{vllm_launch: eager}"``: the eager engine; without the
    override, the recipe's default (decode graphs)."""
    from _support import ROOT

    from bloggap_plugin.cli import build_parser
    from bloggap_plugin.commands.train import train_config_from_args
    from bloggap_plugin.trl.run import prepare_run
    from bloggap_plugin.trl.vllm_colocate import engine_kwargs_for

    parser = build_parser()
    common = ["train", str(ROOT / "recipes" / "arm_I.yaml"), "--model", "tiny-random-llama", "--device", "cpu",
              "--output-dir", str(tmp_path / "out")]
    eager = prepare_run(train_config_from_args(parser.parse_args([*common, "--gap_overrides", "{vllm_launch: eager}"])))
    assert (eager.gap.arm, eager.gap.vllm_launch, eager.gap.resolved_vllm_launch) == ("I", "eager", "eager")
    assert engine_kwargs_for(eager.gap, {}) == {"enforce_eager": True, "enable_prefix_caching": False,
                                                "prefill_in_one_step": True}
    default = prepare_run(train_config_from_args(parser.parse_args(common)))
    assert (default.gap.vllm_launch, default.gap.resolved_vllm_launch) == ("auto", "decode_graphs")
    assert engine_kwargs_for(default.gap, {}) == {"enable_prefix_caching": False, **DECODE_GRAPHS,
                                                  "prefill_in_one_step": True}


def test_attaching_decode_graphs_to_a_compiled_engine_is_refused(monkeypatch):
    """GapCallback with ``vllm_launch: decode_graphs`` (or the default, ``auto``) on TRL's default engine
    (torch.compile, mode 3): refused, naming the compilation mode it needs and how to build it; an engine built so
    passes; so does one whose compilation settings cannot be read. ``eager`` set explicitly refuses that engine."""
    import bloggap_plugin.core.vllm.kernels as vllm_kernels
    from bloggap_plugin.recipes import GapConfig
    from bloggap_plugin.trl.vllm_colocate import check_colocate_engine, colocate_compilation_mode

    monkeypatch.setattr(vllm_kernels, "vllm_batch_invariant_active", lambda: True)
    compiled = _engine_trainer(eager=False, prefix=False, mode=3)
    assert colocate_compilation_mode(compiled) == 3
    for gap in (GapConfig(arm="J", vllm_launch="decode_graphs"), GapConfig(arm="J")):
        with pytest.raises(RecipeError, match=r"compilation_config mode 0 \(the engine has mode 3: torch\.compile\)"
                                              r".*vllm_colocate_engine\(enforce_eager=False, "
                                              r"enable_prefix_caching=False, compilation_config=") as refused:
            check_colocate_engine(compiled, gap)
        assert "set gap.vllm_launch: eager" not in str(refused.value)  # the engine is not eager
        check_colocate_engine(_engine_trainer(**GRAPHS_ENGINE), gap)
        check_colocate_engine(_engine_trainer(eager=False, prefix=False), gap)  # mode unreadable: not refused
    with pytest.raises(RecipeError, match=r"enforce_eager=True \(the engine has False\)"):
        check_colocate_engine(_engine_trainer(**GRAPHS_ENGINE), GapConfig(arm="J", vllm_launch="eager"))


@pytest.mark.parametrize("arm", ["I", "J"])
def test_an_eager_engine_is_accepted_only_with_vllm_launch_eager_set(monkeypatch, arm):
    """A user who built the engine eager (``vllm_colocate_engine(enforce_eager=True, ...)``, or engine_kwargs_for of
    a gap set to eager) and attaches arm I or J: with ``gap.vllm_launch: eager`` it passes; with the default
    ``auto`` (decode graphs) it is refused, the error naming ``gap.vllm_launch: eager`` to keep that engine and
    engine_kwargs_for to build the default's; with ``decode_graphs`` set explicitly it is refused without that
    hint (the user asked for decode graphs)."""
    import bloggap_plugin.core.vllm.kernels as vllm_kernels
    from bloggap_plugin.recipes import GapConfig
    from bloggap_plugin.trl.vllm_colocate import check_colocate_engine

    monkeypatch.setattr(vllm_kernels, "vllm_batch_invariant_active", lambda: True)
    eager = _engine_trainer(eager=True, prefix=False, mode=0)
    check_colocate_engine(eager, GapConfig(arm=arm, vllm_launch="eager"))
    with pytest.raises(RecipeError) as refused:
        check_colocate_engine(eager, GapConfig(arm=arm))
    message = str(refused.value)
    assert f"arm {arm} computes the old log-probs" in message
    assert "built without enforce_eager=False (the engine has True):" in message
    assert "vllm_colocate_engine(**engine_kwargs_for(gap))" in message
    assert message.endswith(f"before adding GapCallback; the engine is eager, and gap.vllm_launch: auto (the "
                            f"default) gives arm {arm} decode_graphs: to keep an eager engine set "
                            "gap.vllm_launch: eager")
    with pytest.raises(RecipeError, match=r"enforce_eager=False \(the engine has True\)") as refused:
        check_colocate_engine(eager, GapConfig(arm=arm, vllm_launch="decode_graphs"))
    assert str(refused.value).endswith("before adding GapCallback")


def test_arm_i_with_batch_invariant_pieces_is_refused_before_the_engine_loads(fake_llm, monkeypatch):
    """Without VLLM_BATCH_INVARIANT=1 the engine's matmuls are cuBLAS's: arm I's default pieces are refused before
    TRL builds anything, naming the variable, TRITON_F32_DEFAULT and the piece to turn off; the torch pieces pass."""
    from trl import GRPOTrainer

    from bloggap_plugin.recipes import GapConfig
    from bloggap_plugin.trl.callback import GapGRPOTrainer

    module, _, calls = fake_llm
    monkeypatch.setattr(GRPOTrainer, "__init__", lambda self, *a, **k: module.LLM(model="m"))
    monkeypatch.setattr(GapMixin, "_gap_attach", lambda self, *a, **k: None)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    vllm_args = types.SimpleNamespace(use_vllm=True, vllm_mode="colocate")
    with pytest.raises(RecipeError, match="VLLM_BATCH_INVARIANT=1.*TRITON_F32_DEFAULT=ieee.*batch_invariant=false"):
        GapGRPOTrainer(args=vllm_args, gap=GapConfig(arm="I", positions="mask"))
    assert calls == []
    GapGRPOTrainer(args=vllm_args, gap=GapConfig(arm="I", positions="mask", i_pieces="all,batch_invariant=false"))
    assert len(calls) == 1


def _engine_trainer(**settings):
    vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(enforce_eager=settings.get("eager")),
                                        cache_config=types.SimpleNamespace(enable_prefix_caching=settings.get("prefix")))
    if "v2" in settings:
        vllm_config.use_v2_model_runner = settings["v2"]
    if "mode" in settings:
        vllm_config.compilation_config = types.SimpleNamespace(mode=settings["mode"])
    llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(vllm_config=vllm_config))
    return types.SimpleNamespace(vllm_generation=types.SimpleNamespace(llm=llm))


def test_attaching_arm_i_to_a_compiled_or_prefix_caching_engine_is_refused(monkeypatch):
    """GapCallback on a trainer whose engine TRL built with vLLM's defaults (compiled, prefix caching on): refused,
    naming each setting the engine has and how to build it (by default decode graphs; with ``vllm_launch: eager``
    the eager engine); an engine built with arm I's settings passes."""
    import bloggap_plugin.core.vllm.kernels as vllm_kernels
    from bloggap_plugin.recipes import GapConfig
    from bloggap_plugin.trl.vllm_colocate import (
        check_colocate_engine,
        colocate_engine_setting,
        engine_kwargs_for,
    )

    monkeypatch.setattr(vllm_kernels, "vllm_batch_invariant_active", lambda: True)
    gap = GapConfig(arm="I", positions="mask")
    default = _engine_trainer(eager=False, prefix=True, mode=3)
    assert colocate_engine_setting(default, "enforce_eager") is False
    with pytest.raises(RecipeError, match=r"built without enable_prefix_caching=False \(the engine has True\); "
                                          r"compilation_config mode 0 \(the engine has mode 3: torch\.compile\): .*"
                                          r"vllm_colocate_engine\(enforce_eager=False, enable_prefix_caching=False"):
        check_colocate_engine(default, gap)
    eager = GapConfig(arm="I", positions="mask", vllm_launch="eager")
    with pytest.raises(RecipeError, match=r"built without enforce_eager=True \(the engine has False\); "
                                          r"enable_prefix_caching=False \(the engine has True\): .*"
                                          r"vllm_colocate_engine\(enforce_eager=True"):
        check_colocate_engine(default, eager)
    check_colocate_engine(_engine_trainer(**GRAPHS_ENGINE), gap)
    check_colocate_engine(_engine_trainer(eager=True, prefix=False), eager)
    check_colocate_engine(default, GapConfig(arm="A"))  # arm A needs nothing of the engine
    check_colocate_engine(types.SimpleNamespace(), gap)  # settings that cannot be read are not refused
    assert engine_kwargs_for(gap) == {"enable_prefix_caching": False, **DECODE_GRAPHS, "prefill_in_one_step": True}
    monkeypatch.setattr(vllm_kernels, "vllm_batch_invariant_active", lambda: False)
    with pytest.raises(RecipeError, match="VLLM_BATCH_INVARIANT=1"):
        check_colocate_engine(_engine_trainer(**GRAPHS_ENGINE), gap)


def test_arm_i_logprobs_piece_must_match_the_engines_model_runner(monkeypatch):
    """vLLM 0.26 runs dense decoders on its model runner V2, whose sampler computes the sampled token's log-prob with
    its own kernel over bf16 logits (``logprobs=v2_sampler``, arm I's default); the V1 runner log-softmaxes fp32 logits
    (``logprobs=log_softmax``). Attaching arm I with the piece of the other runner is refused, naming the piece."""
    import bloggap_plugin.core.vllm.kernels as vllm_kernels
    from bloggap_plugin.recipes import GapConfig
    from bloggap_plugin.trl.colocate_reads import colocate_model_runner
    from bloggap_plugin.trl.vllm_colocate import check_colocate_engine

    monkeypatch.setattr(vllm_kernels, "vllm_batch_invariant_active", lambda: True)
    v1 = _engine_trainer(**GRAPHS_ENGINE, v2=False)
    v2 = _engine_trainer(**GRAPHS_ENGINE, v2=True)
    assert colocate_model_runner(v1) == "v1" and colocate_model_runner(v2) == "v2"
    assert colocate_model_runner(_engine_trainer(**GRAPHS_ENGINE)) is None
    check_colocate_engine(v2, GapConfig(arm="I", positions="mask"))
    with pytest.raises(RecipeError, match=r"model runner V1.*gap\.i_pieces: all,logprobs=log_softmax"):
        check_colocate_engine(v1, GapConfig(arm="I", positions="mask"))
    check_colocate_engine(v1, GapConfig(arm="I", positions="mask", i_pieces="all,logprobs=log_softmax"))
    with pytest.raises(RecipeError, match=r"model runner V2.*logprobs=v2_sampler"):
        check_colocate_engine(v2, GapConfig(arm="I", positions="mask", i_pieces="all,logprobs=log_softmax"))
    check_colocate_engine(v1, GapConfig(arm="A"))


def test_gap_grpo_trainer_gives_arm_i_one_prefill_step_for_a_generations_prompts(fake_llm, monkeypatch, tmp_path):
    """TRL 1.16 builds its colocate engine with max_num_batched_tokens=4096: a generation whose prompts hold more
    tokens is prefilled in chunks mixed with decode steps, launches arm I does not compute (T16-armI-engine, variants
    eager and eager_one_prefill). For arm I the engine gets max_num_seqs x max_model_len
    (the model's max_position_embeddings when TRL passes no max_model_len); the other arms keep TRL's 4096."""
    import json

    from trl import GRPOTrainer

    from bloggap_plugin.recipes import GapConfig
    from bloggap_plugin.trl.callback import GapGRPOTrainer

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 2048}))
    module, _, calls = fake_llm
    trl_call = {"max_num_seqs": 16, "max_num_batched_tokens": 4096}
    monkeypatch.setattr(GRPOTrainer, "__init__", lambda self, *a, **k: module.LLM(**self._trl_call))
    monkeypatch.setattr(GapMixin, "_gap_attach", lambda self, *a, **k: None)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    vllm_args = types.SimpleNamespace(use_vllm=True, vllm_mode="colocate")
    for extra, gap in (({"max_model_len": 1024}, GapConfig(arm="I", positions="mask")), ({}, GapConfig(arm="I", positions="mask")),
                       ({"max_model_len": 1024}, GapConfig(arm="A"))):
        monkeypatch.setattr(GapGRPOTrainer, "_trl_call", {"model": str(tmp_path), **trl_call, **extra}, raising=False)
        GapGRPOTrainer(args=vllm_args, gap=gap)
    assert [c["max_num_batched_tokens"] for c in calls] == [16 * 1024, 16 * 2048, 4096]
    assert "prefill_in_one_step" not in calls[0]


def test_attaching_arm_i_to_an_engine_that_chunks_a_generations_prefill_is_refused(monkeypatch):
    """GapCallback on an engine built with TRL's 4096 tokens per step: refused, naming max_num_batched_tokens, what
    it must reach (max_num_seqs x max_model_len) and vllm_colocate_engine(..., prefill_in_one_step=True)."""
    import bloggap_plugin.core.vllm.kernels as vllm_kernels
    from bloggap_plugin.recipes import GapConfig
    from bloggap_plugin.trl.vllm_colocate import check_colocate_engine, engine_kwargs_for

    monkeypatch.setattr(vllm_kernels, "vllm_batch_invariant_active", lambda: True)
    gap = GapConfig(arm="I", positions="mask")
    assert engine_kwargs_for(gap) == {"enable_prefix_caching": False, **DECODE_GRAPHS, "prefill_in_one_step": True}

    def engine(budget):
        trainer = _engine_trainer(**GRAPHS_ENGINE)
        config = trainer.vllm_generation.llm.llm_engine.vllm_config
        config.scheduler_config = types.SimpleNamespace(max_num_batched_tokens=budget, max_num_seqs=16)
        config.model_config.max_model_len = 1024
        return trainer

    with pytest.raises(RecipeError, match=r"max_num_batched_tokens >= 16384 \(max_num_seqs 16 x max_model_len 1024, "
                                          r"at most 65536; the engine has 4096\).*prefill_in_one_step=True"):
        check_colocate_engine(engine(4096), gap)
    check_colocate_engine(engine(16384), gap)
    check_colocate_engine(engine(4096), GapConfig(arm="A"))


def test_a_generation_whose_prompts_exceed_the_engines_step_is_refused_by_arm_i():
    """The check the scorer makes on every generation: more prompt tokens than the engine prefills in one step is an
    error naming both numbers and the fix; within the step (or an engine whose budget cannot be read) it passes."""
    from bloggap_plugin.trl.vllm_colocate import prefill_refusal

    message = prefill_refusal(6202, 4096)
    assert "6202 prompt tokens" in message and "max_num_batched_tokens=4096" in message
    assert "prefill_in_one_step=True" in message
    assert prefill_refusal(4096, 4096) is None and prefill_refusal(6202, None) is None


def test_arm_is_one_step_prefill_budget_is_capped_and_the_cap_is_what_attach_expects(monkeypatch):
    """A long-context model (max_position_embeddings 32768) with 32 sequences a generation would ask vLLM for a
    million tokens per step, which its start-up memory profile sizes activations by: the budget stops at
    ONE_STEP_PREFILL_CAP (a generation beyond it is refused by the per-generation check), and attaching to an engine
    built with the capped budget passes."""
    import bloggap_plugin.core.vllm.kernels as vllm_kernels
    from bloggap_plugin.recipes import GapConfig
    from bloggap_plugin.trl.vllm_colocate import (
        ONE_STEP_PREFILL_CAP,
        check_colocate_engine,
        one_step_prefill_tokens,
    )

    assert one_step_prefill_tokens(16, 1024) == 16 * 1024
    assert one_step_prefill_tokens(32, 32768) == ONE_STEP_PREFILL_CAP < 32 * 32768
    monkeypatch.setattr(vllm_kernels, "vllm_batch_invariant_active", lambda: True)
    trainer = _engine_trainer(**GRAPHS_ENGINE)
    config = trainer.vllm_generation.llm.llm_engine.vllm_config
    config.scheduler_config = types.SimpleNamespace(max_num_batched_tokens=ONE_STEP_PREFILL_CAP, max_num_seqs=32)
    config.model_config.max_model_len = 32768
    check_colocate_engine(trainer, GapConfig(arm="I", positions="mask"))


def _fake_batch_invariant_module():
    def matmul_persistent(a, b, bias=None):
        return a @ b

    return types.SimpleNamespace(matmul_persistent=matmul_persistent, matmul_kernel_persistent=object())


def test_the_tile_table_is_installed_before_the_engine_is_built(fake_llm, monkeypatch, tmp_path):
    from bloggap_plugin.core.vllm import kernels
    from bloggap_plugin.core.vllm import tile_table as tiles
    from bloggap_plugin.trl.vllm_colocate import vllm_colocate_engine

    module, _, calls = fake_llm
    bi = _fake_batch_invariant_module()
    vllm_own = bi.matmul_persistent
    monkeypatch.setattr(kernels, "persistent_matmul_module", lambda: bi)
    table = {(48, 40): tiles.ShapeTiles(64, ((1, tiles.TileShape(64, 32, 4, 4)),))}
    path = tmp_path / "tiles.json"
    path.write_text(tiles.dump_tiles(table))  # no "gpu": this CPU process has no GPU name to check it against
    seen = []
    monkeypatch.setattr(module, "LLM", lambda *a, **k: seen.append(bi.matmul_persistent) or types.SimpleNamespace())
    monkeypatch.setenv(tiles.TILES_ENV, str(path))
    with vllm_colocate_engine():
        llm = module.LLM(model="m")
    assert seen[0] is not vllm_own and seen[0].__wrapped__ is vllm_own  # in place when the engine started
    assert tiles.installed_tiles(bi) == table and llm._bloggap_matmul_tiles == str(path)
    bi.matmul_persistent = vllm_own
    monkeypatch.delenv(tiles.TILES_ENV)
    with vllm_colocate_engine():
        llm = module.LLM(model="m")
    assert bi.matmul_persistent is vllm_own and llm._bloggap_matmul_tiles is None and calls == []


def test_gap_matmul_tiles_reaches_the_engine_and_is_installed_before_it_starts(fake_llm, monkeypatch, tmp_path):
    """``gap.matmul_tiles`` (no variable exported): engine_kwargs_for hands the path to vllm_colocate_engine, which
    installs the table before TRL's LLM(...) runs and does not pass the key on to vLLM; without it, nothing."""
    from bloggap_plugin.core.vllm import kernels
    from bloggap_plugin.core.vllm import tile_table as tiles
    from bloggap_plugin.recipes import GapConfig
    from bloggap_plugin.trl.vllm_colocate import engine_kwargs_for, vllm_colocate_engine

    module, _, calls = fake_llm
    monkeypatch.delenv(tiles.TILES_ENV, raising=False)
    bi = _fake_batch_invariant_module()
    vllm_own = bi.matmul_persistent
    monkeypatch.setattr(kernels, "persistent_matmul_module", lambda: bi)
    table = {(48, 40): tiles.ShapeTiles(64, ((8, tiles.TileShape(16, 32, 4, 4)), (64, tiles.TileShape(64, 32, 4, 4))))}
    path = tmp_path / "tiles.json"
    path.write_text(tiles.dump_tiles(table))
    kwargs = engine_kwargs_for(GapConfig(arm="J", matmul_tiles=str(path)), {})
    assert kwargs["matmul_tiles"] == str(path)
    assert "matmul_tiles" not in engine_kwargs_for(GapConfig(arm="J"), {})
    seen = []
    monkeypatch.setattr(module, "LLM", lambda *a, **k: seen.append((bi.matmul_persistent, k)) or types.SimpleNamespace())
    with vllm_colocate_engine(matmul_tiles=str(path)):
        llm = module.LLM(model="m")
    installed, passed = seen[0]
    assert installed is not vllm_own and installed.__wrapped__ is vllm_own and "matmul_tiles" not in passed
    assert tiles.installed_tiles(bi) == table and llm._bloggap_matmul_tiles == str(path)


def test_a_tile_table_named_twice_must_be_one_file(fake_llm, monkeypatch, tmp_path):
    """The field and the variable naming two files is refused before the engine starts, naming both; the same file
    by another spelling is one table; a field naming a file that cannot be read names the field and how to drop it."""
    from bloggap_plugin.core.vllm import kernels
    from bloggap_plugin.core.vllm import tile_table as tiles
    from bloggap_plugin.trl.vllm_colocate import vllm_colocate_engine

    module, _, calls = fake_llm
    monkeypatch.setattr(kernels, "persistent_matmul_module", _fake_batch_invariant_module)
    path = tmp_path / "tiles.json"
    path.write_text(tiles.dump_tiles({(48, 40): tiles.ShapeTiles(64, ((1, tiles.TileShape(64, 32, 4, 4)),))}))
    monkeypatch.setenv(tiles.TILES_ENV, str(tmp_path / "other.json"))
    with pytest.raises(tiles.TilesError, match=r"gap.matmul_tiles .*tiles.json and BLOGGAP_VLLM_MATMUL_TILES=.*"
                       r"other.json name two tile tables: unset the variable or drop gap.matmul_tiles"), \
            vllm_colocate_engine(matmul_tiles=str(path)):
        module.LLM(model="m")
    assert calls == []
    monkeypatch.setenv(tiles.TILES_ENV, str(tmp_path / "." / "tiles.json"))
    with vllm_colocate_engine(matmul_tiles=str(path)):
        assert module.LLM(model="m")._bloggap_matmul_tiles == str(path)
    monkeypatch.delenv(tiles.TILES_ENV)
    with pytest.raises(tiles.TilesError, match=r"^gap.matmul_tiles .*absent.json: cannot read it .*, or drop "
                       r"gap.matmul_tiles$"), vllm_colocate_engine(matmul_tiles=str(tmp_path / "absent.json")):
        module.LLM(model="m")


def test_attaching_with_gap_matmul_tiles_to_an_engine_built_without_that_table_is_refused(monkeypatch, tmp_path):
    """GapCallback on a trainer whose engine was not built inside vllm_colocate_engine with the table (or with
    another one): generation would launch other tiles than the arm's passes, so attach refuses, naming the field
    and the fix; the engine's record of the same table passes."""
    import bloggap_plugin.core.vllm.kernels as vllm_kernels
    from bloggap_plugin.recipes import GapConfig, RecipeError
    from bloggap_plugin.trl.vllm_colocate import check_colocate_engine

    monkeypatch.setattr(vllm_kernels, "vllm_batch_invariant_active", lambda: True)
    path = str(tmp_path / "tiles.json")
    gap = GapConfig(arm="J", positions="mask", matmul_tiles=path)
    trainer = _engine_trainer(**GRAPHS_ENGINE)
    check_colocate_engine(trainer, GapConfig(arm="J", positions="mask"))  # no table asked for: as before
    with pytest.raises(RecipeError, match=r"gap.matmul_tiles .*tiles.json: TRL's colocate engine was built without a "
                       r"tile table, .*vllm_colocate_engine\(\*\*engine_kwargs_for\(gap, args=grpo_config\)\)"):
        check_colocate_engine(trainer, gap)
    trainer.vllm_generation.llm._bloggap_matmul_tiles = str(tmp_path / "other.json")
    with pytest.raises(RecipeError, match=r"built with the tile table .*other.json"):
        check_colocate_engine(trainer, gap)
    trainer.vllm_generation.llm._bloggap_matmul_tiles = path
    check_colocate_engine(trainer, gap)


def test_an_unusable_tile_table_stops_the_engine_before_it_starts(fake_llm, monkeypatch, tmp_path):
    from bloggap_plugin.core.vllm import kernels
    from bloggap_plugin.core.vllm import tile_table as tiles
    from bloggap_plugin.trl.vllm_colocate import vllm_colocate_engine

    module, _, calls = fake_llm
    monkeypatch.setenv(tiles.TILES_ENV, str(tmp_path / "absent.json"))
    monkeypatch.setattr(kernels, "persistent_matmul_module", _fake_batch_invariant_module)
    with pytest.raises(tiles.TilesError, match="absent.json: cannot read it"), vllm_colocate_engine():
        module.LLM(model="m")
    monkeypatch.setattr(kernels, "persistent_matmul_module", lambda: None)
    with pytest.raises(tiles.TilesError, match="has no batch-invariant matmul the plugin has read: pip install vllm=="), \
            vllm_colocate_engine():
        module.LLM(model="m")
    assert calls == []


def test_a_tile_table_without_the_colocate_engine_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """gap.matmul_tiles is installed where TRL's colocate engine is built; without that engine (HF generate, or vLLM
    server mode) the table would do nothing, so bloggap train refuses it naming the settings, and a colocate run
    whose table cannot be read stops before any model loads (not minutes later when the engine starts)."""
    from bloggap_plugin.core.vllm.tile_table import TilesError
    from bloggap_plugin.recipes import RecipeError
    from bloggap_plugin.trl.run import prepare_run

    common = {"model": "tiny-random-llama", "device": "cpu", "output_dir": str(tmp_path / "o")}
    missing = str(tmp_path / "absent.json")
    with pytest.raises(RecipeError, match=r"gap.matmul_tiles .*absent.json is installed in TRL's colocate vLLM "
                       r"engine, and this run has none \(use_vllm False\): set use_vllm: true and vllm_mode: "
                       r"colocate, or drop gap.matmul_tiles"):
        prepare_run(ROOT / "recipes" / "arm_J.yaml", gap_overrides={"matmul_tiles": missing}, **common)
    server = {"use_vllm": True, "vllm_mode": "server"}
    with pytest.raises(RecipeError, match=r"this run has none \(use_vllm True, vllm_mode 'server'\)"):
        prepare_run(ROOT / "recipes" / "arm_J.yaml", gap_overrides={"matmul_tiles": missing},
                    extra_overrides=server, **common)
    colocate = {"use_vllm": True, "vllm_mode": "colocate"}
    with pytest.raises(TilesError, match=r"^gap.matmul_tiles .*absent.json: cannot read it"):
        prepare_run(ROOT / "recipes" / "arm_J.yaml", gap_overrides={"matmul_tiles": missing},
                    extra_overrides=colocate, **common)


def test_attaching_a_tile_table_to_a_trainer_without_the_colocate_engine_is_refused():
    """GapCallback / GapGRPOTrainer on an HF-generate trainer with gap.matmul_tiles: refused at attach, naming it."""
    from bloggap_plugin.recipes import GapConfig, RecipeError
    from bloggap_plugin.trl import attach

    gap = GapConfig(arm="J", matmul_tiles="t.json")
    hf = types.SimpleNamespace(use_vllm=False, args=types.SimpleNamespace(vllm_mode="colocate"))
    with pytest.raises(RecipeError, match=r"gap.matmul_tiles t.json is installed in TRL's colocate vLLM engine, and "
                       r"this run has none \(use_vllm False\)"):
        attach._check_vllm(hf, gap)
    attach._check_vllm(hf, GapConfig(arm="J"))  # no table asked for: nothing to refuse on this trainer


def test_the_run_records_the_tile_table_its_engine_installed(tmp_path):
    """bloggap train's summary names the table the colocate engine installed (gap.matmul_tiles or the variable) with
    the file's sha256, so two runs' tables can be told apart; None where the engine installed none or there is no
    colocate engine."""
    import hashlib

    from bloggap_plugin.trl.vllm_colocate import installed_tile_table

    path = tmp_path / "tiles.json"
    path.write_text('{"gpu": "G", "tiles": {}}')
    llm = types.SimpleNamespace(llm_engine=object(), _bloggap_matmul_tiles=str(path))
    trainer = types.SimpleNamespace(vllm_generation=types.SimpleNamespace(llm=llm))
    assert installed_tile_table(trainer) == {"path": str(path),
                                             "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    llm._bloggap_matmul_tiles = None
    assert installed_tile_table(trainer) is None
    assert installed_tile_table(types.SimpleNamespace()) is None  # HF generate: no engine
