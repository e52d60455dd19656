"""``run.packing`` (spec.packing): read as verl's keys, each model-stage's token budget, and the placed
layouts carrying it (``Layout.max_token_len``, the field the runtime packs by)."""

from __future__ import annotations

import pytest

from nereus.run.setup import place
from nereus.spec.errors import SpecError
from nereus.spec.overrides import parse_override
from nereus.spec.packing import PackingSpec, token_budget
from nereus.spec.verl_keys import IGNORED, lookup
from tests.run.jobs import tiny_job

VERL_LINE = ["actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.use_dynamic_bsz=True",
             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64"]


def test_off_by_default_and_layouts_stay_padded(tmp_path):
    job = tiny_job("grpo", str(tmp_path))
    assert job.run.packing == PackingSpec() and not job.run.packing.on
    assert all(p.layout.max_token_len == 0 for p in place(job))


def test_verls_keys_map_onto_run_packing():
    assert [parse_override(k)[0] for k in VERL_LINE] == [
        "run.packing.enable", "run.packing.dynamic_bsz", "run.packing.max_token_len_per_gpu"]
    for key in ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", "critic.use_dynamic_bsz",
                "critic.ppo_max_token_len_per_gpu", "critic.forward_max_token_len_per_gpu",
                "critic.model.use_remove_padding", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz"):
        assert lookup(key).kind != IGNORED, key


def test_budgets_follow_verl():
    dyn = PackingSpec(enable=True, dynamic_bsz=True, max_token_len_per_gpu=64)
    assert token_budget(dyn, "actor", "training", 2, 14) == 64
    assert token_budget(dyn, "reference", "inference", 2, 14) == 64  # log-prob budgets follow the actor's
    assert token_budget(dyn, "critic", "training", 2, 14) == 32768  # verl's critic default
    assert token_budget(dyn, "actor", "generation", 2, 14) == 0
    # use_remove_padding alone: packed micro-batches of the padded ones' tokens (micro-batch size × longest)
    assert token_budget(PackingSpec(enable=True), "actor", "training", 2, 14) == 28
    assert token_budget(PackingSpec(), "actor", "training", 2, 14) == 0


def test_placed_layouts_carry_the_budget(tmp_path):
    job = tiny_job("grpo", str(tmp_path), packing={"enable": True, "dynamic_bsz": True,
                                                   "max_token_len_per_gpu": 64})
    by_stage = {(p.model, p.stage): p.layout for p in place(job)}
    assert by_stage["actor", "training"].max_token_len == 64
    assert by_stage["reference", "inference"].max_token_len == 64
    assert by_stage["actor", "generation"].max_token_len == 0
    assert "packed 64 tok" in by_stage["actor", "training"].short()


def test_bad_budget_names_the_key(tmp_path):
    with pytest.raises(SpecError, match=r"run\.packing\.max_token_len_per_gpu"):
        tiny_job("grpo", str(tmp_path), packing={"dynamic_bsz": True, "max_token_len_per_gpu": 0})
    with pytest.raises(SpecError, match=r"run\.packing\.max_token_len"):
        tiny_job("grpo", str(tmp_path), packing={"max_token_len": 8})
