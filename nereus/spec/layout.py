"""Layouts and plans: plain typed values that the planner writes and the executor and simulator read.

A ``Layout`` is what the user or the planner chose for one model-stage; its degrees as a validated value,
the rank order inside a model-stage's GPU list and the process groups' members are
``spec.parallel_dims.ParallelDims`` (``layout.dims``; checked against the model by ``ParallelDims.of``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import cached_property

from nereus.spec.errors import SpecError
from nereus.spec.fields import MAX_GPUS, MAX_LAYERS, MAX_SEQUENCES, MAX_TOKENS, Fields
from nereus.spec.generation import TailPhase
from nereus.spec.levers import GenerationLevers
from nereus.spec.parallel_dims import ParallelDims

STAGES = ("generation", "inference", "training")
RECOMPUTE = ("none", "selective", "full")
# how the trained weights reach the generation engine every step (priced in ``cost.verl_weight_sync``)
WEIGHT_SYNCS = ("direct", "hybrid-reshard", "gather-broadcast", "tensor-broadcast", "checkpoint-engine",
                "packed-broadcast", "zero3-gather")


@dataclass(frozen=True, order=True)
class ModelStage:
    model: str
    stage: str

    def __str__(self) -> str:
        return f"{self.model}/{self.stage}"

    @staticmethod
    def parse(text: str, where: str = "model_stage") -> ModelStage:
        model, sep, stage = text.partition("/")
        if not sep or not model or stage not in STAGES:
            raise SpecError(where, f"{text!r} is not MODEL/STAGE with STAGE one of {list(STAGES)}")
        return ModelStage(model, stage)


@dataclass(frozen=True)
class Layout:
    """What the user or the planner chose for one model-stage: the degrees, micro-batching, interleaving,
    recomputation, sequence parallelism and ZeRO/FSDP. A field a layout string or plan file leaves out takes
    the value written here (the format's; ``planner.defaults`` says which of them the planner fills in)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1  # expert parallelism: experts split over ep of the dp ranks (Megatron-Core's expert_model_parallel)
    micro_batch_size: int = 1
    interleave: int = 1  # virtual pipeline stages per device (Narayanan et al. 2021, sec. 2.2.2)
    recompute: str = "selective"
    sequence_parallel: bool = True
    zero1: bool = True
    fsdp: bool = False  # ZeRO-3 / FSDP: weights, gradients and optimizer state all sharded over DP
    # > 0: packed sequences in micro-batches of at most this many tokens per replica, instead of
    # micro_batch_size padded rows (verl's use_remove_padding + use_dynamic_bsz, ppo_max_token_len_per_gpu)
    max_token_len: int = 0

    @cached_property
    def dims(self) -> ParallelDims:
        """The degrees as the one parallel-dims value (ranks, coordinates, groups; not checked against a
        model: ``ParallelDims.of(layout, arch)`` is)."""
        return ParallelDims(self.tp, self.pp, self.dp, self.ep)

    @property
    def world(self) -> int:
        return self.dims.world

    def short(self) -> str:
        text = f"TP{self.tp}·PP{self.pp}·DP{self.dp}"
        if self.ep > 1:
            text += f"·EP{self.ep}"
        if self.interleave > 1:
            text += f"·v{self.interleave}"
        if self.fsdp:
            text += " fsdp"
        if self.max_token_len:
            return text + f" packed {self.max_token_len} tok"
        return text + f" mbs{self.micro_batch_size}"

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: object, where: str = "layout") -> Layout:
        f = Fields(data, where)
        layout = Layout(
            tp=f.get("tp", int, 1, minimum=1, maximum=MAX_GPUS),
            pp=f.get("pp", int, 1, minimum=1, maximum=MAX_GPUS),
            dp=f.get("dp", int, 1, minimum=1, maximum=MAX_GPUS),
            ep=f.get("ep", int, 1, minimum=1, maximum=MAX_GPUS),
            micro_batch_size=f.get("micro_batch_size", int, 1, minimum=1, maximum=MAX_SEQUENCES),
            interleave=f.get("interleave", int, 1, minimum=1, maximum=MAX_LAYERS),
            recompute=f.get("recompute", str, "selective", choices=RECOMPUTE),
            sequence_parallel=f.get("sequence_parallel", bool, True),
            zero1=f.get("zero1", bool, True),
            fsdp=f.get("fsdp", bool, False),
            max_token_len=f.get("max_token_len", int, 0, minimum=0, maximum=MAX_TOKENS),
        )
        f.finish()
        return layout

    @staticmethod
    def parse(text: str, where: str = "--layout") -> Layout:
        """``tp=8,pp=2,dp=4[,micro_batch_size=1,...]`` (``layout_fields``) as a layout."""
        return Layout.from_dict(layout_fields(text, where), where)


def layout_fields(text: str, where: str = "--layout") -> dict[str, object]:
    """The fields a layout string writes, values typed (``tp=8,pp=2`` -> ``{"tp": 8, "pp": 2}``); keys and
    types validated as ``Layout.from_dict`` does."""
    values: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        value = value.strip()
        if not sep:
            raise SpecError(where, f"{part!r} is not KEY=VALUE (for example tp=8,pp=2,dp=4)")
        if value in ("true", "false"):
            values[key.strip()] = value == "true"
        elif value.isascii() and value.isdigit() and len(value) <= 18:  # '²' is a digit to isdigit()
            values[key.strip()] = int(value)
        else:
            values[key.strip()] = value
    Layout.from_dict(values, where)  # validates keys and types
    return values


@dataclass(frozen=True)
class Placement:
    """One model-stage's layout and its ordered GPUs (``len(gpus) == layout.world``)."""

    model_stage: ModelStage
    layout: Layout
    gpus: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"model_stage": str(self.model_stage), "layout": self.layout.to_dict(), "gpus": list(self.gpus)}

    @staticmethod
    def from_dict(data: object, where: str) -> Placement:
        f = Fields(data, where)
        ms = ModelStage.parse(f.get("model_stage", str), f.key_path("model_stage"))
        layout = Layout.from_dict(f.get("layout", dict), f.key_path("layout"))
        gpus = f.get("gpus", list)
        f.finish()
        if not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus):
            raise SpecError(f.key_path("gpus"), "must be a list of non-negative GPU indices")
        if len(set(gpus)) != len(gpus):
            raise SpecError(f.key_path("gpus"), "lists a GPU twice; each device holds one rank of a model-stage")
        if len(gpus) != layout.world:
            raise SpecError(f.key_path("gpus"), f"has {len(gpus)} GPUs but the layout needs tp·pp·dp = {layout.world}")
        return Placement(ms, layout, tuple(gpus))


@dataclass(frozen=True)
class Plan:
    """A layout and GPU set for every model-stage. Stages run in order generation → inference → training;
    within a stage, model-stages on disjoint GPUs run concurrently and those sharing GPUs take turns.

    Besides the placements a plan names the planner's ``strategy`` (colocated, disaggregated, ...), the
    per-step ``weight_sync`` mechanism (``WEIGHT_SYNCS``), the generation stage's ``generation``
    phases (a mid-step switch to a tail layout, ``spec.generation.TailPhase``) and its ``levers``
    (speculative decoding, tail batching, partial rollout, asynchrony: ``spec.levers.GenerationLevers``).
    Two plans are equal when their placements are: that is what a transition moves; the other fields
    change from one step to the next without one."""

    placements: tuple[Placement, ...]
    num_gpus: int
    strategy: str = field(default="", compare=False)
    weight_sync: str = field(default="direct", compare=False)
    generation: TailPhase | None = field(default=None, compare=False)
    levers: GenerationLevers | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.weight_sync not in WEIGHT_SYNCS:
            raise SpecError("plan.weight_sync", f"{self.weight_sync!r}; one of {', '.join(WEIGHT_SYNCS)}")

    def placement(self, ms: ModelStage | str) -> Placement:
        key = ModelStage.parse(ms) if isinstance(ms, str) else ms
        for p in self.placements:
            if p.model_stage == key:
                return p
        raise KeyError(str(key))

    def model_stages(self) -> list[ModelStage]:
        return [p.model_stage for p in self.placements]

    def to_dict(self) -> dict:
        """JSON-ready; the optional fields only when they are set (a plan of hand-picked layouts is just
        its placements)."""
        out: dict = {"num_gpus": self.num_gpus, "placements": [p.to_dict() for p in self.placements]}
        if self.strategy:
            out["strategy"] = self.strategy
        if self.weight_sync != "direct":
            out["weight_sync"] = self.weight_sync
        if self.generation is not None:
            out["generation_phases"] = self.generation.to_dict()
        if self.levers is not None:
            out["generation_levers"] = self.levers.to_dict()
        return out

    @staticmethod
    def from_dict(data: object, where: str = "plan") -> Plan:
        f = Fields(data, where)
        num_gpus = f.get("num_gpus", int, minimum=1, maximum=MAX_GPUS)
        raw = f.get("placements", list)
        strategy = f.get("strategy", str, "")
        sync = f.get("weight_sync", str, "direct", choices=WEIGHT_SYNCS)
        phases = f.get("generation_phases", dict, None)
        levers = f.get("generation_levers", dict, None)
        f.finish()
        placements = tuple(Placement.from_dict(p, f"{where}.placements[{i}]") for i, p in enumerate(raw))
        seen = set()
        for i, p in enumerate(placements):
            if p.model_stage in seen:
                raise SpecError(f"{where}.placements[{i}].model_stage", f"{p.model_stage} is placed twice")
            seen.add(p.model_stage)
            if max(p.gpus) >= num_gpus:
                raise SpecError(f"{where}.placements[{i}].gpus", f"GPU {max(p.gpus)} is beyond num_gpus={num_gpus}")
        generation = None if phases is None else TailPhase.from_dict(phases, f"{where}.generation_phases")
        levers = None if levers is None else GenerationLevers.from_dict(levers, f"{where}.generation_levers")
        return Plan(placements, num_gpus, strategy, sync, generation, levers)
