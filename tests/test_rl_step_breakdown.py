"""`nereus estimate` against published per-stage RL step times (``nereus/cost/rl_step_breakdown.csv``).

The rows that give stage times for a dense model on a stated number of GPUs are verl's synchronous
("colocate sync") DAPO runs of Qwen2.5-Math-7B on 32, 64 and 128 H20 GPUs (rows 1-3): 512 prompts x 16
responses, 16 mini-batch updates (ppo_mini_batch_size 32), FSDP2 training and inference, vLLM rollout,
maximum response 28K tokens. The source states neither the prompt nor the mean response length nor the
rollout TP, so one set of assumptions, fixed here and not fitted, serves every row (docs/cost-model.md):

- prompt 256 tokens (DAPO-Math-17k problems in DAPO's prompt template are a few hundred tokens);
- response lengths log-normal, mean 3,000, sigma 1.0, clipped at 28,672: the repository's DAPO trace
  (traces/long_tail_dapo.yaml) at its first step;
- rollout TP 2: verl's GRPO example for a 7B model (examples/grpo_trainer/run_qwen2-7b.sh, the recipe
  nereus.sim.recipes cites); training and inference FSDP over every GPU, micro-batch 1, full activation
  recompute (verl's DAPO scripts enable gradient checkpointing); every stage on every GPU (colocated).

A stage counts when the prediction is within 25% of the published time (issue 15). Stages the model
misses are strict xfails that carry the measured error; docs/cost-model.md says why.
"""

from __future__ import annotations

import csv
from importlib import resources

import pytest

from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.spec.job import JobSpec, job_from_dict
from nereus.spec.layout import Layout, ModelStage, Placement, Plan

STAGES = {"gen_s": "actor/generation", "old_log_prob_s": "actor/inference", "update_actor_s": "actor/training"}
ROWS = ("1", "2", "3")
ROLLOUT_TP = 2


def published() -> dict[str, dict[str, str]]:
    text = resources.files("nereus.cost").joinpath("rl_step_breakdown.csv").read_text()
    return {row["row_id"]: row for row in csv.DictReader(line for line in text.splitlines()
                                                           if not line.startswith("#"))}


def dapo_job(gpus: int) -> JobSpec:
    return job_from_dict({
        "name": "verl-dapo-qwen2.5-math-7b",
        "models": {"actor": {"preset": "qwen2.5-7b"}},  # Qwen2.5-Math-7B has Qwen2.5-7B's architecture
        "algorithm": {"name": "grpo", "models": ["actor"], "samples_per_prompt": 16, "mini_batches": 16},
        "workload": {"prompts_per_step": 512, "prompt_length": 256,
                     "response_length": {"mean": 3000, "max": 28672, "sigma": 1.0}},
        "cluster": {"gpu": "H20", "nodes": gpus // 8, "gpus_per_node": 8},
        "options": {"fsdp": True},
    })


def verl_colocated_plan(gpus: int) -> Plan:
    every = tuple(range(gpus))
    fsdp = {"tp": 1, "dp": gpus, "fsdp": True, "micro_batch_size": 1}
    return Plan((
        Placement(ModelStage("actor", "generation"), Layout(tp=ROLLOUT_TP, dp=gpus // ROLLOUT_TP), every),
        Placement(ModelStage("actor", "inference"), Layout(**fsdp, recompute="none"), every),
        Placement(ModelStage("actor", "training"), Layout(**fsdp, recompute="full"), every),
    ), gpus)


def predicted(row_id: str) -> dict[str, float]:
    gpus = int(published()[row_id]["num_gpus"])
    job = dapo_job(gpus)
    est = estimate_plan(Hardware(job.cluster), job, verl_colocated_plan(gpus))
    assert est.feasible, est.violations
    return {column: est.stage_times[name] for column, name in STAGES.items()}


def relative_error(row_id: str, column: str) -> float:
    return predicted(row_id)[column] / float(published()[row_id][column]) - 1


# Measured with the assumptions above (the table in docs/cost-model.md). Published times do not scale
# with the GPU count as any per-stage model does: generation is 357 s on 32 GPUs but 151 s on 64 and
# 178 s on 128; old_log_prob falls only from 108 to 54 s from 32 to 128 GPUs.
MISSES = {
    ("1", "update_actor_s"): "+83%",
    ("2", "gen_s"): "+43%",
    ("2", "update_actor_s"): "+85%",
    ("3", "old_log_prob_s"): "-41%",
}


def _cases() -> list:
    out = []
    for row in ROWS:
        for column in STAGES:
            miss = MISSES.get((row, column))
            marks = [pytest.mark.xfail(strict=True, reason=f"measured {miss}")] if miss else []
            out.append(pytest.param(row, column, marks=marks, id=f"row{row}-{column}"))
    return out


@pytest.mark.parametrize(("row_id", "column"), _cases())
def test_stage_time_within_a_quarter_of_the_published_one(row_id: str, column: str) -> None:
    assert abs(relative_error(row_id, column)) <= 0.25


def test_the_rows_are_the_documented_runs() -> None:
    rows = published()
    for row_id, gpus in zip(ROWS, ("32", "64", "128"), strict=True):
        row = rows[row_id]
        assert row["gpu"].startswith("H20") and row["num_gpus"] == gpus and row["model"] == "Qwen2.5-Math-7B"
        assert (row["prompts_per_step"], row["responses_per_prompt"]) == ("512", "16")
