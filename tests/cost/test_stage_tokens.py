"""One truth for cost and runtime (``cost.stage_tokens``): for the same batch and the same layout fields, the
cost model's micro-batches (count, tokens, rows) on the fullest replica are the ones the runtime's own
planning (``ShardedModel.packed_micro_batches`` / ``micro_batches``) forms, packed and padded, and the parts
it prices as recomputed are the ones the runtime checkpoints. Either side changing alone fails here."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from nereus.cost.hardware import Hardware
from nereus.cost.stage_tokens import micro_batches, padded_width, row_lengths
from nereus.cost.stages import training_cost
from nereus.runtime.model.decoder import CausalLM
from nereus.runtime.parallel.batch import TrainBatch
from nereus.runtime.parallel.recompute import Recompute, apply_recompute
from nereus.runtime.parallel.sharded import ShardedModel
from nereus.spec import job_from_dict
from nereus.spec.layout import Layout, ModelStage
from tests.runtime.common import GQA

ARCH = {"layers": 4, "hidden": 256, "ffn_hidden": 512, "heads": 4, "kv_heads": 2, "vocab": 1000}


def _job(padded: bool = False):
    job = job_from_dict({
        "name": "one-truth", "models": {"actor": ARCH, "reference": ARCH},
        "algorithm": {"name": "grpo", "samples_per_prompt": 8, "mini_batches": 2},
        # a long tail: mean response 300 tokens, log-normal sigma 1 (the DAPO trace's), cap 8,192
        "workload": {"prompts_per_step": 16, "prompt_length": 64,
                     "response_length": {"mean": 300, "max": 8192, "sigma": 1.0}},
        "cluster": {"gpu": "H100", "nodes": 1, "gpus_per_node": 8},
        "options": {"recompute": "none", "sequence_parallel": False, "micro_batch_size": 2}})
    return replace(job, options=replace(job.options, padded_batches=padded))


def _runtime(layout: Layout, lengths: list[int], width: int) -> list[list[int]]:
    """Per DP replica, the tokens of each micro-batch the runtime runs for a batch of these rows."""
    batch = TrainBatch(torch.zeros(len(lengths), width, dtype=torch.long), lengths=torch.tensor(lengths))
    out = []
    for d in range(layout.dp):
        rank = SimpleNamespace(groups=SimpleNamespace(dims=layout.dims, coords=SimpleNamespace(dp_rank=d),
                                                      layout=layout, device="cpu"),
                               token_budget=layout.max_token_len)
        rank.replica_rows = lambda n, r=rank: ShardedModel.replica_rows(r, n)
        if layout.max_token_len:
            out.append([p.tokens for _, p in ShardedModel.packed_micro_batches(rank, batch)])
        else:
            out.append([mb.tokens.numel() for mb in ShardedModel.micro_batches(rank, batch)])
    return out


@pytest.mark.parametrize("layout", [Layout(max_token_len=4096), Layout(dp=2, max_token_len=2048),
                                    Layout(tp=2, pp=2, dp=2, max_token_len=9000), Layout(dp=4, max_token_len=700)])
def test_packed_micro_batches_are_the_runtimes(layout):
    job = _job()
    rows = job.sequences_per_step() // job.algorithm.mini_batches
    lengths = row_lengths(job, rows)
    fullest = max(_runtime(layout, lengths, max(lengths)), key=sum)
    priced = micro_batches(job, layout, rows)
    assert priced.mode == "packed" and priced.count == len(fullest)
    assert priced.tokens == pytest.approx(sum(fullest) / len(fullest))
    cost = training_cost(Hardware(job.cluster), job, ModelStage("actor", "training"), layout)
    assert cost.detail["micro_batches"] == len(fullest)
    assert cost.detail["micro_batch_tokens"] == pytest.approx(sum(fullest) / len(fullest))


@pytest.mark.parametrize("layout", [Layout(micro_batch_size=2), Layout(dp=2, micro_batch_size=4),
                                    Layout(tp=2, dp=4, micro_batch_size=1)])
def test_padded_micro_batches_are_the_runtimes(layout):
    """A layout without a token budget on the padding runtime: every row as wide as the step's longest."""
    job = _job(padded=True)
    rows = job.sequences_per_step() // job.algorithm.mini_batches
    width = padded_width(job)
    assert width > 4 * (job.workload.prompt_length + job.workload.response.mean)  # the long tail's price
    fullest = max(_runtime(layout, row_lengths(job, rows), width), key=sum)
    priced = micro_batches(job, layout, rows)
    assert priced.mode == "padded" and priced.count == len(fullest)
    assert priced.tokens == pytest.approx(sum(fullest) / len(fullest))
    assert micro_batches(_job(), layout, rows).mode == "rows"  # verl's use_remove_padding, fixed rows


def test_packed_costs_less_than_padded_on_a_long_tail():
    hw, ms = Hardware(_job().cluster), ModelStage("actor", "training")
    padded = training_cost(hw, _job(padded=True), ms, Layout(dp=2, micro_batch_size=4)).time()
    packed = training_cost(hw, _job(padded=True), ms, Layout(dp=2, max_token_len=4096)).time()
    assert packed < 0.5 * padded


def test_the_parts_priced_as_recomputed_are_the_ones_the_runtime_checkpoints():
    hw, ms, job = Hardware(_job().cluster), ModelStage("actor", "training"), _job()
    compute = {r: training_cost(hw, job, ms, Layout(max_token_len=4096, recompute=r)).terms["compute"]
               for r in ("none", "selective", "full")}
    assert compute["none"] < compute["selective"] < compute["full"]  # + attention core < + whole forward
    for mode, part in (("none", None), ("selective", "core_call"), ("full", "layer_call")):
        with torch.device("meta"):
            model = apply_recompute(CausalLM(GQA), mode)
        checkpointed = {name.rsplit(".", 1)[1] for name, m in model.named_modules() if isinstance(m, Recompute)}
        assert checkpointed == ({part} if part else set()), mode
