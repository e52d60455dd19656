"""The Ray runtime as the control loop's backend (``control.backend.Backend``): ``run_step`` wraps one
step of the RL job, ``apply_transition`` moves every model's weights and Adam state live, ``cluster``
lets workers join (by the availability schedule or ``nereus scale N``), and ``recover`` continues on the
survivors when workers die mid-step. The backend owns the runtime placements of every model-stage; the
job reads them from it (``placed``) and never rewrites them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType

from nereus.control.backend import (
    ClusterState,
    GenerationPolicy,
    RecoveryMetrics,
    StepMetrics,
    SurvivorPlanner,
    TransitionMetrics,
    WorkersLost,
)
from nereus.cost.generation import ROLLOUT
from nereus.cost.hardware import Hardware
from nereus.elastic.schedule import schedule_graph
from nereus.run.driver import RLStep
from nereus.run.records import read_scale_request
from nereus.run.setup import Placed, placed_from_plan
from nereus.runtime.cluster.workers import Runtime
from nereus.runtime.hosts.nodes import PlacementError
from nereus.runtime.model.decoder import ModelConfig
from nereus.runtime.recovery.failover import WorkerLostError
from nereus.runtime.transitions.live import KeySpec, MoveResult
from nereus.spec.errors import SpecError
from nereus.spec.generation import GenerationEntry
from nereus.spec.job import JobSpec
from nereus.spec.layout import Plan
from nereus.spec.levers import GenerationLevers

# the driver's timers (verl's names) that measure each model-stage
STAGE_TIMERS: Mapping[str, str] = MappingProxyType({
    "actor/generation": "gen", "actor/inference": "old_log_prob", "reference/inference": "ref",
    "critic/inference": "values", "reward/inference": "reward", "critic/training": "update_critic",
    "actor/training": "update_actor"})


def step_metrics(step: int, metrics: dict, gpus: int, generation: tuple[GenerationEntry, ...] = (),
                 levers: GenerationLevers | None = None) -> StepMetrics:
    """The controller's view of a step of the RL job; the job's whole metric line rides along as ``detail``,
    the decisions taken inside its generation as ``generation``, the plan's levers it ran under as
    ``levers``."""
    stages = {ms: metrics[f"timing_s/{t}"] for ms, t in STAGE_TIMERS.items() if metrics.get(f"timing_s/{t}", 0) > 0}
    phases = {"generation": 0.0, "inference": 0.0, "training": 0.0}
    for ms, t in stages.items():
        phases[ms.split("/")[1]] += t
    phases["weight_sync"] = metrics.get("timing_s/update_weights", 0.0)
    rows = metrics.get("perf/total_num_tokens", 0.0) / max(1.0, metrics["response_length/mean"]
                                                           + metrics.get("prompt_length/mean", 0.0))
    return StepMetrics(step, stages, phases, metrics["timing_s/step"], metrics["response_length/mean"],
                       metrics["response_length/max"], int(round(rows)), metrics.get("perf/total_num_tokens", 0.0),
                       gpus=gpus, detail=metrics, generation=generation, levers=levers,
                       sibling_correlation=metrics.get("response_length/sibling_correlation"),
                       length_sigma=metrics.get("response_length/log_std"))


def plan_text(plan: Plan) -> str:
    return "; ".join(f"{p.model_stage} {p.layout.short()} @{','.join(map(str, p.gpus))}" for p in plan.placements)


class RuntimeBackend:
    """Steps, transitions, joins and recoveries of one RL job on the Ray runtime ``rt``."""

    def __init__(self, job: JobSpec, rt: Runtime, cfgs: dict[str, ModelConfig], rl_step: RLStep,
                 placed: list[Placed], plan: Plan, say: Callable[[str], None]) -> None:
        self.job, self.rt, self.cfgs, self.rl_step, self.say = job, rt, cfgs, rl_step, say
        self.adaptive = job.run.adapt is not None
        self.placed, self.plan = placed, plan
        self.scale_file = None  # set by the job: where `nereus scale N --dir RUN` asks for N workers
        self.requested: int | None = None
        self.carry: dict[str, float] = {}  # metrics the next completed step's line adds (snapshot, recovery)

    # ----- what the job may use ----------------------------------------------------------------------
    def available(self, step: int) -> int:
        """Workers available at ``step``: a ``nereus scale`` request wins over the availability schedule."""
        if not self.adaptive:
            return self.job.run.workers
        if self.scale_file is not None:  # strict: a FIFO or a directory there must not stop the run
            requested, why = read_scale_request(self.scale_file)
            if why is not None:
                print(f"nereus: {why}", file=sys.stderr)
            self.requested = requested if requested is not None else self.requested
        default = self.job.run.adapt.workers_at(step, self.job.run.workers)
        return self.requested if self.requested is not None else default

    def cluster(self, step: int) -> ClusterState:
        """Joining workers enter the world now (plans use them once worth it). A scheduled leave is not a
        loss: the controller moves off the leaving workers first; failures surface as ``WorkersLost``."""
        n = self.available(step)
        if n > len(self.rt.workers):
            self.say(f"  workers: {len(self.rt.workers)} -> {n} (joining)")
            try:
                self.rt.resize(n)
            except PlacementError as err:  # the cluster cannot host them now (a lost node): keep those it has
                self.say(f"  workers stay at {len(self.rt.workers)}: {err}")
                n = len(self.rt.workers)
                if self.requested is not None:  # a `nereus scale` request that cannot be placed is dropped
                    self.requested = n
        return ClusterState(n)

    # ----- steps ---------------------------------------------------------------------------------------
    def run_step(self, plan: Plan, step: int, policy: GenerationPolicy) -> StepMetrics:
        if plan != self.plan:
            raise ValueError("run_step: the plan is not the one the runtime holds; apply_transition moves to it")
        self._snapshot_if_due(step)
        t0 = time.perf_counter()
        try:
            ran = self.rl_step.run_step(step, policy, plan.levers)
        except WorkerLostError as err:
            raise WorkersLost(step, err.lost, time.perf_counter() - t0, str(err)) from err
        metrics, generation = ran.metrics, ran.generation
        metrics["nereus/snapshot_s"] = 0.0
        metrics.update(self.carry)
        self.carry = {}
        levers = plan.levers if plan.levers is not None and plan.levers.any else None
        m = step_metrics(step, metrics, len(self.rt.workers), generation, levers)
        stages = {str(ms) for ms in plan.model_stages()}  # GRPO's rule reward is timed as "reward", no model-stage
        return replace(m, stage_times_s={ms: t for ms, t in m.stage_times_s.items() if ms in stages},
                       response_lengths=ran.response_lengths)

    def _use(self, plan: Plan, placed: list[Placed]) -> None:
        self.plan, self.placed = plan, placed
        self.rl_step.use(placed)

    def specs(self, placed: list[Placed]) -> list[KeySpec]:
        return [KeySpec(p.key, p.model, p.stage, self.cfgs[p.model], p.layout, p.ranks) for p in placed]

    def apply_transition(self, old: Plan, new: Plan, step: int) -> TransitionMetrics:
        """Move the runtime from ``old`` to ``new`` after step ``step``. The next step's snapshot is taken
        first, so a worker lost in the move costs the move only (``WorkersLost`` for step ``step + 1``)."""
        self._snapshot_if_due(step + 1)
        t0 = time.perf_counter()
        placed = placed_from_plan(new, self.job)
        try:
            out = self._move_to(new, placed)
        except WorkerLostError as err:
            raise WorkersLost(step + 1, err.lost, time.perf_counter() - t0, str(err)) from err
        keep = self.available(step + 1)
        if keep < len(self.rt.workers):  # workers the schedule takes away leave once the state is off them
            self.rt.resize(keep)
        self._use(new, placed)
        detail = {"executor_s": out.wall_s, **self._rebuild_engines(old, new)}
        world_job = self.job.with_gpus(len(self.rt.workers))
        predicted = schedule_graph(out.graph, Hardware(world_job.cluster)).makespan_s
        moved = sum(w.bytes_received for w in out.workers)
        return TransitionMetrics(time.perf_counter() - t0, predicted, moved, detail)

    def _move_to(self, new: Plan, placed: list[Placed]) -> MoveResult:
        if new.num_gpus > len(self.rt.workers):
            self.rt.resize(new.num_gpus)
        return self.rt.transition(self.specs(placed), self.job)

    def _snapshot_if_due(self, step: int) -> None:
        """Step ``step``'s host-memory snapshot, once (a redone step reports the snapshot it redoes from)."""
        every = self.job.run.snapshot_every
        if every and step % every == 0 and self.rt.latest_snapshot_step != step:
            self.carry["nereus/snapshot_s"] = self.rt.snapshot(step)

    def _rebuild_engines(self, old: Plan, new: Plan) -> dict[str, float]:
        """With an engine that restarts on a move (``EngineTraits.restarts_on_move``: vLLM), a move of the
        actor's generation stage (engine TP or replica count, or its devices) closes its engines and opens
        them on the new layout, loaded with the moved weights: a device that held an engine of the same TP
        keeps it running (``engines.pool``), the others start one (``cost.transition.engines_rebuilt`` prices
        those); the seconds that took and the counts."""
        gen = str(ROLLOUT)
        if not self.job.run.rollout_engine.traits.restarts_on_move or old.placement(gen) == new.placement(gen):
            return {}
        t0 = time.perf_counter()
        self.rt.close_engine(self.rl_step.keys["actor", "generation"])
        opened = self.rl_step.open_engine()
        return {"engine_start_s": time.perf_counter() - t0, "engines_started": float(opened.started),
                "engines_reused": float(opened.reused)}

    # ----- losses --------------------------------------------------------------------------------------
    def recover(self, lost: WorkersLost, plan_for: SurvivorPlanner) -> RecoveryMetrics:
        """The survivors re-form a world, take the plan ``plan_for`` gives for them, and rebuild every
        model's state from live replicas and the host-memory snapshot (``Runtime.recover``)."""
        if not self.job.run.snapshot_every:
            raise SpecError("run.checkpoint.snapshot_every", f"{lost}; without host-memory snapshots the run cannot "
                            "continue: set snapshot_every ≥ 1, or resume from the last checkpoint (--resume)") from lost
        self.say(f"\n  step {lost.step + 1}: {lost}; recovering on the survivors")
        chosen: dict = {}

        def place(n: int) -> list[KeySpec]:
            step = self.rt.snapshot_step
            if self.adaptive:  # no more than the availability schedule grants
                n = min(n, self.available(step))
            chosen["plan"] = plan_for(n, step)
            chosen["placed"] = placed_from_plan(chosen["plan"], self.job)
            return self.specs(chosen["placed"])

        out = self.rt.recover(place, lost.lost)
        self._use(chosen["plan"], chosen["placed"])
        # the re-formed world closed the rollout engines: opened on the new layout, a survivor's idle one reused
        opened = self.rl_step.open_engine()
        if opened is not None:
            self.carry.update({"nereus/engines_started": float(opened.started),
                               "nereus/engines_reused": float(opened.reused)})
        if self.adaptive and self.plan.num_gpus < len(self.rt.workers):
            self.rt.resize(self.plan.num_gpus)  # survivors beyond what the schedule grants leave
        self.carry.update({"nereus/recovery_s": out.wall_s, "nereus/lost_work_s": lost.elapsed_s,
                           "nereus/lost_workers": float(len(out.lost))})
        return RecoveryMetrics(out.resume_step, self.plan, out.wall_s, out.to_dict())
