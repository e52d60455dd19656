"""Published MoE training step times (``nereus/cost/moe_published.csv``) predicted through the public cost
API: each row's preset trained under the row's layout (``cost.stages.stage_cost``), within a stated bound.
The rows are not used to set any constant of the cost model."""

from __future__ import annotations

import csv
from importlib import resources

import pytest

from nereus.cost.hardware import Hardware
from nereus.cost.stages import stage_cost
from nereus.spec.job import job_from_dict
from nereus.spec.layout import Layout, ModelStage

# Worst relative error allowed on a row's step seconds (docs/moe.md, "Cost and planning", lists each error).
BOUND = 0.15


def rows() -> list[dict]:
    text = resources.files("nereus.cost").joinpath("moe_published.csv").read_text()
    return list(csv.DictReader(line for line in text.splitlines() if not line.startswith("#")))


def predicted_step_s(row: dict) -> float:
    """Seconds of one optimizer step of ``global_batch`` sequences of ``seq_len`` tokens (a pretraining step
    is the RL job's training stage without rollout: one update, one response token per sequence)."""
    gpus, per_node = int(row["gpus"]), int(row["gpus_per_node"])
    tp, pp, ep = int(row["tp"]), int(row["pp"]), int(row["ep"])
    job = job_from_dict({
        "name": row["run_id"], "models": {"actor": {"preset": row["model_preset"]}},
        "algorithm": {"name": "grpo", "samples_per_prompt": 1, "mini_batches": 1,
                      "adv_estimator": "reinforce_plus_plus"},
        "workload": {"prompts_per_step": int(row["global_batch"]), "prompt_length": int(row["seq_len"]) - 1,
                     "response_length": {"mean": 1, "max": 1}},
        "cluster": {"gpu": row["gpu"], "nodes": gpus // per_node, "gpus_per_node": per_node}})
    fsdp = int(row["fsdp"] or 0) > 1
    layout = Layout(tp=tp, pp=pp, dp=gpus // (tp * pp), ep=ep, fsdp=fsdp, zero1=not fsdp,
                    micro_batch_size=int(row["micro_batch"]))
    cost = stage_cost(Hardware(job.cluster), job, ModelStage("actor", "training"), layout)
    assert cost is not None
    return cost.time()


@pytest.mark.parametrize("row", rows(), ids=lambda r: r["run_id"])
def test_published_moe_step_time_within_the_bound(row: dict) -> None:
    published = float(row["step_s"])
    assert predicted_step_s(row) == pytest.approx(published, rel=BOUND)


def test_rows_are_consistent_with_their_throughput() -> None:
    for row in rows():
        tokens = int(row["global_batch"]) * int(row["seq_len"])
        assert tokens / float(row["step_s"]) / int(row["gpus"]) == pytest.approx(float(row["tok_per_s_per_gpu"]),
                                                                                rel=0.01)
