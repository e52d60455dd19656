"""The runtime on Ray actors: a checkpoint loads under two coexisting layouts; log-probs, a training step
and generation match the single-process reference; shards have the contract's shapes."""

from __future__ import annotations

import pytest
import torch

from nereus.runtime.engines.native.fixed_batch import SamplingParams, reference_generate
from nereus.runtime.model.decoder import build_model
from nereus.runtime.model.hf import save_checkpoint
from nereus.spec.layout import Layout
from nereus.spec.sharding import rank_tensors
from tests.runtime.common import MQA, batch, reference

pytestmark = pytest.mark.distributed


def test_two_layouts_on_ray_workers(ray_runtime, tmp_path):
    rt = ray_runtime
    model = build_model(MQA, seed=1)
    save_checkpoint(tmp_path, MQA, model.state_dict())
    a = Layout(tp=2, pp=2, dp=1, recompute="none", sequence_parallel=False)
    b = Layout(tp=1, pp=1, dp=2, recompute="none", sequence_parallel=False)
    rt.load("a", MQA, a, checkpoint=tmp_path)
    rt.load("b", MQA, b, ranks=[3, 1], checkpoint=tmp_path)  # coexists with "a" on the same workers
    ref = reference(MQA)
    data = batch(MQA)
    for key in ("a", "b"):
        torch.testing.assert_close(rt.logprobs(key, data.tokens), ref["fwd"]["logprobs"], rtol=1e-4, atol=2e-5)
    for rank, shapes in enumerate(rt.shard_shapes("a")):
        boxes = rank_tensors(MQA.arch, a.dims, rank)
        assert shapes == {n: tuple(hi - lo for lo, hi in box) for n, box in boxes.items()}

    def loss(out, mb):  # defined here so Ray ships it by value
        return -(out * mb.advantages[:, 1:]).mean() + 0.1 * (out**2).mean()

    stats = rt.train_step("a", data, loss, lr=1e-2)
    assert len(stats.losses) == len(data.tokens)  # one per micro-batch of one sequence
    assert len(stats.replicas) == a.dp and stats.grad_norm is None and stats.metrics == []
    reports = rt.memory("a")
    assert all(r.op == "train" and r.optimizer > 0 and r.activations > 0 for r in reports)
    params = SamplingParams(max_new_tokens=4)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
    want = [reference_generate(model, p, params) for p in prompts]
    assert rt.generate("b", prompts, params) == want
    rt.release("a")
    rt.release("b")
