"""The transition-graph executor on a forked gloo world of 4 ranks: one model-stage's weights move from an
old layout to a new one as ``nereus.elastic.build_graph`` plans it (TP, PP and DP changes, a GPU-set
move, grow and shrink). Every weight tensor, gathered from the shards of all ranks, is bit-identical
before and after, and a forward pass under the new layout equals the single-process reference."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist

from nereus.elastic.graph import TransitionGraph, build_graph
from nereus.runtime.engine import ShardedModel, shard_boxes
from nereus.runtime.executor import TransitionExecutionError, execute_weights, transition_model
from nereus.runtime.groups import ParallelGroups
from nereus.runtime.hf import slice_boxes
from nereus.runtime.launch import run_world
from nereus.runtime.model import build_model
from nereus.spec import Layout, ModelStage, Placement, Plan, job_from_dict
from tests.runtime.common import MQA, batch, reference

pytestmark = pytest.mark.distributed
WORLD = 4
STAGE = "reference/inference"
TOL = dict(rtol=1e-4, atol=2e-5)


def _lay(tp: int = 1, pp: int = 1, dp: int = 1) -> Layout:
    return Layout(tp=tp, pp=pp, dp=dp, micro_batch_size=1, recompute="none", sequence_parallel=False)


# (old layout, old GPUs, new layout, new GPUs)
PAIRS = [
    (_lay(tp=2), [0, 1], _lay(tp=4), [0, 1, 2, 3]),  # TP change, grow
    (_lay(tp=2, dp=2), [0, 1, 2, 3], _lay(tp=3), [1, 2, 3]),  # TP and DP change, shrink
    (_lay(tp=2, pp=2), [0, 1, 2, 3], _lay(pp=4), [0, 1, 2, 3]),  # PP and TP change
    (_lay(pp=3), [0, 1, 2], _lay(pp=2, dp=2), [3, 2, 1, 0]),  # PP and DP change, ranks reordered
    (_lay(tp=2), [0, 1], _lay(tp=2, dp=2), [0, 1, 2, 3]),  # DP change
    (_lay(tp=2), [0, 1], _lay(tp=2), [2, 3]),  # GPU-set move, same layout
    (_lay(tp=4), [0, 1, 2, 3], _lay(tp=1), [2]),  # everything onto one GPU
]


def tiny_job():
    arch = {k: v for k, v in asdict(MQA.arch).items()}
    return job_from_dict({
        "name": "executor", "models": {m: dict(arch) for m in ("actor", "critic", "reference", "reward")},
        "algorithm": {"name": "ppo"},
        "workload": {"prompts_per_step": 8, "prompt_length": 8, "response_length": {"mean": 8, "max": 16}},
        "cluster": {"gpu": "H100", "nodes": 1, "gpus_per_node": WORLD},
    })


def plan(layout: Layout, gpus: list[int]) -> Plan:
    return Plan((Placement(ModelStage.parse(STAGE), layout, tuple(gpus)),), WORLD)


def graphs() -> list[TransitionGraph]:
    job = tiny_job()
    return [build_graph(job, plan(a, ga), plan(b, gb)) for a, ga, b, gb in PAIRS]


def gather(sm: ShardedModel | None) -> dict[str, torch.Tensor]:
    """Whole tensors assembled on every rank from every rank's shards (every element written)."""
    mine = [] if sm is None else [(n, shard_boxes(sm.cfg, sm.groups)[n], t.detach().clone())
                                  for n, t in sm.shards().items()]
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    state = reference(MQA)["state"]
    full = {n: torch.full_like(t, float("nan")) for n, t in state.items()}
    for rank_parts in parts:
        for name, box, t in rank_parts:
            full[name][tuple(slice(lo, hi) for lo, hi in box)] = t
    return full


def _body(rank: int, world: int, gs: list[TransitionGraph]) -> None:
    ref = reference(MQA)
    weights = ref["stepped"]  # not the initial weights: a model some training has moved
    tokens = batch(MQA)["tokens"]
    single = build_model(MQA)
    single.load_state_dict(weights)
    with torch.no_grad():
        want_logits = single(tokens)
    for (old_lay, old_gpus, new_lay, new_gpus), graph in zip(PAIRS, gs, strict=True):
        where = f"{old_lay.short()} on {old_gpus} -> {new_lay.short()} on {new_gpus}, rank {rank}"
        old_groups = ParallelGroups(old_lay, old_gpus)
        new_groups = ParallelGroups(new_lay, new_gpus)
        old = None
        if old_groups.member:
            old = ShardedModel(MQA, old_groups, slice_boxes(weights, shard_boxes(MQA, old_groups)))
        before = gather(old)
        new = transition_model(MQA, graph, "reference", old, new_groups)
        assert (new is not None) == new_groups.member, where
        after = gather(new)
        assert set(before) == set(after) == set(weights)
        for name, t in after.items():
            assert torch.equal(t, before[name]), f"{where}: {name} changed"
            assert torch.equal(t, weights[name]), f"{where}: {name} differs from the reference"
        if new is not None:
            logits = new.logits(tokens)
            if logits is not None:
                rows = new.replica_rows(len(tokens))
                torch.testing.assert_close(logits, want_logits[rows], **TOL, msg=lambda m, w=where: f"{w}: {m}")
        dist.barrier()
        old_groups.destroy()
        new_groups.destroy()


def test_weights_move_bit_identically_between_layouts():
    run_world(_body, WORLD, graphs(), timeout_s=60.0, backend="gloo")


def _missing_piece_body(rank: int, world: int, graph: TransitionGraph) -> None:
    old_groups = ParallelGroups(_lay(tp=2), [0, 1])
    new_groups = ParallelGroups(_lay(tp=2), [2, 3])
    state = reference(MQA)["state"]
    old = ShardedModel(MQA, old_groups, slice_boxes(state, shard_boxes(MQA, old_groups))) if rank < 2 else None
    new_boxes = shard_boxes(MQA, new_groups) if new_groups.member else None
    graph.ops = [op for op in graph.ops if not (op.kind == "send" and op.peer == 3)]  # drop GPU 3's transfer
    args = (graph, "reference", old.shards() if old else None,
            shard_boxes(MQA, old_groups) if old else None, new_boxes)
    if rank == 3:
        with pytest.raises(TransitionExecutionError, match="wrote 0 of"):
            execute_weights(*args)
    else:
        execute_weights(*args)
    dist.barrier()


def test_a_buffer_the_graph_leaves_unfilled_is_an_error():
    graph = build_graph(tiny_job(), plan(_lay(tp=2), [0, 1]), plan(_lay(tp=2), [2, 3]))
    run_world(_missing_piece_body, WORLD, graph, timeout_s=60.0, backend="gloo")
