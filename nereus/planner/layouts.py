"""Plans given by the user: plan files, and a single layout for a training-only job."""

from __future__ import annotations

from pathlib import Path

from nereus.cost.hardware import Hardware
from nereus.cost.stages import stage_cost
from nereus.planner.candidates import enumerate_layouts
from nereus.planner.defaults import written_options
from nereus.spec.errors import SpecError
from nereus.spec.fields import read_json_file
from nereus.spec.job import JobSpec
from nereus.spec.layout import Layout, Placement, Plan
from nereus.spec.parallel_dims import ParallelDims


def read_plan_file(path: str | Path) -> Plan:
    """A plan as ``nereus plan --json`` writes it (the ``plan`` member), or a bare plan object."""
    data = read_json_file(path, "plan")
    if isinstance(data, dict) and "plan" in data:
        return Plan.from_dict(data["plan"], "plan")
    return Plan.from_dict(data, "plan")


def plan_from_layout(hw: Hardware, job: JobSpec, text: str) -> Plan:
    """Place a training-only job's one model-stage on the first tp·pp·dp GPUs; fields left out
    (dp, micro-batch size, interleaving, recompute when 'auto') are chosen as the planner would."""
    stages = job.model_stages()
    if len(stages) != 1:
        raise SpecError("--layout", f"only for training-only jobs (this one has {len(stages)} model-stages); "
                                    "give --plan FILE instead")
    ms = stages[0]
    degrees, options = written_options(text)
    for key in ("tp", "pp"):
        if key not in degrees:
            raise SpecError(f"--layout.{key}", "required; for example --layout tp=8,pp=2")
    tp, pp = int(degrees["tp"]), int(degrees["pp"])
    n = job.cluster.num_gpus
    dp = int(degrees.get("dp", n // (tp * pp)))
    if tp * pp * dp > n or dp < 1:
        raise SpecError("--layout", f"tp·pp·dp = {tp * pp * dp} does not fit the {n} GPUs of the cluster")
    ParallelDims(tp, pp, dp).check(job.models[ms.model], int(options.get("interleave", 1)), "--layout")
    matches = [lay for lay in enumerate_layouts(job, ms, tp * pp * dp)
               if (lay.tp, lay.pp, lay.dp) == (tp, pp, dp) and options.items() <= lay.to_dict().items()]
    if not matches:  # everything given explicitly, or outside what the search enumerates
        matches = [Layout.from_dict({**degrees, **options, "dp": dp}, "--layout")]
    best, best_key = None, None
    for lay in matches:
        cost = stage_cost(hw, job, ms, lay)
        if cost is None:
            continue
        key = (cost.peak_bytes > hw.usable_bytes(), cost.time())  # feasible first, then fastest
        if best_key is None or key < best_key:
            best, best_key = lay, key
    if best is None:
        raise SpecError("--layout", f"TP{tp}·PP{pp}·DP{dp} cannot split the batch of "
                                    f"{job.sequences_per_step()} sequences")
    return Plan((Placement(ms, best, tuple(range(best.world))),), n)
