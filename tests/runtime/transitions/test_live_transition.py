"""Live transitions on a forked gloo world of 4 ranks, following the transition graph.

- Every ordered pair of the ten layouts with TP·PP·DP ≤ 4 (TP, PP, DP ∈ {1, 2, 4}, each on its own GPU
  set, some with ranks reordered), for the actor (with Adam state), critic (with Adam state), reference
  and reward: one Eulerian circuit through all 90 transitions per model, and after each one every weight
  and every optimizer component (master, both moments), gathered from all ranks, is bit-identical to the
  global state before the first transition.
- Several models and stages at once, with stages of one model sharing buffers on a device.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from nereus.runtime.cluster.launch import run_world
from nereus.runtime.comm.transfer import TransferComm
from nereus.runtime.recovery.snapshots import restore_state, state_image
from nereus.runtime.transitions import executor
from nereus.runtime.transitions.live import KeySpec, transition_keys
from nereus.spec.layout import Layout
from tests.runtime.live_common import (
    WORLD,
    assert_same_state,
    global_state,
    graph_between,
    groups_for,
    initial_state,
    lay,
    load,
    spec,
    train_step,
)

pytestmark = [pytest.mark.distributed, pytest.mark.rayless]  # no Ray: may run beside the Ray tests

# (layout, GPUs): the ten layouts with TP·PP·DP ≤ 4, placed on different GPU sets and orders
NODES = [
    (lay(), [2]),
    (lay(tp=2), [0, 1]),
    (lay(pp=2), [3, 2]),
    (lay(dp=2), [1, 2]),
    (lay(tp=4), [0, 1, 2, 3]),
    (lay(pp=4), [3, 1, 2, 0]),
    (lay(dp=4), [0, 1, 2, 3]),
    (lay(tp=2, pp=2), [3, 2, 1, 0]),
    (lay(tp=2, dp=2), [0, 2, 1, 3]),
    (lay(pp=2, dp=2), [0, 1, 2, 3]),
]


def euler_circuit(n: int) -> list[int]:
    """A closed walk through every ordered pair (i, j), i ≠ j, of n nodes exactly once (Hierholzer)."""
    left = {i: [j for j in range(n) if j != i] for i in range(n)}
    stack, walk = [0], []
    while stack:
        v = stack[-1]
        if left[v]:
            stack.append(left[v].pop())
        else:
            walk.append(stack.pop())
    return walk[::-1]


def _circuit_body(rank: int, world: int, model: str, walk: list[int], graphs: list, nodes: list = NODES) -> None:
    _walk(TransferComm(timeout_s=30), model, walk, graphs, nodes)
    dist.barrier()


def _walk(comm: TransferComm, model: str, walk: list[int], graphs: list, nodes: list):
    """Along ``walk`` through ``nodes``, every transition checked; this rank's last shard and the state."""
    specs = [spec(model, layout, gpus) for layout, gpus in nodes]
    groups = [groups_for(s) for s in specs]  # every layout's groups, created ahead by every rank
    first = walk[0]
    sm = load(specs[first], groups[first], initial_state(model))
    if specs[first].training:
        train_step(sm, specs[first].cfg, seed=0)  # Adam state that is not zero
    want = global_state(model, sm)
    assert any(state == "optimizer" for state, _, _ in want) == specs[first].training
    for (a, b), graph in zip(itertools.pairwise(walk), graphs, strict=True):
        held = {specs[a].key: sm} if sm is not None else {}
        models, _ = transition_keys(graph, held, [specs[a]], [specs[b]], {specs[b].key: groups[b]}, comm)
        sm = models.get(specs[b].key)
        assert (sm is not None) == groups[b].member
        where = f"{model}: {nodes[a][0].short()} on {nodes[a][1]} -> {nodes[b][0].short()} on {nodes[b][1]}"
        assert_same_state(global_state(model, sm), want, where)
    return sm, want


def strided_cycles(n: int, strides: tuple[int, ...]) -> list[int]:
    """Closed walks 0 -> s -> 2s -> ... -> 0 for each stride s coprime to n, one after another: every
    node left and entered once per stride, by pairs of different kinds (neighbours, then far apart)."""
    walk = [0]
    for s in strides:
        assert math.gcd(s, n) == 1
        walk += [(k * s) % n for k in range(1, n + 1)]
    return walk


def _walk_through_layouts(model: str, walk: list[int]) -> None:
    specs = [spec(model, layout, gpus) for layout, gpus in NODES]
    graphs = [graph_between([specs[a]], [specs[b]]) for a, b in itertools.pairwise(walk)]
    run_world(_circuit_body, WORLD, model, walk, graphs, timeout_s=120.0, backend="gloo")


def test_every_layout_pair_moves_every_tensor_bit_identically():
    """The actor (weights, LM head and Adam moments): all 90 ordered pairs of the ten layouts."""
    walk = euler_circuit(len(NODES))
    assert len(walk) == len(NODES) * (len(NODES) - 1) + 1
    _walk_through_layouts("actor", walk)


@pytest.mark.parametrize("model", ["critic", "reference", "reward"])
def test_every_layout_moves_in_and_out_bit_identically(model):
    """The other models differ from the actor only in their tensors (a value or score head; reference and
    reward without Adam state), not in how a graph moves a box: each leaves and enters every layout twice,
    from a neighbour and from far away (strides 1 and 3 through the ten), 20 moves instead of 90."""
    _walk_through_layouts(model, strided_cycles(len(NODES), (1, 3)))


def zero3(layout: Layout) -> Layout:
    return replace(layout, fsdp=True, zero1=False)


# ZeRO-3 (weights and Adam state in each DP rank's flat range) to and from TP, PP, DP and ZeRO-1 layouts
ZERO3_NODES = [(zero3(lay(dp=2)), [0, 1]), (lay(tp=2), [2, 3]), (zero3(lay(dp=4)), [3, 1, 2, 0]),
               (zero3(lay(tp=2, dp=2)), [0, 2, 1, 3]), (zero3(lay(pp=2, dp=2)), [0, 1, 2, 3]), (lay(dp=2), [1, 3])]


def _zero3_body(rank: int, world: int, walk: list[int], graphs: list) -> None:
    """The walk, then the last layout's snapshot (every ZeRO-3 range kept, other replicas' copies not)
    restored into TP 2: the same state again."""
    comm = TransferComm(timeout_s=30)
    sm, want = _walk(comm, "actor", walk, graphs, ZERO3_NODES)
    last = spec("actor", *ZERO3_NODES[walk[-1]])
    image = state_image({last.key: sm} if sm is not None else {}, {last.key: "actor"}, {"actor"}, weights_dp0_only=True)
    images: list = [None] * world
    dist.all_gather_object(images, image)
    target = spec("actor", lay(tp=2), [2, 0])
    groups = {target.key: groups_for(target)}
    restored = restore_state([target], groups, {"actor": images}, comm).get(target.key)
    assert_same_state(global_state("actor", restored), want, "snapshot of ZeRO-3 restored into tp=2")
    # and the moved ZeRO-3 shards train on as the TP ones do (one step each from the same state)
    losses = [train_step(m, last.cfg, seed=5) for m in (sm, restored)]
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=1e-5, atol=1e-6)
    stepped = [global_state("actor", m) for m in (sm, restored)]
    for key, t in stepped[1].items():
        torch.testing.assert_close(stepped[0][key], t, rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    dist.barrier()


def test_zero3_moves_to_and_from_tp_bit_identically():
    """The actor (tied embedding, Adam moments) between ZeRO-3 layouts and TP/ZeRO-1 ones, both ways, every
    weight and optimizer component bit-identical after each move; then through a snapshot."""
    walk = [0, 1, 0, 2, 3, 4, 1, 5, 4, 0]
    specs = [spec("actor", layout, gpus) for layout, gpus in ZERO3_NODES]
    graphs = [graph_between([specs[a]], [specs[b]]) for a, b in itertools.pairwise(walk)]
    run_world(_zero3_body, WORLD, walk, graphs, timeout_s=120.0, backend="gloo")


# Four models, the actor in two stages: training (with Adam) and generation, sharing buffers where the
# layouts coincide on a device. Old and new plans change every model's layout or GPUs at once.
OLD = [spec("actor", lay(tp=2, dp=2), [0, 1, 2, 3]),
       spec("actor", lay(tp=2), [0, 1], stage="generation"),
       spec("critic", lay(pp=2, dp=2), [3, 2, 1, 0]),
       spec("reference", lay(dp=2), [2, 3]),
       spec("reward", lay(tp=2), [1, 2])]
NEW = [spec("actor", lay(tp=4), [0, 1, 2, 3]),
       spec("actor", lay(tp=4), [0, 1, 2, 3], stage="generation"),
       spec("critic", lay(tp=2, pp=2), [0, 1, 2, 3]),
       spec("reference", lay(tp=2), [0, 1]),
       spec("reward", lay(pp=2), [3, 0])]


def _states(models: dict, specs: list[KeySpec]) -> dict[str, dict]:
    return {s.key: global_state(s.model, models.get(s.key)) for s in specs}


def _many_body(rank: int, world: int, graph) -> None:
    comm = TransferComm(timeout_s=30)
    old_groups = {s.key: groups_for(s) for s in OLD}
    new_groups = {s.key: groups_for(s) for s in NEW}
    old = {}
    for s in OLD:
        sm = load(s, old_groups[s.key], initial_state(s.model))
        if sm is not None:
            old[s.key] = sm
    for s in OLD:
        if s.training:
            train_step(old.get(s.key), s.cfg, seed=1)
    # after training, the generation copy equals the training weights again (the per-step sync)
    gen = old.get("actor/generation")
    if gen is not None:
        train_shard = old["actor/training"].shards()
        for name, p in gen.shards().items():
            p.data.copy_(train_shard[name].data)
    before = _states(old, OLD)
    models, measured = transition_keys(graph, old, OLD, NEW, new_groups, comm)
    after = _states(models, NEW)
    for s in NEW:
        assert_same_state(after[s.key], before[s.key], f"{s.key}")
    # actor/training and actor/generation share one tensor per weight on every device (tp=4 both)
    if "actor/training" in models:
        t, g = models["actor/training"].shards(), models["actor/generation"].shards()
        assert all(t[n].data_ptr() == g[n].data_ptr() for n in t)
    assert measured.bytes_received + measured.bytes_copied + measured.bytes_kept > 0
    dist.barrier()


@pytest.mark.parametrize("direct_bytes", [1 << 16, 64], ids=["packed", "direct"])
def test_four_models_and_two_stages_move_in_one_graph(direct_bytes, monkeypatch):
    """``direct``: (almost) every piece travels as its own message straight between buffers, through a
    temporary where a piece is not contiguous; ``packed``: small pieces share one message."""
    monkeypatch.setattr(executor, "DIRECT_BYTES", direct_bytes)  # the forked ranks inherit it
    run_world(_many_body, WORLD, graph_between(OLD, NEW), timeout_s=120.0, backend="gloo")
