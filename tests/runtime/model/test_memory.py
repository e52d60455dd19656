"""Reported per-device memory against the cost model's prediction for the same layout (within 20%, per
kind and in total, on the fullest device): a training step and generation with a KV cache."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nereus.runtime.cluster.launch import run_world
from nereus.runtime.comm.groups import ParallelGroups
from nereus.runtime.engines.native.fixed_batch import SamplingParams, generate
from nereus.runtime.model.decoder import build_model
from nereus.runtime.model.hf import slice_boxes
from nereus.runtime.model.memory import ActivationMeter, predict_generation, predict_training
from nereus.runtime.parallel.batch import TrainBatch
from nereus.runtime.parallel.sharded import ShardedModel, shard_boxes
from nereus.spec.layout import Layout
from tests.runtime.common import MQA, policy_loss

pytestmark = [pytest.mark.distributed, pytest.mark.rayless]  # no Ray: may run beside the Ray tests
B, SEQ, PROMPT, NEW = 8, 64, 24, 8
# Layer counts divide evenly: the cost model's KV cache per device assumes layers/pp per stage.
LAYOUTS = [Layout(tp=t, pp=p, dp=d, micro_batch_size=2, recompute="none", sequence_parallel=False, zero1=z)
           for t, p, d, z in [(1, 1, 1, True), (2, 1, 1, True), (4, 1, 1, True), (1, 2, 1, True), (1, 4, 1, True),
                              (1, 1, 4, True), (1, 1, 2, False), (2, 2, 1, True), (2, 1, 2, True), (1, 2, 2, True)]]
# ZeRO-3: weights, gradients and Adam state 1/dp each (training only: generation layouts are never sharded so)
LAYOUTS.append(Layout(dp=4, micro_batch_size=2, recompute="none", sequence_parallel=False, zero1=False, fsdp=True))


def _fullest(report: dict | None, group_world: int) -> list[dict]:
    out = [None] * group_world
    dist.all_gather_object(out, report)
    return [r for r in out if r]


def _check(ratios: dict[str, float], where: str) -> None:
    print(where, " ".join(f"{k}={v:.3f}" for k, v in ratios.items()), flush=True)  # pytest -s shows it
    for kind, ratio in ratios.items():
        assert 0.8 <= ratio <= 1.2, f"{where}: {kind} measured/predicted = {ratio:.3f}"


def _body(rank: int, world: int) -> None:
    state = build_model(MQA, seed=1).state_dict()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MQA.arch.vocab, (B, SEQ), generator=g)
    adv = torch.randn(B, SEQ, generator=g)
    batch = TrainBatch(tokens, advantages=adv, returns=torch.randn(B, SEQ, generator=g))
    prompts = torch.randint(0, MQA.arch.vocab, (B, PROMPT), generator=g).tolist()
    for lay in LAYOUTS:
        groups = ParallelGroups(lay)
        sm = ShardedModel(MQA, groups, slice_boxes(state, shard_boxes(MQA, groups))) if groups.member else None
        if sm:
            sm.train_step(batch, policy_loss)
        train = _fullest(sm.last_report.to_dict() if sm else None, world)
        if sm and not lay.fsdp:
            generate(sm, prompts, SamplingParams(max_new_tokens=NEW))
        gen = _fullest(sm.last_report.to_dict() if sm else None, world)
        if rank == 0:
            pred = predict_training(MQA.arch, lay, B, SEQ)
            top = max(train, key=lambda r: r["total"])
            ratios = {k: max(r[k] for r in train) / v for k, v in pred.items()}
            ratios["total"] = top["total"] / sum(pred.values())
            _check(ratios, f"train {lay.short()} z{int(lay.zero1)}")
            if not lay.fsdp:
                pg = predict_generation(MQA.arch, lay, B, PROMPT, NEW)
                _check({k: max(r[k] for r in gen) / v for k, v in pg.items()}, f"generate {lay.short()}")
        dist.barrier()
        groups.destroy()


def test_memory_within_20_percent_of_cost_model():
    run_world(_body, 4, timeout_s=30)


def test_activation_meter_counts_saved_tensors_until_backward():
    meter = ActivationMeter()
    w = torch.nn.Parameter(torch.randn(16, 16))
    with meter.track(exclude=[w]):
        x = torch.randn(4, 16, requires_grad=True)
        h = torch.tanh(x @ w)  # saves x (256 B) and tanh's output (256 B); w is excluded
        y = (h * h).sum()  # saves h again: same storage, counted once
    assert meter.peak == 2 * 4 * 16 * 4
    y.backward()
    assert meter._current == 0
