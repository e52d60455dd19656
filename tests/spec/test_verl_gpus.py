"""verl's ``trainer.nnodes`` x ``trainer.n_gpus_per_node`` are the devices the job runs on (``run.workers``, the
planner's cluster beside it), or refused with the reason: never silently ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereus.cli import main
from nereus.spec.errors import SpecError
from nereus.spec.job import load_job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GRPO, PPO = EXAMPLES / "grpo_tiny.yaml", EXAMPLES / "ppo_tiny.yaml"


@pytest.mark.parametrize(("overrides", "workers", "nodes", "per_node"), [
    (["trainer.n_gpus_per_node=8", "trainer.nnodes=1"], 8, 1, 8),
    (["trainer.n_gpus_per_node=2"], 2, 1, 2),  # the job file's cluster: 1 node
    (["+trainer.nnodes=2"], 8, 2, 4),  # ... 4 GPUs a node
])
def test_verl_gpus_are_the_runs_workers(overrides, workers, nodes, per_node):
    job = load_job(GRPO, ["~run.layouts", *overrides])  # the planner places every stage on them
    assert (job.run.workers, job.cluster.nodes, job.cluster.gpus_per_node) == (workers, nodes, per_node)


def test_the_parallel_degrees_fill_verl_gpus_whatever_the_order():
    for overrides in (["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=8"],
                      ["trainer.n_gpus_per_node=8", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]):
        gen = load_job(GRPO, overrides).run.layouts["actor/generation"]
        assert (gen.tp, gen.dp) == (2, 4)


@pytest.mark.parametrize(("path", "override", "why"), [
    (PPO, "trainer.n_gpus_per_node=8", "the job's workers follow run.adapt.availability, not verl's 8 GPUs"),
    (GRPO, "trainer.n_gpus_per_node=128", "128 is out of range"),  # more workers than a run takes
    (GRPO, "trainer.nnodes=0", "expected a positive integer"),
    (GRPO, "trainer.n_gpus_per_node=2", "ranks must be below trainer.n_gpus_per_node (2)"),  # the file's layouts
])
def test_verl_gpus_that_cannot_be_honoured_are_refused_by_name(path, override, why):
    with pytest.raises(SpecError) as err:
        load_job(path, [override])
    assert why in err.value.message and override.partition("=")[0] in str(err.value)


def test_workers_flag_and_verl_gpus_must_agree(capsys):
    assert main(["run", str(GRPO), "~run.layouts", "trainer.n_gpus_per_node=2", "--workers", "3"]) == 2
    assert capsys.readouterr().err.strip() == (
        "nereus: error: --workers: 3 differs from the 2 GPUs of trainer.n_gpus_per_node: give one of the two")
