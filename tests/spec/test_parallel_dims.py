"""The one owner of parallel degrees (spec.parallel_dims) against the rules it replaced: the layout check of
estimate/plan/run, the planner's TP filter, the transition plan's check, ``Layout.rank``/``coords``, the
process groups' member lists and the sharding contract's head split by tensor name. Each old rule is written
out here as it was, and the new function must accept, refuse and answer exactly as it did."""

from __future__ import annotations

import itertools
import re

import pytest

from nereus.spec.errors import SpecError
from nereus.spec.layout import Layout
from nereus.spec.model import PRESETS, ModelArch
from nereus.spec.moe import MoESpec
from nereus.spec.parallel_dims import (
    Coord,
    ParallelDims,
    check_split,
    layer_problem,
    split_problem,
    tp_splits,
)
from nereus.spec.sharding import ELEMENTS, HEADS, KV_HEADS, model_tensors, split_range, tp_box


def _archs() -> list[ModelArch]:
    out = []
    for heads, layers in itertools.product((1, 2, 3, 4, 6, 8, 12, 14, 28), (1, 2, 3, 4, 6, 8, 24)):
        for kv in (k for k in range(1, heads + 1) if heads % k == 0):
            out.append(ModelArch(layers=layers, hidden=heads * 4, ffn_hidden=24, heads=heads, kv_heads=kv, vocab=37))
    return out


ARCHS = _archs()
DEGREES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)


def old_check_runnable(arch: ModelArch, layout: Layout, where: str) -> None:
    """``spec.layout.check_runnable`` as it was."""
    layers = arch.layers
    if layout.pp > layers:
        raise SpecError(where, f"pp={layout.pp} asks for {layout.pp} pipeline stages but the model has {layers} "
                               f"layers: every stage needs at least one; give pp <= {layers}")
    if layers % layout.pp:
        fits = [d for d in range(1, min(layers, 64) + 1) if layers % d == 0]
        raise SpecError(where, f"pp={layout.pp} does not split the {layers} layers evenly; give a pp that divides "
                               f"them ({', '.join(map(str, fits))}{', ...' if layers > 64 else ''})")
    if layout.interleave > 1 and (layout.pp == 1 or layers % (layout.pp * layout.interleave)):
        raise SpecError(where, f"interleave={layout.interleave} needs pp > 1 and pp x interleave dividing the "
                               f"{layers} layers (pp={layout.pp})")
    if arch.heads % layout.tp:
        raise SpecError(where, f"tp={layout.tp} does not divide the {arch.heads} attention heads")
    if arch.kv_heads % layout.tp and layout.tp % arch.kv_heads:
        raise SpecError(where, f"tp={layout.tp} splits the {arch.kv_heads} KV heads unevenly: give a tp that "
                               f"divides {arch.kv_heads} or is a multiple of it (and divides {arch.heads})")


def _outcome(check, *args) -> str | None:
    try:
        check(*args)
    except SpecError as err:
        return str(err)
    return None


def test_the_layouts_accepted_and_the_errors_are_those_of_the_old_layout_check():
    refused = 0
    for arch in ARCHS:
        for tp, pp, v in itertools.product(DEGREES, (1, 2, 3, 4, 5, 8, 25), (1, 2, 3)):
            layout = Layout(tp=tp, pp=pp, dp=2, interleave=v)
            old = _outcome(old_check_runnable, arch, layout, "run.layouts.actor/training")
            new = _outcome(ParallelDims.of, layout, arch, "run.layouts.actor/training")
            assert new == old, (arch, layout.short())
            refused += old is not None
    assert 0 < refused < len(ARCHS) * len(DEGREES) * 21  # both sides of the rule are exercised


def test_of_returns_the_layouts_degrees():
    arch = PRESETS["llama3-8b"]
    layout = Layout(tp=4, pp=2, dp=3, micro_batch_size=2)
    assert ParallelDims.of(layout, arch) == ParallelDims(tp=4, pp=2, dp=3) == layout.dims
    assert layout.dims.world == layout.world == 24


def test_the_planners_tp_filter_is_the_old_one():
    for arch in ARCHS:
        for tp in range(1, 33):
            old = arch.heads % tp == 0 and (arch.kv_heads % tp == 0 or tp % arch.kv_heads == 0)
            assert tp_splits(arch, tp) == old, (arch.heads, arch.kv_heads, tp)
            assert (split_problem(arch, tp) is None) == old


def _old_runtime_accepts(arch: ModelArch, tp: int) -> bool:
    """``runtime.parallel.tp.check_tp`` as it was: every rank holds the KV heads its query heads read."""
    if arch.heads < tp:
        return False
    q = next(t for t in model_tensors(arch) if t.name.endswith("q_proj.weight"))
    k = next(t for t in model_tensors(arch) if t.name.endswith("k_proj.weight"))
    hd, group = arch.head_dim, arch.heads // arch.kv_heads
    for r in range(tp):
        (qlo, qhi), = tp_box(q, arch, tp, r)[:1]
        (klo, khi), = tp_box(k, arch, tp, r)[:1]
        if {h // group for h in range(qlo // hd, qhi // hd)} != set(range(klo // hd, khi // hd)):
            return False
    return True


def test_the_runtime_refuses_no_tp_that_it_ran_and_every_entry_point_accepted():
    """The runtime's own check allowed uneven whole-head splits (MQA at TP 5 of 12 heads) that no layout
    reaching it could ask for: the job, plan and planner checks refused them first. It now asks the one
    rule; everything that rule accepts, the old runtime check accepted too."""
    for arch in ARCHS:
        for tp in range(1, 17):
            if tp_splits(arch, tp):
                assert _old_runtime_accepts(arch, tp), (arch.heads, arch.kv_heads, tp)


def test_check_split_names_the_fix():
    arch = PRESETS["llama3-8b"]
    check_split(arch, 8)
    with pytest.raises(SpecError, match=r"^run\.layouts\.x: tp=3 does not divide the 32 attention heads$"):
        check_split(arch, 3, "run.layouts.x")
    with pytest.raises(SpecError, match=r"tp=16 splits the 12 KV heads unevenly"):
        check_split(ModelArch(layers=2, hidden=96, ffn_hidden=8, heads=48, kv_heads=12, vocab=9), 16)


def _power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def old_check_plan_layout(arch: ModelArch, layout: Layout, path: str) -> None:
    """The layout part of ``elastic.emu.check_plan`` as it was."""
    if arch.heads % layout.tp:
        raise SpecError(f"{path}.layout.tp", f"{layout.tp} does not divide the {arch.heads} attention heads")
    if layout.tp > arch.kv_heads and layout.tp % arch.kv_heads:
        raise SpecError(f"{path}.layout.tp", "not a multiple")
    if layout.pp * layout.interleave > arch.layers:
        raise SpecError(f"{path}.layout.pp", "exceeds")


def _new_check_plan_layout(arch: ModelArch, layout: Layout, path: str) -> None:
    problem = split_problem(arch, layout.tp) or layer_problem(arch.layers, layout.pp, layout.interleave,
                                                              runnable=False)
    if problem is not None:
        raise problem.at(f"{path}.layout")


def test_the_transition_plan_check_places_what_it_placed():
    """Uneven pipeline stages still place; TP now refuses the KV splits that never ran (a TP below the KV
    heads that does not divide them: 4 of 6, 3 of 4); with TP and KV heads powers of two (every TP the
    planner proposes, every preset's KV heads) it accepts and refuses the same, naming the same key."""
    path = "from.placements[0]"
    for arch in ARCHS:
        for tp, pp, v in itertools.product(DEGREES, (1, 2, 3, 5, 8, 25), (1, 2)):
            layout = Layout(tp=tp, pp=pp, interleave=v)
            old = _outcome(old_check_plan_layout, arch, layout, path)
            new = _outcome(_new_check_plan_layout, arch, layout, path)
            if _power_of_two(arch.kv_heads) and _power_of_two(tp):
                assert (old is None) == (new is None), (arch, layout.short())
                if old is not None:
                    assert new.split(":")[0] == old.split(":")[0]  # the same key is named
            else:  # refused before, refused now; a few more refused now
                assert old is None or new is not None
    err = _outcome(_new_check_plan_layout, PRESETS["llama3-8b"], Layout(tp=3), "from.placements[0]")
    assert err == "from.placements[0].layout.tp: 3 does not divide the 32 attention heads"


def test_rank_and_coordinates_round_trip_as_layout_rank_did():
    for tp, pp, dp in itertools.product((1, 2, 3, 4), (1, 2, 3), (1, 2, 5)):
        dims = ParallelDims(tp, pp, dp)
        seen = set()
        for p, d, t in itertools.product(range(pp), range(dp), range(tp)):
            rank = dims.rank(p, d, t)
            assert rank == (p * dp + d) * tp + t  # Megatron order: TP fastest, then DP, then PP
            assert dims.coords(rank) == Coord(p, d, t) == (p, d, t)
            seen.add(rank)
        assert seen == set(range(dims.world))
    with pytest.raises(ValueError, match="outside the 8 ranks"):
        ParallelDims(2, 2, 2).coords(8)


def old_members(layout: Layout, r: list[int], kind: str) -> list[list[int]]:
    """``runtime.comm.groups.ParallelGroups._members`` as it was."""
    def at(p, d, t):
        return (p * layout.dp + d) * layout.tp + t

    lay = layout
    if kind == "tp":
        return [[r[at(p, d, t)] for t in range(lay.tp)] for p in range(lay.pp) for d in range(lay.dp)]
    if kind == "dp":
        return [[r[at(p, d, t)] for d in range(lay.dp)] for p in range(lay.pp) for t in range(lay.tp)]
    if kind == "pp":
        return [[r[at(p, d, t)] for p in range(lay.pp)] for d in range(lay.dp) for t in range(lay.tp)]
    return [[r[at(0, d, t)], r[at(lay.pp - 1, d, t)]] for d in range(lay.dp) for t in range(lay.tp)]


def test_group_members_are_those_the_process_groups_were_built_from():
    for tp, pp, dp in itertools.product((1, 2, 3), (1, 2, 3), (1, 2, 4)):
        layout = Layout(tp=tp, pp=pp, dp=dp)
        ranks = [10 + 3 * i for i in reversed(range(layout.world))]  # any order: members follow coordinates
        for kind in ("tp", "dp", "pp", "embed"):
            assert layout.dims.group_members(kind, ranks) == old_members(layout, ranks, kind), (kind, tp, pp, dp)
        assert layout.dims.group_members("tp") == old_members(layout, list(range(layout.world)), "tp")
    with pytest.raises(ValueError, match="group kind"):
        ParallelDims().group_members("cp")
    with pytest.raises(ValueError, match="has 4 ranks, got 3"):
        ParallelDims(2, 1, 2).group_members("tp", [0, 1, 2])


def test_expert_parallel_groups_split_each_dp_group_into_consecutive_blocks():
    dims = ParallelDims(tp=2, pp=1, dp=4, ep=2)  # ranks (dp, tp): dp rank d holds ranks 2d, 2d+1
    assert dims.group_members("ep") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert dims.group_members("edp") == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert [dims.ep_rank(d) for d in range(4)] == [0, 1, 0, 1]
    assert [dims.edp_rank(d) for d in range(4)] == [0, 0, 1, 1]
    for tp, pp, dp, ep in [(1, 1, 2, 2), (1, 2, 4, 4), (2, 2, 2, 1)]:
        d = ParallelDims(tp, pp, dp, ep)
        for kind in ("ep", "edp"):
            members = d.group_members(kind)
            assert sorted(r for g in members for r in g) == list(range(d.world)), (kind, tp, pp, dp, ep)
    with pytest.raises(ValueError, match="ep=2 does not divide dp=3"):
        ParallelDims(dp=3, ep=2).group_members("ep")


def test_degrees_are_positive_integers_and_ep_cp_have_their_rules():
    for bad in ({"tp": 0}, {"dp": -1}, {"pp": True}, {"ep": 1.0}):
        with pytest.raises(ValueError, match="give an integer >= 1"):
            ParallelDims(**bad)
    arch = PRESETS["llama3-8b"]
    assert "dense model, no experts" in str(split_problem(arch, 8, ep=2, dp=4))
    moe = PRESETS["mixtral-8x7b"]
    assert str(split_problem(moe, 8, ep=4, dp=2)) == "ep=4 does not divide dp=2: experts are split over " \
                                                     "data-parallel ranks"
    assert str(split_problem(moe, 8, ep=3, dp=3)) == "ep=3 does not divide the model's 8 experts"
    assert split_problem(moe, 8, ep=4, dp=8) is None
    assert str(ParallelDims(tp=8, dp=2, cp=2).problem(arch)).startswith("cp=2 asks for context parallelism")
    assert ParallelDims(tp=8, dp=4).problem(arch) is None


def old_tp_box(t, arch: ModelArch, tp: int, tp_rank: int):
    """``spec.sharding.tp_box`` as it was: heads recognised by the tensor's name."""
    full = [(0, n) for n in t.shape]
    if t.tp_dim is None or tp == 1:
        return tuple(full)
    if t.unit == KV_HEADS:
        hd = arch.head_dim
        if tp <= arch.kv_heads:
            lo, hi = split_range(arch.kv_heads, tp, tp_rank)
        else:
            lo = tp_rank * arch.kv_heads // tp
            hi = lo + 1
        full[t.tp_dim] = (lo * hd, hi * hd)
    elif t.name.endswith(("q_proj.weight", "q_proj.bias", "o_proj.weight")):
        lo, hi = split_range(arch.heads, tp, tp_rank)
        full[t.tp_dim] = (lo * arch.head_dim, hi * arch.head_dim)
    else:
        full[t.tp_dim] = split_range(t.shape[t.tp_dim], tp, tp_rank)
    return tuple(full)


def test_heads_are_split_by_the_tensors_declared_unit_as_they_were_by_name():
    arch = ModelArch(layers=2, hidden=96, ffn_hidden=200, heads=12, kv_heads=4, vocab=101, qkv_bias=True)
    specs = model_tensors(arch, False)
    units = {t.name.split(".", 3)[-1]: t.unit for t in specs if t.layer == 0}
    assert units["self_attn.q_proj.weight"] == units["self_attn.o_proj.weight"] == HEADS
    assert units["self_attn.q_proj.bias"] == HEADS
    assert units["self_attn.k_proj.weight"] == units["self_attn.v_proj.bias"] == KV_HEADS
    assert units["mlp.up_proj.weight"] == units["input_layernorm.weight"] == ELEMENTS
    for a in (arch, PRESETS["qwen2.5-0.5b"], ModelArch(layers=1, hidden=24, ffn_hidden=7, heads=6, kv_heads=1,
                                                       vocab=11, tied_embeddings=True)):
        for t in model_tensors(a, True) + model_tensors(a, False):
            for tp in (1, 2, 3, 4, 6, 8):
                for r in range(tp):
                    assert tp_box(t, a, tp, r) == old_tp_box(t, a, tp, r), (t.name, tp, r)
    with pytest.raises(ValueError, match=re.escape("TensorSpec.unit: 'rows'")):
        type(specs[0])("x", (2,), 0, None, unit="rows")


def test_an_uneven_pipeline_split_is_priced_at_its_fullest_stage_but_not_runnable():
    """Megatron-Core's uneven split (the remainder on the first/last stages): DeepSeek-V3's 61 layers at PP12
    run 6 layers on the last stage and 5 on the others; the cost model prices it, run refuses it."""
    from nereus.spec.parallel_dims import fullest_stage_layers

    assert fullest_stage_layers(61, 12) == 6 and fullest_stage_layers(24, 4) == 6 and fullest_stage_layers(7, 2) == 4
    for layers, pp in itertools.product(range(1, 70), range(1, 20)):
        if pp <= layers:
            fullest = fullest_stage_layers(layers, pp)
            assert fullest >= -(-layers // pp) and (layers % pp or fullest == layers // pp)
    assert layer_problem(61, 12) is not None and layer_problem(61, 12, priced=True) is None
    assert layer_problem(61, 62, priced=True) is not None  # a stage without a layer is never priced
    arch = ModelArch(layers=61, hidden=64, ffn_hidden=24, heads=8, kv_heads=8, vocab=37)
    with pytest.raises(SpecError, match="does not split the 61 layers evenly"):
        ParallelDims.of(Layout(tp=8, pp=12), arch, "run.layouts.actor/training")
    assert ParallelDims.of(Layout(tp=8, pp=12), arch, "plan", priced=True).pp == 12


def test_a_tp_wider_than_the_experts_ffn_is_refused():
    """A rank of a TP above the experts' FFN width would hold no column of an expert (priced, it divided by
    zero): the degree is refused with its reason; at the width itself it splits."""
    arch = ModelArch(layers=2, hidden=64, ffn_hidden=8, heads=8, kv_heads=8, vocab=37, moe=MoESpec(4, 2, 4))
    assert tp_splits(arch, 4)
    problem = split_problem(arch, 8)
    assert problem is not None and str(problem) == "tp=8 exceeds the experts' FFN width 4"
