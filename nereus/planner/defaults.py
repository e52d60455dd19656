"""What the planner fills into a layout that nobody chose field by field: the options of the layouts it
enumerates, the fields a partly written layout leaves to it, and the options a hand-written runtime
layout left out. ``spec.layout.Layout`` holds only what was chosen; these rules live here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

from nereus.spec.capability import RuntimeCapability
from nereus.spec.job import JobSpec
from nereus.spec.layout import Layout, ModelStage, layout_fields
from nereus.spec.packing import token_budget

# A generation layout's options: one pass per request (no micro-batching, no interleaving), no backward
# pass to recompute for and no optimizer state to shard; sequence parallelism as the format leaves it.
GENERATION_OPTIONS: Mapping[str, object] = MappingProxyType({
    "micro_batch_size": 1, "interleave": 1, "recompute": "none", "sequence_parallel": True, "zero1": False,
    "fsdp": False})
# What a layout string or plan file that leaves an option out gets (``Layout``'s field defaults): a layout
# holding one of these values may not have asked for it
UNWRITTEN = Layout()
DEGREES = ("tp", "pp", "dp")


def generation_layout(tp: int, pp: int, dp: int, ep: int = 1) -> Layout:
    """The planner's generation layout of these degrees (``GENERATION_OPTIONS``)."""
    return Layout(tp=tp, pp=pp, dp=dp, ep=ep, **GENERATION_OPTIONS)


def written_options(text: str, where: str = "--layout") -> tuple[dict[str, object], dict[str, object]]:
    """A partly written layout (``--layout tp=8,pp=2``) as (degrees written, other options written); the
    fields left out are the planner's to choose (``planner.layouts.plan_from_layout``)."""
    given = layout_fields(text, where)
    return {k: v for k, v in given.items() if k in DEGREES}, {k: v for k, v in given.items() if k not in DEGREES}


def runtime_options(layout: Layout, capability: RuntimeCapability) -> Layout:
    """A layout from ``run.layouts`` as the runtime takes it: the options the text may have left out --
    those still at ``UNWRITTEN``'s recompute and sequence parallelism, which it then did not ask for --
    become the runtime's own. An option written with another value stays, and the runtime refuses it if
    unsupported (``RuntimeCapability.as_run``)."""
    own: dict[str, object] = {}
    if layout.recompute == UNWRITTEN.recompute:
        own["recompute"] = capability.recompute[0]
    if layout.sequence_parallel == UNWRITTEN.sequence_parallel:
        own["sequence_parallel"] = capability.sequence_parallel
    return replace(layout, **own)


def planned_token_budget(job: JobSpec, ms: ModelStage, micro_batch_size: int) -> int:
    """``Layout.max_token_len`` of an inference or training layout the planner proposes: the budget the run
    gives it (``run.packing``, as ``run.setup.packed`` sets it), so that the planner prices the micro-batches
    the runtime runs (``cost.stage_tokens``); 0 (no token budget) for a job without a run section."""
    if job.run is None:
        return 0
    wl = job.workload
    return token_budget(job.run.packing, ms.model, ms.stage, micro_batch_size, wl.prompt_length + wl.response.max)
