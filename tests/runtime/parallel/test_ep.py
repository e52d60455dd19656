"""Expert parallelism against the single-process reference (design invariant 6): an MoE model's shard boxes,
logits, log-probs, gradients, global gradient norm and one Adam step under layouts with ``ep`` > 1, ZeRO-1
on and off, with PP and with TP, packed into token-budget micro-batches; the shards a checkpoint keeps; and
the all-to-all dispatcher against the local one on uneven routing; router replay under these layouts."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from nereus.runtime.cluster.launch import run_world
from nereus.runtime.comm.groups import ParallelGroups
from nereus.runtime.model.decoder import build_model
from nereus.runtime.model.hf import slice_boxes
from nereus.runtime.model.moe import LocalDispatch
from nereus.runtime.model.routes import replay_record, sparse_layer_ids
from nereus.runtime.parallel.batch import TrainBatch
from nereus.runtime.parallel.ep import AllToAllDispatch, apply_ep, moe_blocks
from nereus.runtime.parallel.shard_state import assemble, read_shards
from nereus.runtime.parallel.sharded import ShardedModel, shard_boxes
from nereus.spec.layout import Layout
from nereus.spec.sharding import expert_range, rank_tensors
from tests.runtime.common import MOE, MOE_NO_AUX, reference  # MOE: its load-balancing loss trains too
from tests.runtime.parallel.packed_checks import check_packed
from tests.runtime.parallel.test_layouts import check_layout

pytestmark = [pytest.mark.distributed, pytest.mark.rayless]



def test_expert_boxes_follow_the_ep_rank():
    dims = Layout(dp=4, ep=2).dims
    for rank in range(4):
        names = rank_tensors(MOE.arch, dims, rank)
        held = {int(n.split(".")[5]) for n in names if ".mlp.experts." in n}
        assert held == set(expert_range(4, 2, dims.ep_rank(rank))), rank
        assert "model.layers.0.mlp.gate.weight" in names and "model.layers.1.mlp.up_proj.weight" in names


def _dispatch_check() -> None:
    """Uneven routing (rank 1 sends every pair to rank 0's experts): AllToAllDispatch equals LocalDispatch
    over all experts, outputs and gradients of inputs, weights and expert weights (ranks 0 and 1)."""
    group = dist.new_group([0, 1])  # created by every rank of the world
    rank = dist.get_rank()
    if rank > 1:
        return
    whole = build_model(MOE, seed=3)
    block = moe_blocks(whole)[0]
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(5 + rank, 32, generator=g, requires_grad=True)
    indices = torch.randint(0, 4, (5 + rank, 2), generator=g) if rank == 0 else torch.tensor([[0, 1]] * 6)
    weights = torch.rand(5 + rank, 2, generator=g, requires_grad=True)
    ref = LocalDispatch()(block.experts, x, weights, indices)
    ref.square().sum().backward()
    want = (x.grad.clone(), weights.grad.clone(), {k: p.grad.clone() for k, p in block.experts.named_parameters()})
    x.grad = weights.grad = None
    whole.zero_grad()
    apply_ep(whole, group, 2, rank)
    assert isinstance(block.dispatch, AllToAllDispatch) and list(block.experts) == [str(2 * rank), str(2 * rank + 1)]
    out = block.dispatch(block.experts, x, weights, indices)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    torch.testing.assert_close(x.grad, want[0])
    torch.testing.assert_close(weights.grad, want[1])
    # an expert's gradient sums what both ranks routed to it
    summed = {name: g.clone() for name, g in sorted(want[2].items())}
    for g in summed.values():
        dist.all_reduce(g, group=group)
    for name, p in block.experts.named_parameters():
        torch.testing.assert_close(p.grad, summed[name], msg=name)


def _body(rank: int, world: int) -> None:
    _dispatch_check()
    _groups_check()
    _checkpoint_check()
    base = Layout(tp=1, pp=1, dp=2, ep=2, micro_batch_size=1, recompute="none", sequence_parallel=False)
    check_layout(MOE, base)
    check_layout(MOE, replace(base, dp=4))  # two EP groups: experts reduced over their edp group
    check_layout(MOE, replace(base, dp=4, ep=4, zero1=False))
    check_layout(MOE, replace(base, pp=2))
    check_layout(MOE, replace(base, tp=2))  # TP inside each expert; the all-to-all among one TP rank's peers
    check_packed(MOE_NO_AUX, Layout(dp=4, ep=2), budgets=(12,))  # replicas pack 2, 2, 2 and 1 micro-batches: evened
    _replay_check()


def _replay_check() -> None:
    """Router replay under TP, PP, DP with EP, padded and packed: random routes (each token k distinct experts)
    replayed by the inference and training forwards give the single-process replay's log-probs of each
    replica's rows (packed: the rows ``replica_shares`` deals it)."""
    g = torch.Generator().manual_seed(3)
    arch = MOE_NO_AUX.arch
    tokens = torch.randint(0, arch.vocab, (8, 10), generator=g)
    lengths = torch.randint(4, 11, (8,), generator=g)
    layers = sparse_layer_ids(arch)
    routes = torch.stack([torch.randperm(arch.moe.experts, generator=g)[:arch.moe.top_k]
                          for _ in range(8 * 10 * len(layers))]).reshape(8, 10, len(layers), -1).short()
    model = build_model(MOE_NO_AUX, seed=1)
    state = model.state_dict()
    with torch.no_grad():
        logits = model(tokens, routing=replay_record(routes, layers))[:, :-1].float()
    want = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    base = Layout(dp=2, ep=2, micro_batch_size=2, recompute="none", sequence_parallel=False)
    for layout in (replace(base, tp=2), replace(base, pp=2), replace(base, dp=4, max_token_len=12)):
        groups = ParallelGroups(layout)
        sm = ShardedModel(MOE_NO_AUX, groups, slice_boxes(state, shard_boxes(MOE_NO_AUX, groups)))
        batch = TrainBatch(tokens, lengths=lengths if layout.max_token_len else None, routes=routes)
        got = sm.logprobs(tokens, batch.lengths, routes)
        seen: list[torch.Tensor] = []
        sm.backward(batch, lambda y, mb, seen=seen: seen.append(y.detach().clone()) or y.sum() * 0.0)
        if sm.is_output_rank:
            ran = (torch.cat([p.rows for _, p in sm.packed_micro_batches(batch)]) if layout.max_token_len
                   else torch.arange(8)[sm.replica_rows(8)])
            real = (torch.arange(9)[None] < (lengths[:, None] - 1)) if layout.max_token_len else torch.ones(8, 9) > 0
            for rows, logp in ((ran.sort().values, got), (ran, torch.cat(seen))):
                torch.testing.assert_close(logp[real[rows]], want[rows][real[rows]], atol=2e-5, rtol=0,
                                           msg=layout.short())
        groups.destroy()


def _checkpoint_check() -> None:
    """The shards a checkpoint keeps (``read_shards``: DP replica 0, each expert from its first holder) assemble
    into the whole model once, experts from both EP ranks."""
    groups = ParallelGroups(Layout(dp=4, ep=2))
    state = reference(MOE)["state"]
    sm = ShardedModel(MOE, groups, slice_boxes(state, shard_boxes(MOE, groups)))
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, read_shards(sm))
    assert [p is not None for p in parts] == [True, True, False, False]
    whole = assemble(parts)
    assert set(whole) == set(state)
    for name, t in state.items():
        assert torch.equal(whole[name], t), name
    groups.destroy()


def test_ep_dispatch_and_layouts_match_single_process_reference():
    run_world(_body, 4, timeout_s=60)


def _groups_check() -> None:
    """EP groups pair the DP ranks of one TP rank; each rank alone holds its experts at dp = ep."""
    groups = ParallelGroups(Layout(tp=2, dp=2, ep=2))
    assert dist.get_process_group_ranks(groups.ep_group) == [[0, 2], [1, 3]][dist.get_rank() % 2]
    assert dist.get_world_size(groups.edp_group) == 1
    groups.destroy()
