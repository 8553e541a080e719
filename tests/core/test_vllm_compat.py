"""The vLLM version gate: one range for any vLLM path, the measured release for arms I and J's kernels."""

from __future__ import annotations

import types

import pytest

from bloggap_plugin.core.vllm import versions as vllm_versions
from bloggap_plugin.recipes import GapConfig, RecipeError
from bloggap_plugin.trl import vllm_colocate


@pytest.fixture
def gate_026(monkeypatch):
    """The gate these message tests spell out: 0.26.0 measured, 0.31.0 read from its wheel only. The real
    ``VLLM_FORM_RELEASES`` grows by one entry once a GPU run measures a release (docs/vllm031_form.md); these tests
    check the mechanism, so they hold the gate fixed."""
    monkeypatch.setattr(vllm_versions, "VLLM_FORM_RELEASES", ("0.26.0",))


@pytest.mark.parametrize("version", ["0.22.0", "0.26.0", "0.28.1", "0.31.0", "0.26.0.dev3+gabc123"])
def test_a_vllm_in_trls_range_serves_any_vllm_path(version):
    assert vllm_versions.vllm_problem(needs_form=False, version=version) is None


@pytest.mark.parametrize("version", ["0.21.9", "0.31.1", "1.0.0", "not-a-version"])
def test_a_vllm_outside_the_range_is_named_with_the_range(version, gate_026):
    problem = vllm_versions.vllm_problem(version=version)
    assert problem == (f"vLLM {version} is installed and the plugin supports vLLM 0.22.0-0.31.0 (TRL 1.16's range): "
                       "install e.g. pip install vllm==0.26.0")


def test_arms_i_and_j_kernels_need_the_release_they_were_read_from(gate_026):
    assert vllm_versions.vllm_problem(needs_form=True, version="0.26.0", environ={}) is None
    problem = vllm_versions.vllm_problem(needs_form=True, version="0.28.1", environ={})
    assert problem.startswith("vLLM 0.28.1 is installed, and arms I and J compute the kernels of vLLM 0.26.0")
    assert problem.endswith("pip install vllm==0.26.0, or set gap.i_pieces: torch (vLLM's maths in plain torch)")


def test_a_release_read_but_not_measured_is_refused_naming_what_is_missing_and_the_trial(gate_026):
    """vLLM 0.31's pieces are read from its wheel (a layout exists) but not measured: the one-line refusal says what
    is missing and how to run it as the measurement; the trial variable lets exactly that release through."""
    trial = vllm_versions.FORM_TRIAL_ENV
    problem = vllm_versions.vllm_problem(needs_form=True, version="0.31.0", environ={})
    assert problem.startswith("vLLM 0.31.0 is installed, and arms I and J's pieces were read from its wheel but are "
                              "not yet measured there (missing: the bitwise live run on a GPU")
    assert problem.endswith(f"pip install vllm==0.26.0, set gap.i_pieces: torch (vLLM's maths in plain torch), or "
                            f"export {trial}=0.31.0 to run it as that measurement")
    assert "\n" not in problem
    assert vllm_versions.vllm_problem(needs_form=True, version="0.31.0", environ={trial: "0.31.0"}) is None
    assert vllm_versions.vllm_problem(needs_form=True, version="0.31.0+cu130", environ={trial: "0.31.0"}) is None
    # the trial names one release: another installed release stays refused
    assert vllm_versions.vllm_problem(needs_form=True, version="0.28.1", environ={trial: "0.31.0"}).startswith(
        "vLLM 0.28.1 is installed, and arms I and J compute the kernels of vLLM 0.26.0")
    assert vllm_versions.vllm_problem(needs_form=True, version="0.31.0", environ={trial: "0.26.0"}) == problem


@pytest.mark.parametrize(("version", "module", "fp32"), [
    ("0.26.0", "vllm.model_executor.layers.batch_invariant", False),
    ("0.26.0.dev3+gabc123", "vllm.model_executor.layers.batch_invariant", False),
    ("0.31.0", "vllm.model_executor.determinism.batch_invariant", True),
    ("0.31.0+cu130", "vllm.model_executor.determinism.batch_invariant", True),
])
def test_each_read_release_has_its_layout(version, module, fp32):
    layout = vllm_versions.form_layout(version)
    assert layout.batch_invariant == module and layout.processed_logits_fp32 is fp32
    assert layout.logprob == "vllm.v1.worker.gpu.sample.logprob"


@pytest.mark.parametrize("version", ["0.28.1", "0.25.0", None, "not-a-version"])
def test_a_release_not_read_has_no_layout(version):
    assert vllm_versions.form_layout(version) is None


def test_no_vllm_is_said_so(monkeypatch, gate_026):
    monkeypatch.setattr(vllm_versions, "installed_vllm", lambda: None)
    assert vllm_versions.vllm_problem().startswith("vLLM is not installed here: install vLLM 0.22.0-0.31.0")


def _trainer(with_engine: bool):
    llm = types.SimpleNamespace(llm_engine=object()) if with_engine else None
    return types.SimpleNamespace(vllm_generation=types.SimpleNamespace(llm=llm))


@pytest.mark.parametrize(("arm", "pieces", "version", "refused"), [
    ("J", "all", "0.31.0", "arm J: vLLM 0.31.0 is installed, and arms I and J's pieces were read from its wheel "
                           "but are not yet measured there"),
    ("J", "all", "0.28.1", "arm J: vLLM 0.28.1 is installed, and arms I and J compute the kernels of vLLM 0.26.0"),
    ("I", "torch", "0.31.0", None),  # vLLM's maths in plain torch: any vLLM TRL takes
    ("A", "all", "0.31.0", None),
    ("A", "all", "0.32.0", "arm A: vLLM 0.32.0 is installed and the plugin supports vLLM 0.22.0-0.31.0"),
    ("I", "all", "0.26.0", None),
])
def test_attach_checks_the_engines_vllm_once(monkeypatch, arm, pieces, version, refused, gate_026):
    monkeypatch.setattr(vllm_versions, "installed_vllm", lambda: version)
    monkeypatch.delenv(vllm_versions.FORM_TRIAL_ENV, raising=False)
    gap = GapConfig(arm=arm, i_pieces=pieces) if arm in ("I", "J") else GapConfig(arm=arm)
    if refused is None:
        vllm_colocate.check_engine_vllm(_trainer(True), gap)
    else:
        with pytest.raises(RecipeError, match=refused.replace(".", r"\.")):
            vllm_colocate.check_engine_vllm(_trainer(True), gap)
    vllm_colocate.check_engine_vllm(_trainer(False), gap)  # no real engine (server mode, a stand-in): nothing to read


def test_setup_cfgs_vllm_extra_is_the_measured_release():
    import configparser
    from pathlib import Path

    config = configparser.ConfigParser()
    config.read(Path(__file__).resolve().parents[2] / "setup.cfg")
    pins = [line.strip() for line in config["options.extras_require"]["vllm"].splitlines() if line.strip()]
    assert pins == [f"vllm=={release}" for release in vllm_versions.VLLM_FORM_RELEASES]


@pytest.mark.parametrize(("sampling", "processed"), [
    ({"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}, []),  # TRL's defaults
    ({"temperature": 1.0, "top_k": -1}, []),
    ({"temperature": 1.0, "top_k": 50000}, []),  # at least the vocabulary: no top_k
    ({"temperature": 0.7}, ["temperature=0.7"]),
    ({"temperature": 0.0, "top_p": 0.9}, []),  # greedy: the sampling states ask for nothing
    ({"temperature": 1.0, "top_p": 0.8, "top_k": 50, "min_p": 0.1},
     ["top_p=0.8", "top_k=50", "min_p=0.1"]),
    ({"temperature": 1.0, "repetition_penalty": 1.1, "presence_penalty": 0.5},
     ["repetition_penalty=1.1", "presence_penalty=0.5"]),
    ({"temperature": 1.0, "logit_bias": {3: 1.0}, "bad_words": ["x"], "min_tokens": 2},
     ["logit_bias={3: 1.0}", "min_tokens=2", "bad_words=['x']"]),
])
def test_which_sampling_parameters_make_the_v2_sampler_process_logits(sampling, processed):
    """vLLM 0.31's V2 sampler copies a request's logits to fp32 when its sampling states, penalties, logit bias or
    bad words ask for processing (read from its wheel); the list names exactly those parameters."""
    assert vllm_versions.v2_sampler_processing(sampling, vocab_size=49152) == processed


def _sampling_trainer(**args):
    defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0,
                "generation_kwargs": None}
    trainer = _trainer(True)
    trainer.args = types.SimpleNamespace(**(defaults | args))
    return trainer


def test_the_sampler_piece_must_read_the_logits_in_the_dtype_the_installed_sampler_does(monkeypatch, gate_026):
    """On vLLM 0.31 (run as the trial) the sampler's log-prob reads fp32 logits once a sampling parameter asks for
    processing (piece ``v2_sampler_fp32``) and bf16 otherwise (``v2_sampler``); vLLM 0.26 always bf16. A mismatch
    is refused at attach, naming the parameters and the piece to set; arm I's log_softmax and torch pieces pass."""
    monkeypatch.setenv(vllm_versions.FORM_TRIAL_ENV, "0.31.0")
    monkeypatch.setattr(vllm_versions, "installed_vllm", lambda: "0.31.0")
    gap = GapConfig(arm="I", i_pieces="all")
    vllm_colocate.check_engine_vllm(_sampling_trainer(), gap)
    with pytest.raises(RecipeError, match=r"arm I: vLLM 0\.31\.0's model runner V2 sampler copies the logits to fp32 "
                                          r"before applying temperature=0\.7, top_p=0\.9 and takes the log-prob over "
                                          r"those \(docs/vllm031_form\.md\), and gap\.i_pieces has "
                                          r"logprobs=v2_sampler: set logprobs=v2_sampler_fp32 in gap\.i_pieces"):
        vllm_colocate.check_engine_vllm(_sampling_trainer(temperature=0.7, top_p=0.9), gap)
    with pytest.raises(RecipeError, match=r"frequency_penalty=0\.2"):
        vllm_colocate.check_engine_vllm(_sampling_trainer(generation_kwargs={"frequency_penalty": 0.2}), gap)
    vllm_colocate.check_engine_vllm(_sampling_trainer(temperature=0.7),
                                    GapConfig(arm="I", i_pieces="all,logprobs=log_softmax"))
    vllm_colocate.check_engine_vllm(_sampling_trainer(temperature=0.7), GapConfig(arm="I", i_pieces="torch"))
    fp32 = GapConfig(arm="I", i_pieces="all,logprobs=v2_sampler_fp32")
    vllm_colocate.check_engine_vllm(_sampling_trainer(temperature=0.7, top_p=0.9), fp32)
    with pytest.raises(RecipeError, match=r"takes the log-prob over the bf16 logits with these sampling parameters "
                                          r"\(docs/vllm031_form\.md\), and gap\.i_pieces has "
                                          r"logprobs=v2_sampler_fp32: set logprobs=v2_sampler in gap\.i_pieces"):
        vllm_colocate.check_engine_vllm(_sampling_trainer(), fp32)
    monkeypatch.setattr(vllm_versions, "installed_vllm", lambda: "0.26.0")
    vllm_colocate.check_engine_vllm(_sampling_trainer(temperature=0.7, top_p=0.9), gap)
    with pytest.raises(RecipeError, match=r"vLLM 0\.26\.0's model runner V2 sampler takes the log-prob over the bf16"):
        vllm_colocate.check_engine_vllm(_sampling_trainer(temperature=0.7), fp32)


def test_both_sampler_pieces_are_the_v2_runners_and_call_vllm():
    """``logprobs=v2_sampler_fp32`` is a V2 model runner piece (refused on V1, as ``v2_sampler``) that calls vLLM's
    kernel; an unknown value is named with the three accepted."""
    from bloggap_plugin.core.vllm.form import parse_form

    fp32 = GapConfig(arm="I", i_pieces="all,logprobs=v2_sampler_fp32")
    assert vllm_colocate.model_runner_refusal(fp32, "v2") is None
    assert vllm_colocate.model_runner_refusal(fp32, "v1").endswith("set gap.i_pieces: all,logprobs=log_softmax")
    assert "logprobs=v2_sampler_fp32" in parse_form("torch,logprobs=v2_sampler_fp32").needs_vllm()
    with pytest.raises(ValueError, match="use one of log_softmax, v2_sampler, v2_sampler_fp32"):
        parse_form("all,logprobs=fp32")
