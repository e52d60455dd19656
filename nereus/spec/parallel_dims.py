"""Parallel degrees, validated once: the one owner of ``tp``, ``pp``, ``dp`` (and ``ep``, ``cp``) from which a
rank's coordinates, the member lists of every process group and the shard boxes (``spec.sharding``) derive.

A ``Layout`` says what the user or the planner chose; ``layout.dims`` is its ``ParallelDims``, and
``ParallelDims.of(layout, arch)`` the same value checked against the model. The checks live here once:

- ``split_problem`` is the one TP/EP/CP divisibility rule (whole attention heads, whole GQA groups, whole
  experts); ``tp_splits`` is its cheap boolean for the planner's candidate enumeration;
- ``layer_problem`` is the pipeline rule: even stages (``runnable``, what the planner proposes and run,
  plan and a user's plan in estimate accept) or at least one layer per virtual stage (what the sharding
  contract can place, ``elastic.emu.check_plan``); ``priced`` is what the cost model prices: any depth up to
  the layers, an uneven one at its fullest stage (``fullest_stage_layers``), so a published layout with
  Megatron's uneven first/last stages is priced, not refused.

Rank order follows Megatron: tensor-parallel fastest, then data-parallel, then pipeline
(``rank = (pp_rank * dp + dp_rank) * tp + tp_rank``), so TP groups sit on neighbouring GPUs. Expert
parallelism splits the experts over data-parallel ranks (it adds no ranks); context parallelism has room
here (a degree and its rule) but no rank order yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from nereus.spec.errors import SpecError
from nereus.spec.model import ModelArch

if TYPE_CHECKING:
    from nereus.spec.layout import Layout

# "embed": each (first stage, last stage) pair of a tied embedding; "ep": the ``ep`` consecutive DP ranks that
# split the experts between them (all-to-all of routed tokens); "edp": the DP ranks holding the same experts
# (their gradients are reduced together), Megatron-Core's expert-data-parallel group
GROUP_KINDS = ("tp", "dp", "pp", "embed", "ep", "edp")


class Coord(NamedTuple):
    """Where one rank sits in its layout."""

    pp_rank: int
    dp_rank: int
    tp_rank: int


@dataclass(frozen=True)
class DegreeProblem:
    """Why a degree cannot split the model: ``str`` reads ``tp=3 does not divide ...``; ``at(path)`` is the
    error naming the degree's key under ``path`` (``plan.placements[0].layout.tp: 3 does not divide ...``)."""

    key: str
    value: int
    reason: str

    def __str__(self) -> str:
        return f"{self.key}={self.value} {self.reason}"

    def at(self, path: str) -> SpecError:
        return SpecError(f"{path}.{self.key}", f"{self.value} {self.reason}")


def expert_count(arch: ModelArch) -> int:
    """Routed experts per sparse layer that expert parallelism splits (0: a dense decoder)."""
    return 0 if arch.moe is None else arch.moe.experts


def split_problem(arch: ModelArch, tp: int, ep: int = 1, cp: int = 1, dp: int = 1) -> DegreeProblem | None:
    """The one TP/EP/CP divisibility rule; None when the degrees split ``arch``:

    - TP splits whole attention heads and gives every rank the KV heads its query heads read (whole GQA
      groups: ``tp`` divides ``kv_heads``, or is a multiple of it, KV heads then replicated) and leaves
      every rank columns of each expert (``tp`` at most the experts' FFN width);
    - EP splits whole experts over data-parallel ranks: ``ep`` divides ``dp`` and the expert count;
    - CP is not laid out yet: ``cp`` is 1."""
    heads, kv = arch.heads, arch.kv_heads
    if heads % tp:
        return DegreeProblem("tp", tp, f"does not divide the {heads} attention heads")
    if kv % tp and tp % kv:
        return DegreeProblem("tp", tp, f"splits the {kv} KV heads unevenly: give a tp that divides {kv} or is a "
                                       f"multiple of it (and divides {heads})")
    if arch.moe is not None and arch.moe.expert_ffn_hidden < tp:  # a rank would hold no column of an expert
        return DegreeProblem("tp", tp, f"exceeds the experts' FFN width {arch.moe.expert_ffn_hidden}")
    if ep > 1:
        experts = expert_count(arch)
        if not experts:
            return DegreeProblem("ep", ep, "asks for expert parallelism of a dense model, no experts: give ep=1")
        if experts % ep:
            return DegreeProblem("ep", ep, f"does not divide the model's {experts} experts")
        if dp % ep:
            return DegreeProblem("ep", ep, f"does not divide dp={dp}: experts are split over data-parallel ranks")
    if cp != 1:
        return DegreeProblem("cp", cp, "asks for context parallelism, which has no rank order yet: give cp=1")
    return None


def tp_splits(arch: ModelArch, tp: int) -> bool:
    """``split_problem`` as a yes/no for TP alone (the planner's candidate enumeration)."""
    return split_problem(arch, tp) is None


def check_split(arch: ModelArch, tp: int, where: str = "layout") -> None:
    """Raise ``SpecError`` at ``where`` when ``tp`` cannot split ``arch`` (``split_problem``)."""
    problem = split_problem(arch, tp)
    if problem is not None:
        raise SpecError(where, str(problem))


def fullest_stage_layers(layers: int, pp: int) -> int:
    """Layers on the fullest stage of the most even split Megatron-Core runs: ``layers / pp`` when ``pp``
    divides them; otherwise its ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``
    take what the middle ``pp - 2`` stages, split evenly (TransformerConfig requires it), leave -- e.g.
    DeepSeek-V3's 61 layers at PP12, verl's run_deepseek671b_math_megatron_96gb.sh: 6 on the last stage, 5 on
    the others. The fullest stage bounds a synchronous 1F1B pipeline (every stage steps at its pace)."""
    if layers % pp == 0 or pp <= 2:
        return -(-layers // pp)
    middle = pp - 2
    # k layers on each middle stage, the rest split between the two end stages (each at least one layer)
    return min(max(k, -(-(layers - middle * k) // 2)) for k in range(1, (layers - 2) // middle + 1))


def layer_problem(layers: int, pp: int, interleave: int = 1, runnable: bool = True,
                  priced: bool = False) -> DegreeProblem | None:
    """The pipeline rule; None when ``pp`` (with ``interleave`` virtual stages per device) splits ``layers``.

    ``runnable`` (estimate, plan, run): every stage gets the same number of layers, at least one --
    Megatron-LM requires the layers to divide evenly, the planner proposes only such depths and the cost
    model prices each stage as the fullest one -- and interleaving splits each device's layers evenly again
    (``layers % (pp * interleave) == 0``, with ``pp > 1``). Otherwise (what the sharding contract places:
    contiguous ranges, the remainder to the first stages) each virtual stage needs one layer. ``priced``
    (the cost model, ``cost.plan_cost``): as ``runnable`` but a ``pp`` that does not divide the layers is
    priced at its fullest stage (``fullest_stage_layers``), for a published run's layout; interleaving
    still needs whole chunks."""
    if priced and pp <= layers and layers % pp and interleave == 1:
        return None
    if not runnable:
        if pp * interleave > layers:
            return DegreeProblem("pp", pp, f"x interleave {interleave} exceeds the {layers} layers")
        return None
    if pp > layers:
        return DegreeProblem("pp", pp, f"asks for {pp} pipeline stages but the model has {layers} layers: every "
                                       f"stage needs at least one; give pp <= {layers}")
    if layers % pp:
        fits = [d for d in range(1, min(layers, 64) + 1) if layers % d == 0]
        return DegreeProblem("pp", pp, f"does not split the {layers} layers evenly; give a pp that divides them "
                                       f"({', '.join(map(str, fits))}{', ...' if layers > 64 else ''})")
    if interleave > 1 and (pp == 1 or layers % (pp * interleave)):
        return DegreeProblem("interleave", interleave, f"needs pp > 1 and pp x interleave dividing the {layers} "
                                                       f"layers (pp={pp})")
    return None


@dataclass(frozen=True)
class ParallelDims:
    """The parallel degrees of one model-stage (each at least 1), and what derives from them."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1  # expert parallelism, over the data-parallel ranks (adds no ranks)
    cp: int = 1  # context parallelism: room for it; ``split_problem`` asks for 1 until ranks lay it out

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "dp", "ep", "cp"):
            value = self.__dict__[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelDims.{key}: {value!r}; give an integer >= 1")

    @staticmethod
    def of(layout: Layout, arch: ModelArch, where: str = "layout", priced: bool = False) -> ParallelDims:
        """``layout``'s degrees, checked once against ``arch``: the layout runs the model (``check``);
        ``priced``: the cost model can price it (``layer_problem``)."""
        return layout.dims.check(arch, layout.interleave, where, priced)

    def problem(self, arch: ModelArch, interleave: int = 1, priced: bool = False) -> DegreeProblem | None:
        """The first reason these degrees cannot run ``arch`` (layers, then heads); None when they can."""
        return (layer_problem(arch.layers, self.pp, interleave, priced=priced)
                or split_problem(arch, self.tp, self.ep, self.cp, self.dp))

    def check(self, arch: ModelArch, interleave: int = 1, where: str = "layout", priced: bool = False) -> ParallelDims:
        """``self`` when the degrees run ``arch``; otherwise ``SpecError`` at ``where``, naming the fix."""
        problem = self.problem(arch, interleave, priced)
        if problem is not None:
            raise SpecError(where, str(problem))
        return self

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def rank(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        """The rank at these coordinates (inverse of ``coords``)."""
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def coords(self, rank: int) -> Coord:
        """(pp_rank, dp_rank, tp_rank) of ``rank``, ``0 <= rank < world``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the {self.world} ranks of TP{self.tp}·PP{self.pp}·DP{self.dp}")
        return Coord(rank // (self.tp * self.dp), (rank // self.tp) % self.dp, rank % self.tp)

    def ep_rank(self, dp_rank: int) -> int:
        """The place of DP rank ``dp_rank`` in its expert-parallel group: which ``1/ep`` of the experts it holds
        (EP groups are ``ep`` consecutive DP ranks, as Megatron-Core lays them out)."""
        return dp_rank % self.ep

    def edp_rank(self, dp_rank: int) -> int:
        """The place of DP rank ``dp_rank`` among the DP ranks holding its experts (``dp / ep`` of them)."""
        return dp_rank // self.ep

    def group_members(self, kind: str, ranks: Sequence[int] | None = None) -> list[list[int]]:
        """Every group of ``kind`` (``GROUP_KINDS``) as lists of ``ranks`` (default: the layout's own ranks),
        each in coordinate order (a rank's place in its group is its coordinate): TP groups of ``tp`` ranks
        per (pp, dp); DP groups per (pp, tp); PP groups per (dp, tp); embedding pairs (first stage, last
        stage) per (dp, tp); EP groups of ``ep`` consecutive DP ranks and expert-data-parallel groups of the
        ``dp / ep`` DP ranks with the same EP rank, per (pp, tp)."""
        r = range(self.world) if ranks is None else ranks
        if len(r) != self.world:
            raise ValueError(f"TP{self.tp}·PP{self.pp}·DP{self.dp} has {self.world} ranks, got {len(r)}")
        at, tps, dps, pps = self.rank, range(self.tp), range(self.dp), range(self.pp)
        if kind == "tp":
            return [[r[at(p, d, t)] for t in tps] for p in pps for d in dps]
        if kind == "dp":
            return [[r[at(p, d, t)] for d in dps] for p in pps for t in tps]
        if kind == "pp":
            return [[r[at(p, d, t)] for p in pps] for d in dps for t in tps]
        if kind == "embed":
            return [[r[at(0, d, t)], r[at(self.pp - 1, d, t)]] for d in dps for t in tps]
        ep, blocks = self.ep, range(self.dp // self.ep)
        if kind in ("ep", "edp") and self.dp % ep:
            raise ValueError(f"ep={ep} does not divide dp={self.dp}: no expert-parallel groups")
        if kind == "ep":
            return [[r[at(p, b * ep + e, t)] for e in range(ep)] for p in pps for t in tps for b in blocks]
        if kind == "edp":
            return [[r[at(p, b * ep + e, t)] for b in blocks] for p in pps for t in tps for e in range(ep)]
        raise ValueError(f"group kind {kind!r}; one of {', '.join(GROUP_KINDS)}")
