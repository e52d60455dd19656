"""The fixed-layout path's planner proposes only layouts the batch checks accept (``run.setup._planned`` filters
by ``batch_split_problem``, the check ``check_batches`` makes), and a batch no layout splits is refused naming
the batch keys as typed, not a ``run.layouts`` the user never wrote. No worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereus.cli import main
from nereus.run.setup import batch_split_problem, check_batches, place, runtime_layout_ok
from nereus.spec.job import load_job
from nereus.spec.layout import Layout

GRPO = Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny.yaml"
# verl's batch keys: 10 prompts x 5 responses = 50 sequences a step, mini-batches of 5 prompts (25 sequences)
VERL_BATCHES = ["~run.layouts", "data.train_batch_size=10", "actor_rollout_ref.rollout.n=5",
                "actor_rollout_ref.actor.ppo_mini_batch_size=5"]


def test_the_planner_picks_layouts_whose_batches_split():
    job = load_job(GRPO, VERL_BATCHES)
    placed = place(job)
    assert {f"{p.model}/{p.stage}" for p in placed} == {str(ms) for ms in job.model_stages()}
    assert all(batch_split_problem(job, p.stage, p.layout) is None for p in placed)
    check_batches(job, placed)  # used to refuse the planner's dp=2 for the 25-sequence mini-batch


def test_the_filter_and_the_check_are_one_function():
    job = load_job(GRPO, VERL_BATCHES)
    runs = {"recompute": "none", "sequence_parallel": False}  # what the runtime runs (runtime.capability)
    split, uneven = Layout(pp=2, dp=1, **runs), Layout(pp=2, dp=2, **runs)  # a 25-sequence mini-batch
    assert batch_split_problem(job, "training", split) is None and runtime_layout_ok(job, "training", split, "actor")
    why = batch_split_problem(job, "training", uneven)
    assert why == "the mini-batch of 25 sequences does not split into dp=2 x micro_batch_size=1"
    assert not runtime_layout_ok(job, "training", uneven, "actor")


@pytest.mark.parametrize(("mbs", "key", "what"), [
    (4, "data.train_batch_size", "actor/inference on 1 to 4 workers splits its batch of 50 sequences"),
    (2, "actor_rollout_ref.actor.ppo_mini_batch_size", "actor/training on 1 to 4 workers splits its mini-batch of 25"),
])
def test_a_batch_no_layout_splits_is_refused_naming_the_batch_keys(mbs, key, what, tmp_path, capsys):
    assert main(["run", str(GRPO), *VERL_BATCHES, f"options.micro_batch_size={mbs}", "--out", str(tmp_path)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"nereus: error: {key}: no layout of {what}")
    assert ("change data.train_batch_size, actor_rollout_ref.rollout.n or actor_rollout_ref.actor.ppo_mini_batch_size"
            in line) and "run.layouts" not in line


def test_the_planner_prices_the_token_budgets_the_run_packs_with():
    """With run.packing the planner proposes each inference and training layout with the token budget the
    run gives it (``planner.defaults.planned_token_budget``), so the cost model prices the packed
    micro-batches the runtime runs (``cost.stage_tokens``), not padded ones."""
    from nereus.run.setup import _planned

    job = load_job(GRPO, [*VERL_BATCHES, "actor_rollout_ref.model.use_remove_padding=True",
                          "actor_rollout_ref.actor.use_dynamic_bsz=True",
                          "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=96"])
    planned = _planned(job)
    assert planned["actor/training"][0].max_token_len == 96 and planned["actor/generation"][0].max_token_len == 0
    runs = {f"{p.model}/{p.stage}": p.layout.max_token_len for p in place(job)}
    assert runs == {k: v[0].max_token_len for k, v in planned.items()}  # what was priced is what runs
