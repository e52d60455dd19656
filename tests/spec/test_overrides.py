"""``nereus run JOB.yaml key.path=value ...``: overrides change the raw tree before validation, so values
are checked as in the file and errors name the key; verl's key paths map onto Nereus's."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nereus.cli import main
from nereus.devtools.verl_keys_table import markdown
from nereus.spec.errors import SpecError
from nereus.spec.job import load_job
from nereus.spec.overrides import VERL_KEYS, apply_overrides, parse_override
from nereus.spec.verl_keys import DERIVED, MAPPED, TABLE

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny.yaml"


def test_values_are_yaml_scalars_and_collections():
    assert parse_override("run.clip_ratio=0.3") == ("run.clip_ratio", 0.3, False)
    assert parse_override("run.steps=7") == ("run.steps", 7, False)
    assert parse_override("run.use_kl_loss=false") == ("run.use_kl_loss", False, False)
    assert parse_override("run.kl_loss_type=low_var_kl") == ("run.kl_loss_type", "low_var_kl", False)
    assert parse_override("run.logger=[console,jsonl]") == ("run.logger", ["console", "jsonl"], False)
    assert parse_override("run.data.train=a=b.jsonl") == ("run.data.train", "a=b.jsonl", False)  # first '=' splits
    assert parse_override("+run.seed=3") == ("run.seed", 3, False)  # Hydra's add form
    assert parse_override("~run.clip_ratio") == ("run.clip_ratio", None, True)


def test_verl_keys_map_to_nereus_keys():
    assert parse_override("actor_rollout_ref.actor.clip_ratio_c=2.5") == ("run.clip_ratio_c", 2.5, False)
    assert parse_override("actor_rollout_ref.rollout.n=4") == ("algorithm.samples_per_prompt", 4, False)
    assert parse_override("trainer.logger=['console','tensorboard']")[0] == "run.logger"
    assert parse_override("actor_rollout_ref.rollout.val_kwargs.n=8") == ("run.rollout.val_kwargs.n", 8, False)
    # derived, ignored and refused keys come back as written, for apply_overrides
    assert parse_override("actor_rollout_ref.actor.ppo_mini_batch_size=64")[0] == (
        "actor_rollout_ref.actor.ppo_mini_batch_size")
    with pytest.raises(SpecError, match=r"actor_rollout_ref\.actor\.no_such_knob: a verl key Nereus does not know"):
        parse_override("actor_rollout_ref.actor.no_such_knob=1")


@pytest.mark.parametrize("bad", ["run.clip_ratio", "=3", "run..x=1", "~run.x=1"])
def test_malformed_overrides(bad):
    with pytest.raises(SpecError):
        parse_override(bad)


def test_apply_sets_creates_deletes_and_leaves_the_input_alone():
    data = {"run": {"clip_ratio": 0.2, "curriculum": [{"step": 0, "max_response_length": 4}]}}
    out = apply_overrides(data, ["run.clip_ratio=0.3", "run.data.train=x.jsonl", "run.curriculum.0.step=1",
                                 "~run.missing.deeper", "~run.clip_ratio"])
    assert out == {"run": {"curriculum": [{"step": 1, "max_response_length": 4}], "data": {"train": "x.jsonl"}}}
    assert data["run"]["clip_ratio"] == 0.2  # a copy
    with pytest.raises(SpecError, match=r"run\.clip_ratio: is 0\.2, not a section"):
        apply_overrides(data, ["run.clip_ratio.low=1"])
    with pytest.raises(SpecError, match=r"run\.curriculum\.5: is not an index"):
        apply_overrides(data, ["run.curriculum.5.step=1"])


def test_load_job_validates_overrides_like_the_file():
    job = load_job(EXAMPLE, ["run.clip_ratio=0.3", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
                             "algorithm.samples_per_prompt=4", "run.steps=2"])
    assert (job.run.clip_ratio, job.run.loss_agg_mode) == (0.3, "seq-mean-token-mean")
    assert (job.algorithm.samples_per_prompt, job.run.steps) == (4, 2)
    assert load_job(EXAMPLE).run.clip_ratio == yaml.safe_load(EXAMPLE.read_text())["run"]["clip_ratio"]
    with pytest.raises(SpecError, match=r"run\.clip_ratoi: unknown key; did you mean 'clip_ratio'\? "
                                        r"\(also close: 'clip_ratio_c', 'clip_ratio_low'\)"):
        load_job(EXAMPLE, ["run.clip_ratoi=0.3"])
    with pytest.raises(SpecError, match=r"run\.clip_ratio: expected a number, got 'high'"):
        load_job(EXAMPLE, ["run.clip_ratio=high"])
    with pytest.raises(SpecError, match=r"run\.loss_agg_mode: 'token-max' is not allowed"):
        load_job(EXAMPLE, ["run.loss_agg_mode=token-max"])


def test_cli_takes_overrides_before_or_after_flags(capsys):
    # the spec error comes before anything runs: the override reached validation in both orders
    for argv in (["run", str(EXAMPLE), "run.clip_ratio_c=0.5", "--workers", "2"],
                 ["run", str(EXAMPLE), "--workers", "2", "run.clip_ratio_c=0.5"]):
        assert main(argv) == 2
        assert "run.clip_ratio_c: 0.5 must exceed 1" in capsys.readouterr().err


def test_verl_in_reward_kl_switch():
    base = {"run": {"steps": 1}}
    assert apply_overrides(base, ["algorithm.use_kl_in_reward=true"])["run"]["kl_coef"] == 0.001  # verl's default
    kept = apply_overrides({"run": {"kl_coef": 0.05}}, ["algorithm.use_kl_in_reward=true"])
    assert kept["run"]["kl_coef"] == 0.05
    both = apply_overrides(base, ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.02"])
    assert both["run"]["kl_coef"] == 0.02 and "algorithm" not in both
    assert apply_overrides({"run": {"kl_coef": 0.05}}, ["algorithm.use_kl_in_reward=false"])["run"]["kl_coef"] == 0
    adaptive = apply_overrides(base, ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.05",
                                      "algorithm.kl_ctrl.horizon=500"])
    assert adaptive["run"]["kl_ctrl"] == {"type": "adaptive", "target_kl": 0.05, "horizon": 500}
    with pytest.raises(SpecError, match=r"algorithm\.use_kl_in_reward: expected true or false"):
        apply_overrides(base, ["algorithm.use_kl_in_reward=maybe"])


# verl's reward KL: use_kl_in_reward (true / false / absent) gates kl_ctrl.kl_coef (given / absent), in either
# order. (job's run.kl_coef, use_kl_in_reward, kl_ctrl.kl_coef) -> run.kl_coef; absent use: verl's false, unless
# the job itself has the penalty on. None: the key is not given; the job's kl_coef 0 is off, 0.05 on.
KL_CASES = [
    (0.0, True, 0.02, 0.02), (0.0, True, None, 0.001), (0.05, True, None, 0.05), (0.05, True, 0.02, 0.02),
    (0.0, False, 0.02, 0.0), (0.05, False, 0.02, 0.0), (0.05, False, None, 0.0), (0.0, False, None, 0.0),
    (0.0, None, 0.02, 0.0), (0.05, None, 0.02, 0.02), (0.05, None, None, 0.05), (0.0, None, None, 0.0),
]


@pytest.mark.parametrize("reverse", [False, True], ids=["use-first", "coef-first"])
@pytest.mark.parametrize(("job", "use", "coef", "want"), KL_CASES)
def test_use_kl_in_reward_gates_the_kl_coefficient_in_either_order(job, use, coef, want, reverse, capsys):
    given = ([] if use is None else [f"algorithm.use_kl_in_reward={use}"]) + \
            ([] if coef is None else [f"algorithm.kl_ctrl.kl_coef={coef}"])
    out = apply_overrides({"run": {"steps": 1, "kl_coef": job}}, given[::-1] if reverse else given)
    assert out["run"]["kl_coef"] == want
    ignored = "ignoring algorithm.kl_ctrl.kl_coef" in capsys.readouterr().err
    assert ignored == (coef is not None and want != coef)  # a coefficient verl would not use is said so


def test_every_verl_key_is_in_the_docs_table():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "rl.md").read_text()
    assert markdown() in docs  # docs/rl.md holds the table as nereus.devtools.verl_keys_table writes it
    for verl, nereus in VERL_KEYS.items():
        assert f"`{verl}`" in docs and f"`{nereus}`" in docs, verl
    for verl, entry in TABLE.items():
        assert f"`{verl}`" in docs, verl
        assert entry.kind in (MAPPED, DERIVED) or entry.reason, verl  # every key not mapped says why


# Every key of verl's main GRPO script (examples/grpo_trainer/run_qwen2-7b.sh at verl b178a3c), with its
# value as the script writes it; `$@` extras a user commonly appends come after.
VERL_GRPO = [
    "algorithm.adv_estimator=grpo", "data.train_files=$HOME/data/gsm8k/train.parquet",
    "data.val_files=$HOME/data/gsm8k/test.parquet", "data.train_batch_size=1024", "data.max_prompt_length=512",
    "data.max_response_length=1024", "data.filter_overlong_prompts=True", "data.truncation='error'",
    "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct", "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.ppo_mini_batch_size=256",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40", "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", "trainer.logger='[\"console\",\"wandb\"]'",
    "trainer.project_name='verl_grpo_example_gsm8k'", "trainer.experiment_name='qwen2_7b_function_rm'",
    "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.save_freq=20", "trainer.test_freq=5",
    "trainer.total_epochs=15",
]


def _shell_value(text: str) -> str:
    """What bash hands verl for ``key=value``: its quotes removed (``'error'`` is ``error``)."""
    key, _, value = text.partition("=")
    return f"{key}={value.replace(chr(39), '')}"


def test_verl_grpo_script_keys_are_all_known():
    keys = [_shell_value(t).partition("=")[0] for t in VERL_GRPO]
    assert len(keys) == 37 and all(k in TABLE for k in keys)
    out = apply_overrides({"models": {"actor": {"path": "a"}, "reference": {"path": "a"}}, "run": {}},
                          [_shell_value(t) for t in VERL_GRPO])
    run, alg = out["run"], out["algorithm"]
    qwen = {"path": "Qwen/Qwen2-7B-Instruct"}
    assert out["models"] == {"actor": qwen, "reference": qwen}
    assert (alg["adv_estimator"], alg["samples_per_prompt"], alg["mini_batches"]) == ("grpo", 5, 4)  # 1024 / 256
    assert out["workload"] == {"prompts_per_step": 1024, "prompt_length": 512, "response_length": {"max": 1024}}
    assert (run["use_kl_loss"], run["kl_loss_coef"], run["kl_loss_type"], run["kl_coef"]) == (True, 0.001,
                                                                                              "low_var_kl", 0.0)
    assert run["data"] == {"train": "$HOME/data/gsm8k/train.parquet", "val": "$HOME/data/gsm8k/test.parquet",
                           "filter_overlong_prompts": True}
    assert (run["total_epochs"], run["eval_every"], run["checkpoint"], run["logger"]) == (
        15, 5, {"every": 20}, ["console", "wandb"])
    assert (out["name"], out["cluster"]) == ("qwen2_7b_function_rm", {"gpus_per_node": 8, "nodes": 1})
    assert out["options"]["recompute"] == "full"  # enable_gradient_checkpointing: every layer re-run
    with pytest.raises(SpecError, match="critic.model.enable_gradient_checkpointing.*one value for actor and critic"):
        apply_overrides({}, ["actor_rollout_ref.model.enable_gradient_checkpointing=True",
                             "critic.model.enable_gradient_checkpointing=False"])


def test_ignored_verl_keys_are_noted_and_refused_ones_say_why(capsys):
    apply_overrides({}, ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40", "data.truncation=error",
                         "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1"])
    err = capsys.readouterr().err
    assert ("ignoring actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40: the micro-batch size is part "
            "of each model-stage's layout") in err
    assert "truncation" not in err and "expert" not in err  # verl's values that mean what Nereus does
    for text, why in [("data.truncation=left", "Nereus never truncates a prompt"),
                      ("actor_rollout_ref.model.lora_rank=32", "LoRA adapters are not implemented"),
                      ("actor_rollout_ref.actor.megatron.context_parallel_size=2", "context parallelism is not"),
                      ("actor_rollout_ref.rollout.expert_parallel_size=4", "expert parallelism in generation")]:
        with pytest.raises(SpecError, match=rf"{text.split('=')[0]}: .*{why}"):
            apply_overrides({}, [text])


def test_derived_verl_keys():
    base = {"workload": {"prompts_per_step": 16}, "models": {"actor": {}, "critic": {}}}
    mb = "actor_rollout_ref.actor.ppo_mini_batch_size"
    assert apply_overrides(base, [f"{mb}=4"])["algorithm"]["mini_batches"] == 4
    assert apply_overrides(base, [f"{mb}=8", "data.train_batch_size=32"])["algorithm"]["mini_batches"] == 4
    with pytest.raises(SpecError, match=rf"{mb}: 5 prompts must divide data.train_batch_size"):
        apply_overrides(base, [f"{mb}=5"])
    with pytest.raises(SpecError, match=r"actor and critic must use one mini-batch size"):
        apply_overrides(base, [f"{mb}=4", "critic.ppo_mini_batch_size=8"])
    fn = apply_overrides(base, ["custom_reward_function.path=my/reward.py"])["run"]["reward_function"]
    assert fn == "my/reward.py:compute_score"  # verl's default name
    both = ["custom_reward_function.name=score", "custom_reward_function.path=r.py"]
    assert apply_overrides(base, both)["run"]["reward_function"] == "r.py:score"
    renamed = apply_overrides({"run": {"reward_function": "pkg.mod:old"}}, ["custom_reward_function.name=new"])
    assert renamed["run"]["reward_function"] == "pkg.mod:new"
    with pytest.raises(SpecError, match=r"custom_reward_function\.name: needs custom_reward_function\.path"):
        apply_overrides(base, ["custom_reward_function.name=score"])
    assert apply_overrides(base, ["trainer.save_freq=-1", "trainer.test_freq=-1"])["run"] == {
        "checkpoint": {"every": 0}, "eval_every": 0}
    with pytest.raises(SpecError, match=r"reward_model\.enable: the job has no reward model"):
        apply_overrides(base, ["reward_model.enable=true"])
    assert "algorithm" not in apply_overrides({"models": {"reward": {}}}, ["reward_model.enable=true"])


def test_two_verl_keys_that_set_one_nereus_key_must_agree():
    same = apply_overrides({}, ["actor_rollout_ref.actor.grad_clip=1.0", "critic.grad_clip=1.0"])
    assert same["run"]["grad_clip"] == 1.0
    with pytest.raises(SpecError, match=r"critic\.optim\.lr_warmup_steps_ratio: 0\.05 differs from "
                                        r"actor_rollout_ref\.actor\.optim\.lr_warmup_steps_ratio=0\.1"):
        apply_overrides({}, ["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
                             "critic.optim.lr_warmup_steps_ratio=0.05"])
    # a Nereus key given directly is not a verl key: the later one wins, as for any override
    assert apply_overrides({}, ["critic.grad_clip=0.5", "run.grad_clip=2.0"])["run"]["grad_clip"] == 2.0


def test_critic_keys_on_a_job_without_a_critic_are_noted(capsys):
    """verl's critic keys on a GRPO job set nothing that runs: each is noted, never kept silently."""
    grpo = {"algorithm": {"name": "grpo"}, "run": {}}
    apply_overrides(grpo, ["critic.optim.lr=1e-5", "actor_rollout_ref.actor.optim.lr=1e-6"])
    err = capsys.readouterr().err
    assert "ignoring critic.optim.lr: the job trains no critic (algorithm.name grpo)" in err
    assert "actor_rollout_ref" not in err
    apply_overrides({"algorithm": {"name": "ppo"}, "run": {}}, ["critic.optim.lr=1e-5"])
    assert "critic" not in capsys.readouterr().err  # a PPO job trains one
