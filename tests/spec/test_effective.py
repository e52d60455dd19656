"""Overrides never leave contradictory job-file values (``overrides.VerlOverrides._algorithm``), and the job as
it runs is printed and saved (``spec.effective``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nereus.spec.effective import EFFECTIVE_CONFIG, header_line
from nereus.spec.errors import SpecError
from nereus.spec.job import load_effective, load_job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PPO, PPO_FIXED, GRPO = EXAMPLES / "ppo_tiny.yaml", EXAMPLES / "ppo_tiny_fixed.yaml", EXAMPLES / "grpo_tiny.yaml"


@pytest.mark.parametrize("key", ["algorithm.adv_estimator", "+algorithm.adv_estimator"])
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus"])
def test_a_critic_free_estimator_on_a_ppo_job_trains_no_critic(key, estimator, capsys):
    job = load_job(PPO, [f"{key}={estimator}"])  # verl's way to ask for GRPO: its estimator
    assert (job.algorithm.name, job.algorithm.adv_estimator) == ("grpo", estimator)
    assert "critic" not in job.algorithm.models and "critic" not in job.models
    assert "algorithm.name ppo -> grpo (the job file's): as in verl, only gae trains a critic" in (
        capsys.readouterr().err)


def test_the_job_files_critic_layouts_and_model_list_follow(capsys):
    for override in ("algorithm.adv_estimator=grpo", "algorithm.name=grpo"):
        job = load_job(PPO_FIXED, [override, "algorithm.models=[actor, critic, reference, reward]"])
        assert job.algorithm.name == "grpo" and "critic" not in job.algorithm.models
        assert not any(stage.startswith("critic/") for stage in job.run.layouts)
        assert "run.layouts of critic/inference, critic/training are not used" in capsys.readouterr().err
    # GAE on a GRPO job that has a critic model: ppo, and the critic joins the job's model list
    job = load_job(GRPO, ["algorithm.adv_estimator=gae",
                          "+models.critic={layers: 2, hidden: 64, ffn_hidden: 128, heads: 4, kv_heads: 2, vocab: 64}"])
    assert (job.algorithm.name, job.algorithm.models) == ("ppo", ("actor", "reference", "critic"))


@pytest.mark.parametrize(("path", "overrides", "where", "names"), [
    (PPO, ["algorithm.adv_estimator=grpo", "algorithm.name=ppo"], "algorithm.adv_estimator", "algorithm.name=ppo"),
    (GRPO, ["algorithm.adv_estimator=gae"], "algorithm.adv_estimator", "algorithm.name grpo leaves out"),
    (GRPO, ["actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n", "grpo (algorithm.adv_estimator)"),
    (PPO, ["algorithm.adv_estimator=grpo", "algorithm.samples_per_prompt=1"], "algorithm.samples_per_prompt",
     "grpo (algorithm.adv_estimator)"),
])
def test_what_cannot_be_made_consistent_is_refused_naming_both_keys(path, overrides, where, names):
    with pytest.raises(SpecError) as err:
        load_job(path, overrides)
    assert err.value.path == where and names in err.value.message
    assert "\n" not in str(err.value)


def test_the_effective_config_is_the_tree_the_job_was_validated_from(tmp_path, capsys):
    job, config = load_effective(PPO, ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.clip_ratio=0.3"])
    assert header_line(job) == ("algorithm.name=grpo adv_estimator=grpo samples_per_prompt=4 mini_batches=2 "
                                "epochs=1 models=[actor, reference, reward]")
    path = config.save(tmp_path, job)
    assert path == tmp_path / EFFECTIVE_CONFIG
    text = path.read_text()
    assert text.startswith("# override: algorithm.adv_estimator=grpo\n# override: actor_rollout_ref.actor.clip_ratio")
    assert "#   actor_rollout_ref.actor.clip_ratio=0.3  -> run.clip_ratio" in text
    saved = yaml.safe_load(text)
    assert saved == {**config.tree, "run": {**config.tree["run"], "workers": 4}}  # the workers it runs on, too
    assert saved["algorithm"]["name"] == "grpo" and saved["run"]["clip_ratio"] == 0.3
