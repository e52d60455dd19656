"""Errors name the key the user typed: a verl override's key, not the Nereus key it set (``spec.typed_keys``),
and a misspelt key gets the closest known key."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereus.cli import main
from nereus.spec.errors import SpecError
from nereus.spec.job import load_job
from nereus.spec.typed_keys import TypedKeys, override_key

GRPO = Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny.yaml"


@pytest.mark.parametrize(("override", "nereus_key", "why"), [
    ("actor_rollout_ref.rollout.n=1", "algorithm.samples_per_prompt", "at least 2 responses per prompt"),
    ("data.train_batch_size=0", "workload.prompts_per_step", "out of range"),
    ("actor_rollout_ref.actor.clip_ratio_c=0.5", "run.clip_ratio_c", "must exceed 1"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=0", None, "expected a positive integer"),
])
def test_a_verl_keys_bad_value_is_refused_under_the_verl_key(override, nereus_key, why):
    with pytest.raises(SpecError) as err:
        load_job(GRPO, [override])
    assert err.value.path == override_key(override) and why in err.value.message
    if nereus_key:
        assert f"({nereus_key} in Nereus's terms)" in err.value.message


def test_a_nereus_key_keeps_its_name():
    with pytest.raises(SpecError) as err:
        load_job(GRPO, ["run.clip_ratio_c=0.5"])
    assert err.value.path == "run.clip_ratio_c" and "Nereus's terms" not in err.value.message


def test_every_nereus_key_a_message_names_is_written_as_typed():
    typed = TypedKeys.of({"data.train_batch_size": {"workload.prompts_per_step"},
                          "actor_rollout_ref.rollout.n": {"algorithm.samples_per_prompt"}, "run.steps": {"run.steps"}},
                         ["data.train_batch_size=10", "+actor_rollout_ref.rollout.n=5", "run.steps=3"])
    err = typed.rename(SpecError("run.layouts.actor/training", "change workload.prompts_per_step or "
                                 "algorithm.samples_per_prompt, not workload.prompts_per_step_x or run.steps"))
    assert err.path == "run.layouts.actor/training"  # no override set it
    assert err.message == ("change data.train_batch_size or actor_rollout_ref.rollout.n, not "
                           "workload.prompts_per_step_x or run.steps")
    inside = typed.rename(SpecError("workload.prompts_per_step[0]", "bad"))
    assert inside.path == "data.train_batch_size[0]"


@pytest.mark.parametrize(("override", "hint"), [
    ("actor_rollout_rf.actor.clip_ratio=0.3", "actor_rollout_ref.actor.clip_ratio"),  # a misspelt verl section
    ("trainer.n_gpu_per_node=8", "trainer.n_gpus_per_node"),
    ("actor_rollout_ref.actor.ppo_mini_batch_sise=4", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    ("run.clip_ratoi=0.3", "clip_ratio"),  # a misspelt Nereus key
    ("algoritm.name=grpo", "algorithm"),
])
def test_a_misspelt_key_gets_a_did_you_mean(override, hint):
    with pytest.raises(SpecError) as err:
        load_job(GRPO, [override])
    assert err.value.path == override_key(override) or override_key(override).startswith(err.value.path)
    assert f"did you mean '{hint}'?" in err.value.message


def test_nereus_run_and_cfg_job_name_the_typed_key(capsys):
    for extra in ([], ["--cfg", "job"]):
        assert main(["run", str(GRPO), "actor_rollout_ref.rollout.n=1", *extra]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith("nereus: error: actor_rollout_ref.rollout.n: grpo (algorithm.adv_estimator) compares")
