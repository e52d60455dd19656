"""The verl user's path end to end: a tiny Qwen2 saved by transformers, a BPE tokenizer trained with
``tokenizers`` and saved with a chat template, verl-format GSM8K-style Parquet rows
(``examples/make_tiny_hf.py``); ``examples/grpo_gsm8k_hf.yaml`` pointed at them runs GRPO and PPO steps
under TP2 and DP2 layouts on the shared 4-worker runtime and writes HF checkpoints that transformers
loads, with logits equal to Nereus's."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import replace

import pytest
import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("pyarrow")

from nereus.run.job import RLJob  # noqa: E402
from nereus.run.setup import place  # noqa: E402
from nereus.runtime.model.decoder import CausalLM  # noqa: E402
from nereus.spec.engines import engine_traits, installed_distribution  # noqa: E402
from nereus.spec.errors import SpecError  # noqa: E402
from nereus.spec.job import load_job  # noqa: E402
from tests.conftest import EXAMPLES  # noqa: E402
from tests.run.test_job import TIMING  # noqa: E402

pytestmark = pytest.mark.distributed
TOL = 1e-4  # as tests/runtime/model/test_hf.py: fp32 on CPU, another kernel order


def varied_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A user reward function (verl's signature) that differs between responses, so that a random
    model's GRPO groups have non-zero advantages and the actor's weights move."""
    assert data_source == "openai/gsm8k" and "question" in extra_info
    return (len(solution_str) % 4) / 3.0


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_tiny_hf", EXAMPLES / "make_tiny_hf.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    root = maker.make(tmp_path_factory.mktemp("tiny_hf"), rows=24, val=4)
    shutil.copytree(root / "model", root / "qwen3")  # the tokenizer files; the weights of a Qwen3 over them
    cfg = transformers.AutoConfig.from_pretrained(root / "model")
    maker.make_model(root / "qwen3", cfg.vocab_size, cfg.eos_token_id, cfg.pad_token_id, arch="qwen3")
    torch.manual_seed(1)  # a reward model: a sequence-classification checkpoint with one label
    cfg = transformers.AutoConfig.from_pretrained(root / "model", num_labels=1)
    transformers.Qwen2ForSequenceClassification(cfg).save_pretrained(root / "rm")
    return root


def _job_file(tiny_hf, tmp_path, algorithm: str, folder: str = "model") -> str:
    spec = yaml.safe_load((EXAMPLES / "grpo_gsm8k_hf.yaml").read_text())
    model = str(tiny_hf / folder)
    spec["models"] = {"actor": {"path": model}, "reference": {"path": model}}
    run = spec["run"]
    run.update(steps=2, eval_every=2, data={"train": str(tiny_hf / "train.parquet"),
                                            "val": str(tiny_hf / "val.parquet")},
               checkpoint={"dir": str(tmp_path), "every": 2}, actor_lr=0.01)
    spec["workload"].update(prompts_per_step=2, response_length={"mean": 4, "max": 6})
    if algorithm == "grpo":
        run["reward_function"] = "tests.run.test_hf_job:varied_score"
        run["layouts"]["actor/training"]["layout"] = "tp=2,dp=2,micro_batch_size=1"
        run["layouts"]["actor/inference"]["layout"] = "dp=2,micro_batch_size=2"
        run["layouts"]["reference/inference"]["layout"] = "tp=2,micro_batch_size=4"
    else:  # PPO: the critic from the actor's directory with a new value head, a reward model of its own
        spec["models"] |= {"critic": {"path": model}, "reward": {"path": str(tiny_hf / "rm")}}
        spec["algorithm"] = {"name": "ppo", "samples_per_prompt": 2, "mini_batches": 1}
        run.update(use_kl_loss=False, kl_coef=0.01, reward_model_coef=1.0)
        run["layouts"] = {
            "actor/generation": {"layout": "dp=2", "ranks": [0, 1]},
            "actor/inference": {"layout": "tp=2,micro_batch_size=2", "ranks": [2, 3]},
            "reference/inference": {"layout": "dp=2,micro_batch_size=1", "ranks": [1, 0]},
            "critic/inference": {"layout": "dp=2,micro_batch_size=2", "ranks": [2, 3]},
            "reward/inference": {"layout": "tp=2,micro_batch_size=4", "ranks": [0, 3]},
            "actor/training": {"layout": "tp=2,dp=2,micro_batch_size=1", "ranks": [0, 1, 2, 3]},
            "critic/training": {"layout": "dp=2,micro_batch_size=1", "ranks": [3, 2]}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def _tokens(tok, n: int = 3) -> torch.Tensor:
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 3+4? #### 7"}], add_generation_prompt=True,
                                  tokenize=False)
    row = tok(ids, add_special_tokens=False)["input_ids"]
    return torch.tensor([row] * n)


def _ours(folder, weights: dict) -> CausalLM:
    from nereus.runtime.model.hf import read_config

    model = CausalLM(read_config(folder))
    model.load_state_dict(weights, strict=True)
    return model.eval()


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_hf_model_and_verl_dataset(ray_runtime, tiny_hf, tmp_path, algorithm):
    """PPO from a Qwen2 checkpoint; GRPO from a Qwen3 one (q/k norms, under TP2·DP2 training)."""
    folder = "qwen3" if algorithm == "grpo" else "model"
    rl = RLJob(load_job(_job_file(tiny_hf, tmp_path, algorithm, folder)), runtime=ray_runtime, out_dir=tmp_path,
               quiet=True)
    try:
        assert type(rl.tok).__name__ == "HFTokenizer" and rl.train[0].data_source == "openai/gsm8k"
        summary = rl.execute()
        trained = {m: rl.rt.read_weights(next(p.key for p in rl.placed if p.model == m and p.stage == "training"))
                   for m in ("actor", "critic") if m in rl.job.algorithm.models}
    finally:
        rl.release()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and summary["final_accuracy"] is not None
    assert any(r["critic/score/mean"] != 0 for r in rows)  # the user's function / the reward model scored

    step = tmp_path / "step_2" / "actor"
    hf = transformers.AutoModelForCausalLM.from_pretrained(step).eval()
    tok = transformers.AutoTokenizer.from_pretrained(step)  # the tokenizer files travel with the checkpoint
    start = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf / folder)
    assert type(hf) is type(start)  # saved as the class it was loaded from (Qwen3ForCausalLM for GRPO)
    moved = max((a - b).abs().max().item() for a, b in zip(hf.parameters(), start.parameters(), strict=True))
    assert moved > 0  # the run trained the actor
    x = _tokens(tok)
    with torch.no_grad():
        err = (hf(x).logits - _ours(step, trained["actor"])(x)).abs().max().item()
    assert err <= TOL, err
    if algorithm == "ppo":  # the critic: a Qwen2ForSequenceClassification whose score is our value head's
        critic = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "step_2" / "critic")
        with torch.no_grad():
            want = critic.eval()(x).logits[:, 0]
            got = _ours(tmp_path / "step_2" / "critic", trained["critic"])(x)[:, -1]
        assert (want - got).abs().max().item() <= TOL
        # resume: the reference and reward model reload from their HF directories, the critic's new
        # value head from init/critic, the trained models from step_2
        longer = replace(rl.job, run=replace(rl.job.run, steps=3))
        again = RLJob(longer, runtime=ray_runtime, out_dir=tmp_path, quiet=True)
        try:
            again.execute(resume=True)
        finally:
            again.release()
        rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert (tmp_path / "init" / "critic" / "model.safetensors").exists()
        assert not (tmp_path / "init" / "reference").exists()  # read from its directory, not copied


def test_pretrained_job_refusals(tiny_hf, tmp_path):
    spec = yaml.safe_load(open(_job_file(tiny_hf, tmp_path, "ppo")).read())
    spec["models"]["reward"] = {"path": str(tiny_hf / "model")}  # a causal LM is not a reward model
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError, match=r"models\.reward\.path: .* is not a reward model"):
        RLJob(load_job(tmp_path / "bad.yaml"), out_dir=tmp_path, quiet=True)
    spec["models"]["reward"] = {"layers": 2, "hidden": 32, "ffn_hidden": 64, "heads": 4, "vocab": 320}
    (tmp_path / "mixed.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError, match=r"models\.reward: give path:"):
        load_job(tmp_path / "mixed.yaml")
    spec = yaml.safe_load(open(_job_file(tiny_hf, tmp_path, "grpo")).read())
    spec["run"]["reward_function"] = "tests.run.test_hf_job:no_such_function"
    (tmp_path / "fn.yaml").write_text(yaml.safe_dump(spec))
    rl = RLJob(load_job(tmp_path / "fn.yaml"), out_dir=tmp_path, quiet=True)  # user code is not run in set-up
    with pytest.raises(SpecError, match=r"run\.reward_function: 'tests\.run\.test_hf_job' has no function"):
        rl.execute()  # imported once the job is accepted, before any worker starts


def test_critic_and_reward_sources(tiny_hf, tmp_path):
    """A critic from a causal LM gets the decoder and a zero score head in init/critic; a critic or reward
    model from a sequence-classification checkpoint loads from its own directory, uncopied."""
    from safetensors.torch import load_file

    from nereus.run.warmstart import initial_sources, pretrained_checkpoints
    from nereus.runtime.model.hf import read_config

    model, rm = str(tiny_hf / "model"), str(tiny_hf / "rm")
    cfg = read_config(model).with_value_head()
    pretrained_checkpoints(tmp_path / "a", {"critic": cfg}, {"critic": model})
    written = load_file(str(tmp_path / "a" / "critic" / "model.safetensors"))
    source = load_file(str(tiny_hf / "model" / "model.safetensors"))
    assert torch.equal(written["score.weight"], torch.zeros_like(written["score.weight"]))
    assert torch.equal(written["model.layers.1.mlp.up_proj.weight"], source["model.layers.1.mlp.up_proj.weight"])
    assert "lm_head.weight" not in written
    got = initial_sources(tmp_path / "a", ("actor", "critic"), {"actor": model, "critic": model})
    assert got == {"actor": tiny_hf / "model", "critic": tmp_path / "a" / "critic"}
    pretrained_checkpoints(tmp_path / "b", {"critic": cfg}, {"critic": rm})
    assert not (tmp_path / "b" / "critic").exists()
    assert read_config(rm).value_head and not read_config(model).value_head


def _two_eos_model(tiny_hf, folder):
    """The tiny model with two EOS ids in config.json and generation_config.json (as Llama 3 Instruct lists
    <|end_of_text|> and <|eot_id|>): the tokenizer's EOS and its padding token's id."""
    shutil.copytree(tiny_hf / "model", folder)
    cfg = json.loads((folder / "config.json").read_text())
    eos = [cfg["eos_token_id"], cfg["pad_token_id"]]
    cfg["eos_token_id"] = eos
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return eos


def test_grpo_from_hf_resumes_like_an_uninterrupted_run(ray_runtime, tiny_hf, tmp_path):
    """A GRPO job read wholly from HF directories (init/ holds no weights, only sources.json) resumes with
    the metrics of a run that was never stopped; an EOS list stops generation and stays a list in the
    written checkpoints; a changed starting directory is refused on resume."""
    model = tmp_path / "model"
    eos = _two_eos_model(tiny_hf, model)
    spec = yaml.safe_load(open(_job_file(tiny_hf, tmp_path, "grpo")).read())
    spec["models"] = {"actor": {"path": str(model)}, "reference": {"path": str(model)}}

    def run(out, steps: int, resume: bool = False) -> RLJob:
        spec["run"].update(steps=steps, checkpoint={"dir": str(out), "every": 2})
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
        rl = RLJob(load_job(tmp_path / "job.yaml"), runtime=ray_runtime, out_dir=out, quiet=True)
        try:
            rl.execute(resume=resume)
        finally:
            rl.release()
        return rl

    straight, cut = tmp_path / "straight", tmp_path / "cut"
    rl = run(straight, 4)
    assert rl.tok.stop_token_ids == tuple(eos)
    run(cut, 2)
    assert sorted(p.name for p in (cut / "init").iterdir()) == ["MANIFEST.json", "sources.json"]
    run(cut, 4, resume=True)
    a = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b, strict=True):
        for k, v in ra.items():
            if not k.startswith(TIMING):
                assert rb[k] == pytest.approx(v, rel=1e-4, abs=1e-5), (ra["step"], k)
    written = json.loads((cut / "step_4" / "actor" / "config.json").read_text())
    assert written["eos_token_id"] == eos  # kept as the list, not collapsed to its first id
    assert json.loads((cut / "step_4" / "actor" / "generation_config.json").read_text())["eos_token_id"] == eos
    (model / "config.json").write_text((model / "config.json").read_text().replace('"rms_norm_eps"', '"rms_norm_eps" '))
    with pytest.raises(SpecError, match=r"models\.actor\.path: .* is not the directory the run started from .*: "
                                        r"config\.json differ"):
        run(cut, 5, resume=True)


def _verl_grpo_command(tiny_hf, model: str) -> list[str]:
    """Every key of verl's main GRPO script (examples/grpo_trainer/run_qwen2-7b.sh) with its learning rate
    1e-6, sized for the tiny model (batch sizes, lengths, GPUs) and with console logging (the script's wandb
    is an optional extra here); trainer.total_training_steps is a user's `$@` extra keeping it short."""
    return [
        "algorithm.adv_estimator=grpo", f"data.train_files={tiny_hf / 'train.parquet'}",
        f"data.val_files={tiny_hf / 'val.parquet'}", "data.train_batch_size=4", "data.max_prompt_length=64",
        "data.max_response_length=6", "data.filter_overlong_prompts=True", "data.truncation=error",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=96", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40", "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True", "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0", "trainer.logger=[console]", "trainer.project_name=verl_grpo_example_gsm8k",
        "trainer.experiment_name=qwen2_7b_function_rm", "trainer.n_gpus_per_node=4", "trainer.nnodes=1",
        "trainer.save_freq=20", "trainer.test_freq=5", "trainer.total_epochs=15", "trainer.total_training_steps=2",
    ]


def test_a_verl_grpo_command_line_runs(ray_runtime, tiny_hf, tmp_path, capsys):
    model = str(tiny_hf / "model")
    spec = yaml.safe_load(open(_job_file(tiny_hf, tmp_path, "grpo")).read())
    del spec["run"]["reward_function"]  # the rows' data_source (openai/gsm8k) picks the rule, as in verl
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    # verl's rollout.name=vllm selects the vLLM engine: the tiny model's head size (32) is one its CPU build
    # runs, so the command line is accepted as it is where vLLM is installed; the run below generates with
    # the native engine to keep the suite short (tests/run/test_vllm_job.py runs the vLLM engine)
    if installed_distribution(engine_traits("vllm")) is None:
        with pytest.raises(SpecError, match=r"vllm is not installed.*engine: native"):
            load_job(tmp_path / "job.yaml", _verl_grpo_command(tiny_hf, model))
    else:
        assert load_job(tmp_path / "job.yaml", _verl_grpo_command(tiny_hf, model)).run.rollout_engine.engine == "vllm"
    capsys.readouterr()
    native = "actor_rollout_ref.rollout.name=native"
    job = load_job(tmp_path / "job.yaml", [*_verl_grpo_command(tiny_hf, model), native])
    notes = capsys.readouterr().err
    for ignored in ("ppo_micro_batch_size_per_gpu=40", "fsdp_config.param_offload=True", "project_name="):
        assert any(line.startswith("nereus: ignoring ") and f".{ignored}" in line
                   for line in notes.splitlines()), ignored
    assert not any(line.startswith("nereus: ignoring ") and ("padding" in line or "token_len" in line
                                                             or "dynamic_bsz" in line) for line in notes.splitlines())
    r, a = job.run, job.algorithm
    assert (r.actor_lr, r.steps, r.total_epochs, r.eval_every, r.checkpoint_every, r.kl_coef) == (1e-6, 2, 15, 5, 20, 0)
    assert (a.adv_estimator, a.samples_per_prompt, a.mini_batches) == ("grpo", 4, 2)
    assert job.paths == {"actor": model, "reference": model} and job.name == "qwen2_7b_function_rm"
    assert (r.use_kl_loss, r.kl_loss_coef, r.kl_loss_type) == (True, 0.001, "low_var_kl")
    assert r.data.filter_overlong_prompts and r.rollout_engine.engine == "native"
    gen = r.layouts["actor/generation"]  # verl's rollout TP: tp=2, dp filling the 4 workers
    assert (gen.tp, gen.pp, gen.dp) == (2, 1, 2)
    assert (r.packing.enable, r.packing.dynamic_bsz, r.packing.max_token_len_per_gpu) == (True, True, 96)
    rl = RLJob(job, runtime=ray_runtime, out_dir=tmp_path / "out", quiet=True)
    try:
        # packed: the actor's training and inference and the reference's inference in 96-token micro-batches
        assert {(p.model, p.stage): p.layout.max_token_len for p in place(job) if p.stage != "generation"} == {
            ("actor", "training"): 96, ("actor", "inference"): 96, ("reference", "inference"): 96}
        summary = rl.execute()
    finally:
        rl.release()
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2] and summary["final_accuracy"] is not None
    assert rows[0]["actor/lr"] == 1e-6
