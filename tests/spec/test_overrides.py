"""``nereus run JOB.yaml key.path=value ...``: overrides change the raw tree before validation, so values
are checked as in the file and errors name the key; verl's key paths map onto Nereus's."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nereus.cli import main
from nereus.spec.errors import SpecError
from nereus.spec.job import load_job
from nereus.spec.overrides import VERL_KEYS, apply_overrides, parse_override

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
    with pytest.raises(SpecError, match=r"actor_rollout_ref\.actor\.ppo_mini_batch_size: a verl key without"):
        parse_override("actor_rollout_ref.actor.ppo_mini_batch_size=64")


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
    with pytest.raises(SpecError, match=r"run\.loss_agg_mode: 'token-sum' is not allowed"):
        load_job(EXAMPLE, ["run.loss_agg_mode=token-sum"])


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
    assert apply_overrides(base, ["algorithm.kl_ctrl.type=fixed"]) == base
    with pytest.raises(SpecError, match=r"algorithm\.kl_ctrl\.type: 'adaptive': only a fixed KL coefficient"):
        apply_overrides(base, ["algorithm.kl_ctrl.type=adaptive"])
    with pytest.raises(SpecError, match=r"algorithm\.use_kl_in_reward: expected true or false"):
        apply_overrides(base, ["algorithm.use_kl_in_reward=maybe"])


def test_every_verl_key_is_in_the_docs_table():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "rl.md").read_text()
    for verl, nereus in VERL_KEYS.items():
        assert f"`{verl}`" in docs and f"`{nereus}`" in docs, verl
