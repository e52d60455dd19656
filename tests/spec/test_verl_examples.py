"""verl's own example scripts through ``nereus run JOB ... --cfg job``: every key they set has a fate (mapped,
derived, ignored or refused with a reason), nothing starts and nothing but the job file is read.

The scripts' overrides are data (``tests/data/verl_examples.json``: every ``examples/**/*.sh`` of
https://github.com/volcengine/verl at the commit the file names, as ``nereus.devtools.verl_examples``
extracts them). Each script runs on the tiny example of its algorithm: PPO's for ``gae``, GRPO's otherwise.
verl's documented command lines (the quickstart's PPO run, kept under ``docs`` in the same file, and the GRPO
script docs/algo/grpo.md launches) run verbatim, and with the user's files in place of verl's machine's, on
the HF examples.
"""

from __future__ import annotations

import builtins
import copy
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nereus.cli import main
from nereus.devtools.verl_examples import doc_commands, script_overrides
from nereus.spec import cfg_job
from nereus.spec.cfg_job import resolve_job
from nereus.spec.engines import engine_traits, installed_distribution
from nereus.spec.errors import SpecError
from nereus.spec.overrides import apply_overrides, did_you_mean, resolve_overrides
from nereus.spec.verl_keys import DERIVED, IGNORED, MAPPED, REFUSED, TABLE, lookup
from nereus.spec.verl_layouts import DEGREES

ROOT = Path(__file__).resolve().parents[2]
DATA = json.loads((ROOT / "tests" / "data" / "verl_examples.json").read_text())
SCRIPTS = DATA["scripts"]
UNKNOWN = ("a verl key Nereus does not know", "unknown key")
FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's where PyYAML has it
# what --cfg job must never load: the runtime, models, data readers, engines
BLOCKED = ("ray", "torch", "pyarrow", "pyarrow.parquet", "pandas", "safetensors", "transformers", "vllm", "datasets")


def _base(overrides: list[str]) -> Path:
    """The tiny example a script runs on: PPO's where it asks for GAE (it needs a critic), GRPO's otherwise."""
    estimators = [o.partition("=")[2] for o in overrides if o.lstrip("+").startswith("algorithm.adv_estimator=")]
    return ROOT / "examples" / ("ppo_tiny.yaml" if estimators[-1:] == ["gae"] else "grpo_tiny.yaml")


def _key(override: str) -> str:
    return override.lstrip("+").partition("=")[0]


def test_the_data_cites_verl_and_its_commit():
    assert DATA["source"] == "https://github.com/volcengine/verl"
    assert len(DATA["commit"]) == 40 and len(SCRIPTS) == 139
    assert sum(len(s["overrides"]) for s in SCRIPTS.values()) > 5000
    assert SCRIPTS["examples/grpo_trainer/run_qwen2-7b.sh"]["entry"] == "verl.trainer.main_ppo"


def test_every_key_of_every_script_has_a_fate():
    keys = {_key(o) for s in SCRIPTS.values() for o in s["overrides"]}
    assert len(keys) > 350
    assert [k for k in sorted(keys) if lookup(k) is None] == []


@pytest.fixture
def nothing_starts(monkeypatch):
    """No runtime, model or data library can be imported, no process started, no file but the job read."""
    for name in BLOCKED:
        monkeypatch.setitem(sys.modules, name, None)  # `import torch` raises ImportError

    def no_process(*args, **kwargs):
        raise AssertionError(f"--cfg job started a process: {args[:1]}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    monkeypatch.setattr(os, "fork", no_process)
    opened: list[str] = []
    real_open, real_os_open = builtins.open, os.open
    monkeypatch.setattr(builtins, "open", lambda file, *a, **k: opened.append(str(file)) or real_open(file, *a, **k))
    monkeypatch.setattr(os, "open", lambda file, *a, **k: opened.append(str(file)) or real_os_open(file, *a, **k))
    return opened


def test_cfg_job_over_every_verl_example_script(nothing_starts, capsys, monkeypatch):
    read = functools.lru_cache(cfg_job.read_yaml_file)  # the two tiny jobs are read once each, not 139 times
    monkeypatch.setattr(cfg_job, "read_yaml_file", lambda path, kind: copy.deepcopy(read(path, kind)))
    clean = 0
    for path, script in SCRIPTS.items():
        job = _base(script["overrides"])
        code = main(["run", str(job), *script["overrides"], "--cfg", "job"])
        out, err = capsys.readouterr()
        assert code in (0, 2), path
        assert "Traceback" not in out + err and "internal error" not in err, path
        assert all(line.startswith("nereus: error: ") for line in err.splitlines()), path
        assert isinstance(yaml.load(out, Loader=FAST_LOADER), dict), path  # the job, its fates as comments
        clean += not any(u in err for u in UNKNOWN)
    assert clean / len(SCRIPTS) >= 0.95, clean  # docs/rl.md, "Command-line overrides": the measured figure
    # the job files: the examples and the cluster profile PPO's includes
    assert {Path(p).name for p in nothing_starts} <= {"grpo_tiny.yaml", "ppo_tiny.yaml", "cpu-local.yaml"}


def test_cfg_job_prints_each_fate_and_every_problem_at_once(capsys):
    job = ROOT / "examples" / "grpo_tiny.yaml"
    code = main(["run", str(job), "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.clip_ratoi=0.3",
                 "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                 "run.clip_ratio_c=0.5", "--cfg", "job"])
    out, err = capsys.readouterr()
    assert code == 2
    assert yaml.safe_load(out)["algorithm"]["samples_per_prompt"] == 4
    assert "#   actor_rollout_ref.rollout.n=4  -> algorithm.samples_per_prompt" in out
    assert "#   actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2  ignored: the micro-batch size" in out
    lines = err.splitlines()
    assert lines[:2] == [
        "nereus: error: actor_rollout_ref.actor.clip_ratoi: a verl key Nereus does not know; docs/rl.md lists verl's "
        "keys and what Nereus does with each; did you mean 'actor_rollout_ref.actor.clip_ratio'?",
        "nereus: error: actor_rollout_ref.model.lora_rank: 8: LoRA adapters are not implemented: Nereus trains every "
        "weight"]
    assert len(lines) == 3 and lines[2].startswith("nereus: error: run.clip_ratio_c: 0.5 must exceed 1")
    assert main(["run", str(job), "actor_rollout_ref.rollout.n=4", "--cfg", "job"]) == 0
    assert capsys.readouterr().err == ""


def test_a_validation_error_drops_its_override_and_validation_goes_on():
    job = ROOT / "examples" / "grpo_tiny.yaml"
    report = resolve_job(job, ["actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct", "run.clip_ratio_c=0.5",
                               "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=8",  # 4 heads
                               "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1", "run.workers=8"])
    # each under the key as typed (spec.typed_keys): both degrees set run.layouts.actor/inference
    assert [p.split(":")[0] for p in report.problems] == [
        "actor_rollout_ref.model.path", "run.clip_ratio_c",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size / "
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"]


def test_did_you_mean_offers_only_a_near_identical_verl_key():
    assert did_you_mean("trainer.critic_warmpu") == "; did you mean 'trainer.critic_warmup'?"
    assert did_you_mean("actor_rollout_ref.rollout.enable_chunked_prefil").endswith("enable_chunked_prefill'?")
    assert did_you_mean("actor_rollout_ref.actor.no_such_knob") == ""


def test_parallel_degrees_become_the_stages_layouts():
    base = {"models": {"actor": {}, "reference": {}}, "run": {"workers": 8, "layouts": {
        "actor/training": {"layout": "tp=1,pp=2,dp=4,micro_batch_size=4", "ranks": list(range(8))},
        "reference/inference": {"layout": "tp=1,pp=1,dp=2", "ranks": [6, 7]}}}}
    out = apply_overrides(base, ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                                 "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
                                 "actor_rollout_ref.ref.ulysses_sequence_parallel_size=4",
                                 "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                                 "critic.megatron.tensor_model_parallel_size=2"])  # no critic: noted, not set
    layouts = out["run"]["layouts"]
    # a degree not given keeps the job's (pp=2, micro_batch_size); dp fills the 8 workers; ranks kept at 8
    assert layouts["actor/training"] == {"layout": "tp=2,pp=2,dp=2,micro_batch_size=4,interleave=2",
                                         "ranks": list(range(8))}
    assert layouts["actor/inference"] == "tp=2,dp=4,interleave=2"  # verl's actor computes the old log-probs
    assert layouts["reference/inference"] == "tp=4,pp=1,dp=2"  # Ulysses' degree as TP; 8 ranks now, not [6, 7]
    assert layouts["actor/generation"] == "tp=2,dp=4"
    assert "critic/training" not in layouts
    gen = apply_overrides({"models": {"actor": {}}}, ["actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                                                      "actor_rollout_ref.rollout.data_parallel_size=1"])
    assert gen["run"]["layouts"] == {"actor/generation": "tp=2,dp=1"}
    assert {stages for stages, _ in DEGREES.values()} == {("actor/training", "actor/inference"),
                                                          ("reference/inference",), ("actor/generation",),
                                                          ("critic/training", "critic/inference")}


@pytest.mark.parametrize("overrides, why", [
    (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"], r"tp x pp = 3 x 1 does not divide run\.work"),
    (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
      "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4"], r"differs from .*both set tp of actor/training"),
    (["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=two"], "expected a positive integer"),
    (["actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=2"], "tensor parallelism inside experts"),
    (["actor_rollout_ref.ref.megatron.context_parallel_size=2"], "context parallelism is not in the runtime"),
])
def test_degrees_that_cannot_be_honoured_are_refused(overrides, why):
    with pytest.raises(SpecError, match=why):
        apply_overrides({"models": {"actor": {}, "reference": {}}, "run": {}}, overrides)


def test_megatron_expert_parallel_degree_is_the_stages_ep():
    out = apply_overrides({"models": {"actor": {}}, "run": {"workers": 4}},
                          ["actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"])
    assert out["run"]["layouts"] == {"actor/training": "dp=4,ep=2", "actor/inference": "dp=4,ep=2"}


def test_degrees_under_run_adapt_are_refused():
    with pytest.raises(SpecError, match=r"adapts its layouts \(run\.adapt\)"):
        apply_overrides({"models": {"actor": {}}, "run": {"adapt": {}}},
                        ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"])


def test_engine_keys_reach_the_vllm_engine_and_algorithm_keys_their_nereus_names():
    out = resolve_overrides({}, ["actor_rollout_ref.rollout.enable_chunked_prefill=false",
                                 "actor_rollout_ref.rollout.max_num_batched_tokens=8192",
                                 "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                                 "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.0002",
                                 "algorithm.filter_groups.enable=true", "reward_model.overlong_buffer.len=4",
                                 "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
                                 "actor_rollout_ref.actor.optim.warmup_style=cosine", "trainer.critic_warmup=2",
                                 "actor_rollout_ref.rollout.top_k=20"]).tree
    assert out["run"]["rollout"] == {"enable_chunked_prefill": False, "max_num_batched_tokens": 8192}
    assert out["run"]["policy_loss"] == {"loss_mode": "gspo", "clip_cov_ratio": 0.0002}
    assert (out["run"]["filter_groups"], out["run"]["overlong_buffer"]) == ({"enable": True},
                                                                           {"len": 4, "penalty_factor": 1.0})
    assert (out["run"]["lr_scheduler_type"], out["run"]["critic_warmup"], out["run"]["top_k"]) == ("cosine", 2, 20)
    assert all(lookup(k) is TABLE[k] for k in TABLE)


def test_verl_rollout_correction_is_the_bypass_loss_or_the_asynchronous_modes():
    keys = ["algorithm.rollout_correction.rollout_is=null", "algorithm.rollout_correction.rollout_is_threshold=2.5"]
    bypass = apply_overrides({}, ["algorithm.rollout_correction.bypass_mode=true", *keys,
                                  "algorithm.rollout_correction.loss_type=reinforce"])
    assert bypass["algorithm"] == {"recompute_old_log_prob": False}
    assert bypass["run"]["policy_loss"] == {"loss_mode": "bypass_mode", "rollout_correction": {
        "rollout_is": "none", "rollout_is_threshold": 2.5, "loss_type": "reinforce"}}
    assert apply_overrides({}, keys)["run"] == {"async": {"rollout_is": "none", "rollout_is_threshold": 2.5}}
    with pytest.raises(SpecError, match=r"bypass_mode: 'bypass_mode' differs from .*loss_mode='gspo'"):
        apply_overrides({}, ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                             "algorithm.rollout_correction.bypass_mode=true"])


def test_the_extractor_reads_continuations_quotes_variables_and_arrays():
    script = """set -x
ARGS="actor_rollout_ref.actor.clip_ratio=0.2 \\
    data.max_prompt_length=$((a + b))"
EXTRA=(trainer.nnodes=1
       +trainer.n_gpus_per_node=${G})
python3 -m verl.trainer.main_ppo --config-name='ppo_trainer' \\
    data.train_files="$HOME/x.parquet" \\
    trainer.logger='["console"]' $ARGS "${EXTRA[@]}" $@  # a comment: data.val_files=ignored
"""
    assert script_overrides(script) == {"entry": "verl.trainer.main_ppo", "overrides": [
        "actor_rollout_ref.actor.clip_ratio=0.2", "data.max_prompt_length=$((a+b))", "trainer.nnodes=1",
        "+trainer.n_gpus_per_node=${G}", "data.train_files=$HOME/x.parquet", 'trainer.logger=["console"]']}


def test_the_extractor_reads_a_documentation_pages_command():
    page = """Run it:

.. code-block:: bash

   PYTHONUNBUFFERED=1 python3 -m verl.trainer.main_ppo \\
    data.train_batch_size=256 \\
    trainer.nnodes=1 2>&1 | tee verl_demo.log

Later: trainer.n_gpus_per_node=8 is prose, not a command.
"""
    assert doc_commands(page) == [{"entry": "verl.trainer.main_ppo",
                                   "overrides": ["data.train_batch_size=256", "trainer.nnodes=1"]}]


# verl's documented command lines, as data at the commit verl_examples.json names: the quickstart's PPO run
# (docs/start/quickstart.rst) and the GRPO run docs/algo/grpo.md's "Reference Example" launches
# (examples/grpo_trainer/run_qwen3-8b.sh), each on the HF example of its algorithm
DOC_RUNS = {"ppo": (DATA["docs"]["docs/start/quickstart.rst"][0]["overrides"], "ppo_gsm8k_hf.yaml"),
            "grpo": (SCRIPTS["examples/grpo_trainer/run_qwen3-8b.sh"]["overrides"], "grpo_gsm8k_hf.yaml")}
# the tiny model of examples/make_tiny_hf.py, as far as --cfg job reads it (config.json)
TINY_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 2,
              "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
              "vocab_size": 320, "max_position_embeddings": 256, "tie_word_embeddings": False}


def _fate_lines(out: str) -> dict[str, str]:
    """override as written -> its fate, from --cfg job's comments."""
    lines = out.split("# verl keys (", 1)[1].splitlines()[1:]
    return dict(line[len("#   "):].split("  ", 1) for line in lines)


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_verls_documented_command_lines_have_a_fate_for_every_key_and_build(algorithm, tmp_path, capsys):
    """Verbatim, every key is mapped, derived, ignored or refused with its reason (none unknown, none
    silently dropped) and each problem (the hub model name, the data paths of verl's machine) is one line
    under a key as typed; with the user's own files in their place, the job builds."""
    overrides, job = DOC_RUNS[algorithm]
    keys = [_key(o) for o in overrides]
    fates = {k: lookup(k) for k in keys}
    assert all(f is not None and f.kind in (MAPPED, DERIVED, IGNORED, REFUSED) for f in fates.values()), fates
    assert all(f.reason for f in fates.values() if f.kind in (IGNORED, REFUSED))
    assert main(["run", str(ROOT / "examples" / job), *overrides, "--cfg", "job"]) == 2
    out, err = capsys.readouterr()
    assert set(_fate_lines(out)) == set(overrides)  # each override's fate is printed
    named = {line.removeprefix("nereus: error: ").split(":")[0] for line in err.splitlines()}
    assert all(line.startswith("nereus: error: ") for line in err.splitlines())
    assert "actor_rollout_ref.model.path" in named and named <= set(keys), err  # a hub name: Nereus downloads nothing
    model, data = tmp_path / "model", tmp_path / "data"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_QWEN2))
    data.mkdir()
    (data / "train.parquet").write_bytes(b"")  # checked by name only: no data file is opened
    (data / "test.parquet").write_bytes(b"")
    mine = [o.replace("$HOME/data/gsm8k", str(data)).replace("=Qwen/Qwen2.5-0.5B-Instruct", f"={model}")
            .replace("=Qwen/Qwen3-8B", f"={model}") for o in overrides]
    assert len(mine) == len(overrides) and all(_key(a) == _key(b) for a, b in zip(mine, overrides, strict=True))
    code = main(["run", str(ROOT / "examples" / job), *mine, "--cfg", "job"])
    out, err = capsys.readouterr()
    if installed_distribution(engine_traits("vllm")) is None:  # rollout.name=vllm: refused by its key
        assert code == 2 and err.startswith("nereus: error: actor_rollout_ref.rollout.name: vllm is not installed")
        return
    assert (code, err) == (0, ""), err
    built = yaml.safe_load(out)
    assert built["algorithm"]["name"] == algorithm and built["run"]["rollout"]["engine"] == "vllm"
    assert set(built["models"]) == ({"actor", "reference", "critic"} if algorithm == "ppo" else {"actor", "reference"})
    assert (built["run"]["workers"], built["workload"]["prompts_per_step"]) == (
        (1, 256) if algorithm == "ppo" else (8, 1024))


def test_an_engine_the_job_files_levers_cannot_run_is_refused_under_the_key_typed():
    """verl's quickstart selects vLLM; on a job file whose controller picks the levers (ppo_tiny.yaml's
    ``run.rollout.levers: auto``, native engine only) the refusal names rollout.name, not a key never typed."""
    [problem] = resolve_job(ROOT / "examples" / "ppo_tiny.yaml", ["actor_rollout_ref.rollout.name=vllm"]).problems
    assert problem.startswith("actor_rollout_ref.rollout.name: vllm ")
