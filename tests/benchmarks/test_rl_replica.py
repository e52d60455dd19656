"""benchmarks/rl_replica.py against the runtime's pieces it claims to share: the step's prompts (the
driver's ``PromptDraws.prompts``), the mini-batch split, the warm-started weights (the files the workers load),
sampling log-probs equal to a recomputed forward pass (the first mini-batch's ratio is 1), and a run whose
learning rates are 0 ends where its warm-start did (no update path besides the optimiser's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import rl_replica  # noqa: E402

from nereus.run.draws import PromptDraws  # noqa: E402
from nereus.run.setup import datasets, tokenizer_for  # noqa: E402
from nereus.runtime.model.hf import load_boxes  # noqa: E402
from nereus.spec.job import load_job  # noqa: E402
from nereus.spec.parallel_dims import ParallelDims  # noqa: E402
from nereus.spec.sharding import rank_tensors  # noqa: E402

pytestmark = pytest.mark.rayless  # processes but no Ray: may run beside the Ray tests

SMALL = ["run.data.train_size=40", "run.data.val_size=12", "run.warmstart.actor_steps=3",
         "run.warmstart.target_accuracy=0", "run.warmstart.reward_steps=3", "run.steps=2", "run.eval_every=1"]


def small_job(example: str, *extra: str):
    return load_job(rl_replica.EXAMPLES[example], [*SMALL, *extra])


def test_step_prompts_are_the_drivers_across_an_epoch_boundary(tmp_path: Path) -> None:
    job = small_job("grpo")  # 16 prompts a step from 40: step 2 takes the first epoch's last 8 and 8 of the next
    tok = tokenizer_for(job)
    train, _ = datasets(job, tok, tmp_path)
    draws = PromptDraws(train, job.workload.prompts_per_step, job.run.seed)
    for step in (0, 2, 5):
        assert [p.ids for p in rl_replica.step_prompts(job, train, step)] == [p.ids for p in draws.prompts(step)]


def test_mini_batch_rows_split_every_row_once_and_differ_by_step() -> None:
    job = small_job("ppo-fixed")
    rows = [rl_replica.mini_batch_rows(job, 128, step) for step in (0, 1)]
    for split in rows:
        assert len(split) == job.algorithm.mini_batches
        assert sorted(i for mb in split for i in mb) == list(range(128))
    assert rows[0] != rows[1]


@pytest.mark.slow
def test_warm_models_are_the_checkpoints_the_workers_load(tmp_path: Path) -> None:
    job = small_job("ppo-fixed")
    tok = tokenizer_for(job)
    train, _ = datasets(job, tok, tmp_path / "data")
    models = rl_replica.warm_models(job, tok, train, tmp_path / "init")
    assert sorted(models) == ["actor", "critic", "reference", "reward"]
    for name, model in models.items():
        cfg = model.cfg
        files = load_boxes(tmp_path / "init" / name, rank_tensors(cfg.arch, ParallelDims(), 0, cfg.value_head))
        assert all(torch.equal(files[k], v) for k, v in model.state_dict().items()), name
    actor, ref = models["actor"].state_dict(), models["reference"].state_dict()
    assert all(torch.equal(actor[k], v) for k, v in ref.items())  # the reference starts as the actor


@pytest.mark.slow
def test_sampling_logprobs_equal_a_recomputed_pass(tmp_path: Path) -> None:
    job = small_job("grpo")
    tok = tokenizer_for(job)
    train, _ = datasets(job, tok, tmp_path / "data")
    actor = rl_replica.warm_models(job, tok, train, tmp_path / "init")["actor"]
    rows = [p for p in train[:6] for _ in range(4)]
    groups = rl_replica.sample(actor, rows, 7, torch.Generator().manual_seed(0), tok)
    assert sorted(i for g in groups.values() for i in g["idx"]) == list(range(len(rows)))
    for plen, g in groups.items():
        with torch.no_grad():
            again = rl_replica.response_logp(actor, g["seq"], plen)
        m = g["mask"].bool()
        assert m[:, 0].all()
        assert torch.allclose(again[m], g["logp"][m], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("example", ["grpo", "ppo-fixed"])
def test_a_run_at_zero_learning_rate_ends_at_its_warm_start(example: str) -> None:
    res = rl_replica.run_seed(small_job(example, "run.actor_lr=0", "run.critic_lr=0", "run.lr_warmup_steps=0"))
    assert res["curve"] == [res["warm"], res["warm"]]
    assert set(res["lengths"]) <= set(range(1, 7))
