"""Live transitions of an MoE actor between expert-parallel layouts and back, following the transition graph:
after each move every weight and every optimizer component (master, both moments), gathered from all ranks, is
bit-identical to the global state before the first (experts move only to the ranks of their EP rank)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch.distributed as dist

from nereus.runtime.cluster.launch import run_world
from nereus.runtime.comm.transfer import TransferComm
from nereus.runtime.model.decoder import ModelConfig
from nereus.runtime.transitions.live import KeySpec, transition_keys
from nereus.spec.model import ModelArch
from nereus.spec.moe import MoESpec
from tests.runtime.live_common import (
    WORLD,
    assert_same_state,
    global_state,
    graph_between,
    groups_for,
    initial_state,
    lay,
    load,
    train_step,
)

pytestmark = [pytest.mark.distributed, pytest.mark.rayless]

# 4 experts, 2 per token, layer 1 dense (its MLP is not an expert), tied embeddings
MOE = ModelConfig(ModelArch(layers=3, hidden=32, ffn_hidden=48, heads=4, kv_heads=2, vocab=50, tied_embeddings=True,
                            moe=MoESpec(4, 2, 24, True, dense_layers=(1,))), rope_theta=1e4, eos_token_id=3)
NODES = [
    (replace(lay(dp=2), ep=2), [0, 1]),
    (lay(dp=2), [1, 0]),  # the acceptance pair: ep=2,dp=2 <-> ep=1,dp=2
    (lay(tp=2), [2, 3]),
    (replace(lay(dp=4), ep=2), [0, 1, 2, 3]),
    (replace(lay(tp=2, dp=2), ep=2, zero1=False), [3, 2, 1, 0]),
    (replace(lay(dp=4), ep=4), [3, 1, 0, 2]),
]


def _spec(i: int) -> KeySpec:
    layout, gpus = NODES[i]
    return KeySpec("actor/training", "actor", "training", MOE, layout, tuple(gpus))


def _body(rank: int, world: int, walk: list[int], graphs: list) -> None:
    comm = TransferComm(timeout_s=30)
    specs = [_spec(i) for i in range(len(NODES))]
    groups = [groups_for(s) for s in specs]
    sm = load(specs[walk[0]], groups[walk[0]], initial_state("actor", MOE))
    train_step(sm, MOE, seed=0)  # Adam state that is not zero
    want = global_state("actor", sm, MOE)
    for (a, b), graph in zip(itertools.pairwise(walk), graphs, strict=True):
        held = {specs[a].key: sm} if sm is not None else {}
        models, _ = transition_keys(graph, held, [specs[a]], [specs[b]], {specs[b].key: groups[b]}, comm)
        sm = models.get(specs[b].key)
        assert (sm is not None) == groups[b].member
        if sm is not None:  # a rank holds its EP rank's experts only: 2 sparse layers x 3 tensors each
            experts = {n for n in sm.shards() if ".mlp.experts." in n}
            assert len(experts) == 2 * 3 * 4 // specs[b].layout.ep, (specs[b].layout.short(), sorted(experts))
        where = f"{specs[a].layout.short()} -> {specs[b].layout.short()}"
        assert_same_state(global_state("actor", sm, MOE), want, where)
    dist.barrier()


def test_moe_actor_moves_between_ep_layouts_bit_identically():
    walk = [0, 1, 0, 2, 3, 4, 5, 0]
    graphs = [graph_between([_spec(a)], [_spec(b)], cfgs={"actor": MOE}) for a, b in itertools.pairwise(walk)]
    run_world(_body, WORLD, walk, graphs, timeout_s=120.0, backend="gloo")
