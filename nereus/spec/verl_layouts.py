"""verl's parallel degrees as the model-stages' fixed layouts (``run.layouts``).

verl sets each worker group's degrees on the command line: Megatron's ``tensor/pipeline/
virtual_pipeline_model_parallel_size`` for the actor, reference and critic, FSDP's
``ulysses_sequence_parallel_size`` (Ulysses splits each sequence over its GPUs by attention heads, Jacobs
et al. 2023, arXiv:2309.14509; Nereus's equivalent is TP with sequence parallelism, which splits the same
heads and the same activations and gives the same results), and the rollout's
``tensor_model_parallel_size`` / ``data_parallel_size``. Nereus has one layout per model-stage, so each
degree becomes that stage's layout, the one the job starts from and keeps:

- the actor's degrees set ``actor/training`` and ``actor/inference`` (verl's actor computes the old
  log-probs under its own layout), the reference's ``reference/inference``, the critic's
  ``critic/training`` and ``critic/inference``; the rollout's ``actor/generation``;
- a degree not given keeps the job's layout's (or 1 where the job has none), as do micro-batch size,
  recomputation and the other layout fields;
- ``dp`` = ``run.workers`` / (tp × pp): the stage spans every worker, as verl's colocated workers do
  (the rollout's ``data_parallel_size``, when given, is its dp instead); tp × pp must divide the workers;
- a job under ``run.adapt`` has no fixed layouts (the controller chooses them): the degree is refused.

Megatron's ``expert_model_parallel_size`` is the stage's ``ep`` (experts split over that many of its
data-parallel ranks, as Megatron-Core does; checked against the model like every degree). Context
parallelism and a separate expert tensor-parallel degree have no runtime here: those pass at 1 and are
refused above it (``nereus.spec.verl_keys_engines``).
"""

from __future__ import annotations

from typing import Any

from nereus.spec.errors import SpecError
from nereus.spec.layout import layout_fields
from nereus.spec.run import RunSpec

_A, _R, _REF, _C = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref", "critic"
_ACTOR, _REFERENCE, _CRITIC = ("actor/training", "actor/inference"), ("reference/inference",), (
    "critic/training", "critic/inference")

_ORDER = ("tp", "pp", "dp")  # a written layout names its degrees first, in this order

# verl key -> (the model-stages it sets, the layout field)
DEGREES: dict[str, tuple[tuple[str, ...], str]] = {
    **{f"{prefix}.megatron.{name}_model_parallel_size": (stages, field)
       for prefix, stages in ((_A, _ACTOR), (_REF, _REFERENCE), (_C, _CRITIC))
       for name, field in (("tensor", "tp"), ("pipeline", "pp"), ("virtual_pipeline", "interleave"),
                           ("expert", "ep"))},
    **{f"{prefix}.ulysses_sequence_parallel_size": (stages, "tp")
       for prefix, stages in ((_A, _ACTOR), (_REF, _REFERENCE), (_C, _CRITIC))},
    f"{_R}.tensor_model_parallel_size": (("actor/generation",), "tp"),
    f"{_R}.data_parallel_size": (("actor/generation",), "dp"),
}


def _degree(key: str, field: str, value: Any) -> int | None:
    """A degree's value: a positive integer; ``null`` (no virtual pipeline) is None."""
    if value is None and field == "interleave":
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecError(key, f"expected a positive integer (a parallel degree), got {value!r}")
    return value


class LayoutDegrees:
    """The degrees one command line gives, per model-stage; ``finish`` writes them as ``run.layouts``."""

    def __init__(self) -> None:
        self.given: dict[str, dict[str, tuple[str, int | None]]] = {}  # stage -> field -> (verl key, value)

    def add(self, key: str, value: Any) -> None:
        stages, field = DEGREES[key]
        degree = _degree(key, field, value)
        for stage in stages:
            other = self.given.setdefault(stage, {}).get(field)
            if other is not None and other[0] != key and other[1] != degree:
                raise SpecError(key, f"{value!r} differs from {other[0]}={other[1]!r}, and both set {field} of "
                                     f"{stage} (verl runs one of them, by strategy): give one")
            self.given[stage][field] = (key, degree)

    def finish(self, out: dict, notes: list[str]) -> list[str]:
        """Write ``run.layouts.<stage>`` for every stage a degree names; the stages written."""
        run = out.get("run") if isinstance(out.get("run"), dict) else {}
        models = out.get("models") if isinstance(out.get("models"), dict) else {}
        workers = run.get("workers", RunSpec.workers)
        written = []
        for stage, fields in sorted(self.given.items()):
            key = next(iter(fields.values()))[0]
            if stage.split("/")[0] not in models:
                notes.append(f"nereus: ignoring {key}: the job has no {stage.split('/')[0]} model")
                continue
            if "adapt" in run:
                raise SpecError(key, "the job adapts its layouts (run.adapt), so no stage has a fixed one: remove "
                                     "run.adapt (~run.adapt) to start from verl's degrees, or drop the key")
            run = out.setdefault("run", run)
            layouts = run.setdefault("layouts", {}) if isinstance(run, dict) else None
            if not isinstance(layouts, dict):
                raise SpecError("run.layouts" if isinstance(run, dict) else "run", "is not a section; cannot set "
                                f"the layout {key} asks for under it")
            layouts[stage] = _layout(layouts.get(stage), fields, workers, key)
            written.append(stage)
        return written


def _layout(current: Any, given: dict[str, tuple[str, int | None]], workers: Any, key: str) -> Any:
    """The stage's layout with the given degrees: the job's other fields kept, dp filling the workers."""
    text = current.get("layout") if isinstance(current, dict) else current
    try:
        fields = layout_fields(text, key) if isinstance(text, str) else {}
    except SpecError:
        fields = {}  # the job's own layout is invalid: validation names it
    fields.update({f: v for f, (_, v) in given.items() if v is not None})
    if given.get("interleave", ("", 0))[1] is None:
        fields.pop("interleave", None)
    tp, pp = fields.get("tp", 1), fields.get("pp", 1)
    if "dp" not in given:
        if not isinstance(workers, int) or workers % (tp * pp):
            raise SpecError(key, f"tp x pp = {tp} x {pp} does not divide run.workers ({workers!r}): the stage spans "
                                 "every worker; give degrees whose product divides it, or more workers")
        fields["dp"] = workers // (tp * pp)
    fields = {k: fields[k] for k in sorted(fields, key=lambda k: (_ORDER.index(k) if k in _ORDER else len(_ORDER)))}
    layout = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items())
    ranks = current.get("ranks") if isinstance(current, dict) else None
    world = fields.get("tp", 1) * fields.get("pp", 1) * fields.get("dp", 1)
    # the job's ranks stay where the stage keeps its size; otherwise it runs on workers 0..world-1
    return {"layout": layout, "ranks": ranks} if isinstance(ranks, list) and len(ranks) == world else layout
