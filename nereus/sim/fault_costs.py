"""What recovery costs at scale, priced from a simulated run's plans, and the run's failure-free timeline.

Nereus (``LiveRecovery``): the runtime's measured recovery (docs/reliability.md: re-forming the world
0.10 s, restoring 0.46 s, on 4 workers) keeps its fixed parts; what grows with the job is priced by the
cost model. Moving every model's weights and optimizer state onto the survivors of a lost node is the
transition from the plan in force to the planner's plan for one node fewer (``control.transition_cost``:
the transition graph's makespan at the cluster's link bandwidths), and taking the replacement back in is
the transition the other way. The snapshot at the start of each step copies a device's state to host
memory over PCIe. Checkpoint-restart (``RestartRecovery``): writing a checkpoint and reading it back move
each node's share at the storage bandwidth the simulator's restart already assumes (``sim.run.Recovery``).
"""

from __future__ import annotations

from nereus.control.loop import Recovery
from nereus.control.record import RunRecord
from nereus.control.transition_cost import TransitionCoster
from nereus.cost.hardware import Hardware, pcie_bytes_per_s
from nereus.cost.memory import BF16, OPTIMIZER_BYTES_PER_PARAM, stage_params
from nereus.cost.transition import state_bytes_per_device
from nereus.sim.fault_replay import LiveRecovery, RestartRecovery, StepTimeline
from nereus.spec.job import JobSpec
from nereus.spec.layout import Plan

PHASE_ORDER = ("generation", "inference", "training", "weight_sync")


def state_bytes_by_gpu(job: JobSpec, plan: Plan) -> dict[int, float]:
    """Bytes of state (weights, and optimizer state of trained models) each device of ``plan`` keeps."""
    out: dict[int, float] = {}
    for p in plan.placements:
        size = state_bytes_per_device(job, p)
        for g in p.gpus:
            out[g] = out.get(g, 0.0) + size
    return out


def snapshot_bytes_by_gpu(job: JobSpec, plan: Plan, every_stage: bool = False) -> dict[int, float]:
    """What one step's snapshot copies on each device (``runtime.recovery.snapshots``): the weights of
    data-parallel replica 0 of every trained model and every rank's optimizer shard; the frozen models'
    weights are copied once, not every step. It is also the state a disk checkpoint writes. With
    ``every_stage``, also replica 0's weights of every other stage: one copy of everything a job loads."""
    out: dict[int, float] = {}
    for p in plan.placements:
        trained = p.model_stage.stage == "training"
        if not trained and not every_stage:
            continue
        model = p.model_stage.model
        params = stage_params(job.models[model], p.layout, job.has_value_head(model))
        if p.layout.fsdp:
            params /= p.layout.dp
        shard = p.layout.dp if p.layout.zero1 and not p.layout.fsdp else 1
        optimizer = params * OPTIMIZER_BYTES_PER_PARAM / shard if trained else 0.0
        for rank, g in enumerate(p.gpus):
            replica0 = p.layout.fsdp or p.layout.dims.coords(rank)[1] == 0
            out[g] = out.get(g, 0.0) + (params * BF16 if replica0 else 0.0) + optimizer
    return out


def by_node(job: JobSpec, per_gpu: dict[int, float]) -> dict[int, float]:
    gpn = job.cluster.gpus_per_node
    out: dict[int, float] = {}
    for g, size in per_gpu.items():
        out[g // gpn] = out.get(g // gpn, 0.0) + size
    return out


def live_recovery(job: JobSpec, plan: Plan, survivors: Plan, coster: TransitionCoster | None = None,
                  storage_bytes_per_s: float = Recovery.storage_bytes_per_s, **measured: float) -> LiveRecovery:
    """Nereus's costs for ``plan`` losing a node (``survivors``: the plan for the rest); ``measured``
    overrides the runtime's measured or assumed figures (``LiveRecovery`` fields)."""
    coster = coster or TransitionCoster()
    hw = Hardware(job.cluster)
    return LiveRecovery(**{
        "reshard_s": coster(hw, job, plan, survivors),
        "regrow_s": coster(hw, job, survivors, plan),
        # a snapshot copies one way over each GPU's PCIe link (``cost.hardware.pcie_bytes_per_s``)
        "snapshot_s": max(snapshot_bytes_by_gpu(job, plan).values()) / pcie_bytes_per_s(hw),
        "checkpoint_s": max(by_node(job, snapshot_bytes_by_gpu(job, plan)).values()) / storage_bytes_per_s,
        **measured,
    })


def restart_recovery(job: JobSpec, plan: Plan, storage_bytes_per_s: float = Recovery.storage_bytes_per_s,
                     **assumed: float) -> RestartRecovery:
    """Checkpoint-restart's costs for ``plan``, nodes in parallel: a checkpoint writes the trained models'
    state once (each rank its share, as verl's sharded checkpoints); a restart reads one copy of every
    model's state, on the ranks of data-parallel replica 0, which then pass it on (in the baseline's
    favour: ``sim.run.restart_cost`` has every device read all it holds)."""
    read = max(by_node(job, snapshot_bytes_by_gpu(job, plan, every_stage=True)).values()) / storage_bytes_per_s
    write = max(by_node(job, snapshot_bytes_by_gpu(job, plan)).values()) / storage_bytes_per_s
    return RestartRecovery(**{"load_s": read, "checkpoint_s": write, **assumed})


def timeline_from_record(record: RunRecord, samples_per_step: int, nodes: int) -> StepTimeline:
    """A simulated run's steps as phases in the order a synchronous step runs them, scaled to the step's
    time (phases that overlap share it), and the live transition after each step."""
    phases, transitions = [], []
    for s in record.steps:
        named = [(name, float(s["phases"].get(name, 0.0))) for name in PHASE_ORDER]
        total = sum(v for _, v in named)
        scale = s["step_time_s"] / total if total > 0 else 0.0
        phases.append(tuple((name, v * scale) for name, v in named) if total > 0
                      else (("generation", float(s["step_time_s"])),))
        transitions.append(float(s.get("transition_s", 0.0)))
    return StepTimeline(tuple(phases), tuple(transitions), samples_per_step, nodes)
