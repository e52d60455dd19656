"""Published MoE training step times and decode speeds (``nereus/cost/moe_published.csv``) predicted through
the public cost API, each within a stated bound. The rows set no constant of the cost model."""

from __future__ import annotations

import csv
from importlib import resources

import pytest

from nereus.cost.decode import prefill_time, step_time
from nereus.cost.hardware import Hardware
from nereus.cost.stages import generation_replica, stage_cost
from nereus.spec.job import JobSpec, job_from_dict
from nereus.spec.layout import Layout, ModelStage

# Worst relative error allowed per kind (docs/moe.md, "Cost and planning", lists each row's error). Decode
# at batch 1 is the decode model's known small-batch bias (too fast: the engine's and its MoE kernels'
# launch costs per step exceed its fixed step cost); that bound guards against it growing, it claims nothing.
BOUND = {"training": 0.15, "decode": 0.8}
STEP_STRIDE = 16  # decode steps priced every this many tokens (the context grows slowly)


def rows() -> list[dict]:
    text = resources.files("nereus.cost").joinpath("moe_published.csv").read_text()
    return list(csv.DictReader(line for line in text.splitlines() if not line.startswith("#")))


def job_of(row: dict) -> JobSpec:
    """The row as a one-update job of ``global_batch`` sequences of ``seq_len`` tokens (decode: prompts)."""
    gpus, per_node = int(row["gpus"]), int(row["gpus_per_node"])
    response = int(row["gen_tokens"] or 1)
    prompt = int(row["seq_len"]) - (0 if row["gen_tokens"] else 1)
    return job_from_dict({
        "name": row["run_id"], "models": {"actor": {"preset": row["model_preset"]}},
        "algorithm": {"name": "grpo", "samples_per_prompt": 1, "mini_batches": 1,
                      "adv_estimator": "reinforce_plus_plus"},
        "workload": {"prompts_per_step": int(row["global_batch"]), "prompt_length": prompt,
                     "response_length": {"mean": response, "max": response}},
        "cluster": {"gpu": row["gpu"], "nodes": gpus // per_node, "gpus_per_node": per_node}})


def training_step_s(row: dict) -> float:
    """Seconds of one optimizer step (pretraining is the RL job's training stage without the rollout)."""
    job, gpus = job_of(row), int(row["gpus"])
    tp, pp, fsdp = int(row["tp"]), int(row["pp"]), int(row["fsdp"] or 0) > 1
    layout = Layout(tp=tp, pp=pp, dp=gpus // (tp * pp), ep=int(row["ep"]), fsdp=fsdp, zero1=not fsdp,
                    micro_batch_size=int(row["micro_batch"]))
    cost = stage_cost(Hardware(job.cluster), job, ModelStage("actor", "training"), layout)
    assert cost is not None
    return cost.time()


def decode_tokens_per_s(row: dict) -> float:
    """(prompt + generated tokens) per second per GPU of one replica: prefill, then a step per token."""
    job = job_of(row)
    batch, prompt, gen = int(row["global_batch"]), int(row["seq_len"]), int(row["gen_tokens"])
    replica = generation_replica(Hardware(job.cluster), job.models["actor"], int(row["tp"]), 2, int(row["ep"]))
    seconds = prefill_time(replica, batch * prompt, prompt)
    seconds += STEP_STRIDE * sum(step_time(replica, batch, prompt + i).total for i in range(0, gen, STEP_STRIDE))
    return batch * (prompt + gen) / seconds / int(row["gpus"])


def error(row: dict) -> float:
    """Predicted over published, minus 1."""
    if row["kind"] == "training":
        return training_step_s(row) / float(row["step_s"]) - 1
    return decode_tokens_per_s(row) / float(row["tok_per_s_per_gpu"]) - 1


@pytest.mark.parametrize("row", rows(), ids=lambda r: r["run_id"])
def test_published_moe_figure_within_the_bound(row: dict) -> None:
    assert abs(error(row)) <= BOUND[row["kind"]]


def test_training_rows_are_consistent_with_their_throughput() -> None:
    for row in (r for r in rows() if r["kind"] == "training"):
        tokens = int(row["global_batch"]) * int(row["seq_len"])
        assert tokens / float(row["step_s"]) / int(row["gpus"]) == pytest.approx(float(row["tok_per_s_per_gpu"]),
                                                                                rel=0.01)
