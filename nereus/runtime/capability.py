"""What this runtime implements of a layout (``Runtime.capability``), importable without torch or Ray so
that job setup and the controller can ask it before any worker starts."""

from __future__ import annotations

from dataclasses import replace

from nereus.spec.capability import RuntimeCapability
from nereus.spec.job import JobSpec

# TP, PP, DP, EP in inference and training (``parallel.ep``), micro-batches, ZeRO-1, ZeRO-3/FSDP
# (``parallel.zero3``; not with EP), GPipe/1F1B, activation recomputation (full and selective:
# ``parallel.recompute``); no sequence parallelism or interleaving; the RL driver runs model-stages one after
# another (with run.overlap, those on disjoint workers at once: ``capability_for``); a step's rollouts are
# packed to its longest response (run.rollout.pack), so inference and training pay for the padding.
# "none" first: what a layout that leaves recompute out runs (``planner.defaults.runtime_options``).
CAPABILITY = RuntimeCapability(recompute=("none", "selective", "full"), sequence_parallel=False, max_interleave=1,
                               fsdp=True, expert_parallel=True, concurrent_stages=False, padded_rollouts=True)


def capability_for(overlap: bool) -> RuntimeCapability:
    """``CAPABILITY`` for a job with ``run.overlap`` set as ``overlap``: with it the driver runs the
    model-stages of one phase that sit on disjoint workers at once (``run.overlap.Calls``), so the planner
    and the lever rule price such a phase at its slowest group, as the runtime runs it, not their sum."""
    return replace(CAPABILITY, concurrent_stages=overlap)


def priced_as_run(job: JobSpec) -> tuple[JobSpec, RuntimeCapability]:
    """A job with a ``run`` section as this runtime runs it: its options narrowed to the capability's
    (``RuntimeCapability.planning_options``: padded batches where no token budget packs them, the recompute
    and FSDP choices it runs), and the capability to constrain a search with. The run's planner
    (``run.setup``), its controller (``run.adaptive``) and `nereus plan`/`estimate` all price it so."""
    capability = capability_for(job.run.overlap)
    return replace(job, options=capability.planning_options(job.options)), capability
