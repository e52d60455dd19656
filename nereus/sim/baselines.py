"""Baseline policies, each described by what it models. They share the controller's interface so the
simulator (and later the runtime) runs them the same way.

- ``fixed-oracle`` (alias ``fixed-dp``): the planner's best plan for the first step's workload, then its
  TP/PP kept for the whole run; only data parallelism follows the available GPUs. Its initial layout is
  the one Nereus itself would choose, so it is the strongest fixed baseline (an oracle's start).
- ``fixed-recipe``: the paper's "fixed initial layout with DP scaling" as an operator would start it:
  the rollout TP that public example scripts set for that model size (``nereus.sim.recipes``), training
  and inference with sharded data parallelism and no TP/PP as in those scripts (FSDP / ZeRO-3), the
  placement and DP chosen by the planner; then only DP follows the available GPUs.
- ``verl-like``: a colocated hybrid engine — every model-stage on all GPUs, time-sharing them; training
  and inference with FSDP (no TP/PP: verl's default backend); the rollout TP of verl's example script for
  the model size; every step the actor's weights are gathered and resharded into the engine
  (``hybrid-reshard`` in ``nereus.cost.verl_weight_sync``; Sheng et al. 2024, "HybridFlow").
- ``openrlhf-like``: disaggregated placement — the rollout engine, actor, critic, reference and reward
  each on their own GPUs — with ZeRO-3 training and inference (no TP/PP), the rollout TP of OpenRLHF's
  example script, and every step the full weights gathered to one rank and broadcast to the engines
  (``gather-broadcast``; Hu et al. 2024, "OpenRLHF").
- ``realhf-like``: the best plan of the full search space, found once at start for the first step's
  workload and kept (ReaLHF, Mei et al. 2024, searches its plan before training); it moves only when
  GPUs are lost or added, by a fresh search.

All of them re-plan when the current plan no longer fits (memory) or GPUs are lost, as an operator
would after an out-of-memory crash; such moves count as transitions.
"""

from __future__ import annotations

import math
from dataclasses import replace

from nereus.control.backend import ClusterState, Decision, StepMetrics, TransitionMetrics
from nereus.control.controller import Controller, ControllerConfig, TransitionCost, usable_gpus
from nereus.control.forecast import LengthSchedule
from nereus.control.pools import PoolRule, split_constraints
from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.planner.search import Constraints, SearchResult, search
from nereus.sim.recipes import fixed_recipe_tp, system_recipe_tp
from nereus.spec.errors import InfeasibleError
from nereus.spec.generation import GenerationDecision, GenerationStatus
from nereus.spec.job import JobSpec
from nereus.spec.layout import Layout, ModelStage, Plan
from nereus.spec.levers import Speculation, TailBatching
from nereus.spec.parallel_dims import tp_splits

ROLLOUT = ModelStage("actor", "generation")


class StaticPolicy:
    """Keeps its plan; when the GPU count changes it re-searches, with TP/PP pinned (``pin_tp_pp``: only
    DP follows) or freely (a fresh search, as after a restart); otherwise it moves only when forced.

    ``rollout_tp``: the rollout engine's TP set by hand (a recipe); when the model's heads or the memory
    refuse it, the nearest TP that works, as an operator would after the first error. ``weight_sync``: the
    system's per-step weight-sync mechanism (``nereus.cost.weight_sync``), recorded on every plan."""

    def __init__(self, name: str, job: JobSpec, constraints: Constraints | None, pin_tp_pp: bool,
                 schedule: LengthSchedule | None = None, transition_cost: TransitionCost | None = None,
                 rollout_tp: int | None = None, weight_sync: str = "direct") -> None:
        self.name, self.job, self.pin_tp_pp = name, job, pin_tp_pp
        self.rollout_tp, self.weight_sync = rollout_tp, weight_sync
        # A controller with calibration off does the bookkeeping (forecast, feasibility, transition cost).
        self.inner = Controller(job, ControllerConfig(calibrate=False), schedule, None, transition_cost, constraints)
        self.base_constraints = constraints or Constraints()
        self.pinned: dict[ModelStage, tuple[int, int]] = {}

    def _tag(self, plan: Plan) -> Plan:
        """``plan`` with this system's weight sync, which the bookkeeping controller then holds."""
        tagged = replace(plan, weight_sync=self.weight_sync)
        self.inner.resume(tagged)
        return tagged

    def initial_plan(self, num_gpus: int) -> Plan:
        if self.rollout_tp is None:
            plan = self.inner.initial_plan(num_gpus)
        else:
            plan = self._recipe_plan(num_gpus)
        self.pinned = {p.model_stage: (p.layout.tp, p.layout.pp) for p in plan.placements}
        return self._tag(plan)

    def _recipe_plan(self, num_gpus: int) -> Plan:
        """The best plan whose rollout runs at the recipe's TP (PP 1); if none fits, at the nearest TP
        that does (ties: the larger)."""
        arch = self.job.models["actor"]
        tps = [t for t in range(1, self.job.cluster.gpus_per_node + 1) if tp_splits(arch, t)]
        base, err = self.base_constraints, None
        for tp in sorted(tps, key=lambda t: (abs(t - self.rollout_tp), -t)):
            def at_tp(ms: ModelStage, layout: Layout, tp: int = tp) -> bool:
                pinned = ms != ROLLOUT or (layout.tp, layout.pp) == (tp, 1)
                return pinned and (base.layout_filter is None or base.layout_filter(ms, layout))

            self.inner.constraints = Constraints(base.strategies, at_tp, base.capability)
            try:
                return self.inner.initial_plan(num_gpus)
            except InfeasibleError as e:
                err = e
            finally:
                self.inner.constraints = base
        raise InfeasibleError(err.model_stage, err.needed_bytes, err.capacity_bytes,
                              f"{self.name}: no rollout TP fits; at the recipe's: {err}")

    def _constraints(self) -> Constraints:
        if not self.pin_tp_pp:
            return self.base_constraints
        base = self.base_constraints.layout_filter

        def keep_tp_pp(ms: ModelStage, layout: Layout) -> bool:
            ok = (layout.tp, layout.pp) == self.pinned.get(ms, (layout.tp, layout.pp))
            return ok and (base is None or base(ms, layout))

        strategy = self.inner.plan.strategy if self.inner.plan else None
        strategies = (strategy,) if strategy else self.base_constraints.strategies
        return Constraints(strategies, keep_tp_pp)

    def after_step(self, m: StepMetrics, cluster: ClusterState) -> Decision:
        inner = self.inner
        inner.forecaster.observe(m.step, m.response_mean)
        gpus = usable_gpus(cluster.num_gpus, self.job.cluster.gpus_per_node)
        step = m.step + 1
        job = inner.job_for(step, max(gpus, inner.plan.num_gpus))
        lost = inner.plan.num_gpus > gpus
        current = None if lost else estimate_plan(Hardware(job.cluster), job, inner.plan)
        grow = gpus != inner.plan.num_gpus
        if not (lost or grow or not current.feasible):
            d = Decision(m.step, "keep", "static layouts", current_s=current.step_time_s)
            inner.log.append(d)
            return d
        target = inner.job_for(step, gpus)
        result = self._search(target)
        cost = inner.transition_cost(inner.hw, target, inner.plan, result.plan)
        action = "transition" if current is not None and current.feasible else "forced"
        reason = ("plan infeasible or GPUs lost" if action == "forced"
                  else "GPU count changed: DP follows it" if self.pin_tp_pp else "GPU count changed: new search")
        d = Decision(m.step, action, reason, current.step_time_s if current else math.inf,
                     result.estimate.step_time_s, 0.0, cost, 0, plan=self._tag(result.plan))
        inner.log.append(d)
        return d

    def _search(self, target: JobSpec) -> SearchResult:
        """The best plan for ``target`` at its pinned TP/PP; when those no longer fit, an operator picks new
        layouts the system's recipe allows, and when none of those fits (a grown job's longer responses),
        any layout its strategies and runtime allow, as after the first out-of-memory error."""
        hw, base = Hardware(target.cluster), self.base_constraints
        try:
            return search(hw, target, None, constraints=self._constraints())
        except InfeasibleError as err:
            refused = err
        for relaxed in (base, Constraints(base.strategies, None, base.capability)):
            try:
                result = search(hw, target, None, constraints=relaxed)
            except InfeasibleError as err:
                refused = err
                continue
            self.pinned = {p.model_stage: (p.layout.tp, p.layout.pp) for p in result.plan.placements}
            return result
        raise refused

    def transition_done(self, old: Plan, new: Plan, tm: TransitionMetrics) -> None:
        self.inner.transition_done(old, new, tm)

    def resume(self, plan: Plan) -> None:
        self._tag(plan)
        self.pinned = {p.model_stage: (p.layout.tp, p.layout.pp) for p in plan.placements}

    def survivor_plan(self, num_gpus: int, step: int) -> Plan:
        """After devices died mid-step: the same re-search as after a loss between steps."""
        return self._tag(self._search(self.inner.job_for(step, num_gpus)).plan)

    def during_generation(self, status: GenerationStatus) -> GenerationDecision:
        """Inside the step: none of these systems decides anything; the stage runs to its end."""
        return self.inner.during_generation(status)

    @property
    def log(self) -> list[Decision]:
        return self.inner.log


def _sharded_data_parallel(ms: ModelStage, layout: Layout) -> bool:
    """FSDP / ZeRO-3 data parallelism without TP or PP for every stage but the rollout engine."""
    return ms.stage == "generation" or (layout.tp == 1 and layout.pp == 1 and (layout.fsdp or layout.dp == 1))


def _with_fsdp(job: JobSpec) -> JobSpec:
    return replace(job, options=replace(job.options, fsdp=True))


def _verl_job(job: JobSpec) -> JobSpec:
    """verl's FSDP backend as its example scripts run it: every trained model with gradient checkpointing
    (``actor_rollout_ref.model.enable_gradient_checkpointing=True`` and
    ``critic.model.enable_gradient_checkpointing=True`` in examples/ppo_trainer/run_deepseek7b_llm.sh, the
    PPO recipe of ``nereus.sim.recipes``): HF checkpointing keeps each decoder layer's input and
    recomputes the layer in backward, i.e. full recompute (``nereus.cost.memory``). Without it, the
    20k-token responses of the long-tail traces leave no training layout that fits."""
    return replace(job, options=replace(job.options, fsdp=True, recompute="full"))


def _params_b(job: JobSpec) -> float:
    return job.models["actor"].params() / 1e9


def make_policy(name: str, job: JobSpec, schedule: LengthSchedule | None = None, total_steps: int | None = None,
                transition_cost: TransitionCost | None = None,
                config: ControllerConfig | None = None, policy_lag: int = 0):
    """``nereus`` (adaptive between and inside steps, calibrated; its levers within ``policy_lag``),
    ``nereus-interstep`` (between steps only), ``nereus-nocal``, or a baseline by name (see the module doc)."""
    if name in INTRASTEP:
        return _phased(name, job, schedule, total_steps, transition_cost, config, policy_lag)
    if name == "nereus-interstep":
        policy = Controller(job, config, schedule, total_steps, transition_cost)
        policy.name = name
        return policy
    if name == "nereus-nocal":
        cfg = ControllerConfig(**{**(config or ControllerConfig()).__dict__, "calibrate": False})
        policy = Controller(job, cfg, schedule, total_steps, transition_cost)
        policy.name = name
        return policy
    name = ALIASES.get(name, name)
    if name not in BASELINES:
        raise ValueError(f"unknown policy {name!r}; choose one of {list(POLICIES)}")
    alg, size = job.algorithm.name, _params_b(job)
    sharded = Constraints(None, _sharded_data_parallel)
    baselines = {  # job, constraints, pin TP/PP, rollout TP, weight sync
        "fixed-oracle": (job, None, True, None, "direct"),
        "fixed-recipe": (_with_fsdp(job), sharded, True, fixed_recipe_tp(size)[0], "direct"),
        "verl-like": (_verl_job(job), Constraints(("colocated",), _sharded_data_parallel), True,
                      system_recipe_tp("verl", alg, size)[0], "hybrid-reshard"),
        "openrlhf-like": (_with_fsdp(job), Constraints(("disaggregated",), _sharded_data_parallel), True,
                          system_recipe_tp("OpenRLHF", alg, size)[0], "gather-broadcast"),
        "realhf-like": (job, None, False, None, "direct"),
    }
    base_job, constraints, pin_tp_pp, rollout_tp, sync = baselines[name]
    return StaticPolicy(name, base_job, constraints, pin_tp_pp, schedule, transition_cost, rollout_tp, sync)


def _phased(name: str, job: JobSpec, schedule, total_steps, transition_cost, config, policy_lag: int = 0):
    """Policies that decide inside the step (``control.intrastep``, ``control.tail_policy``): ``nereus`` (the
    controller between steps; inside, the cost model's choice of a tail layout or speculative decoding),
    ``pat-like`` (verl-like static layouts, PAT's TP switch when the batch has drained), ``rlhfuse-like``
    (fixed-oracle static layouts, the tail packed onto few instances and inference started on the GPUs
    freed), ``spec-like`` (verl-like static layouts, speculation of one fixed configuration below a fixed
    live batch: ``SPEC_LIKE``), ``april-like`` (verl-like static layouts, a fixed partial-rollout budget)."""
    from nereus.control.intrastep import NereusTail, NoTail, PatTail, PhasedPolicy, RlhfuseTail
    from nereus.control.tail_policy import (
        FixedAsync,
        FixedPartialRollout,
        FixedSpeculation,
        FixedTailBatching,
        NereusLevers,
    )

    if name in ("nereus", "nereus-tail"):  # nereus-tail: tail layouts only, no levers (an ablation)
        return PhasedPolicy(name, Controller(job, config, schedule, total_steps, transition_cost), NereusTail(),
                            levers=NereusLevers() if name == "nereus" else None, policy_lag=policy_lag,
                            pools=PoolRule() if name == "nereus" else None)
    inner = make_policy("fixed-oracle" if name == "rlhfuse-like" else "verl-like", job, schedule, total_steps,
                        transition_cost, config)
    if name == "spec-like":
        return PhasedPolicy(name, inner, NoTail(), levers=FixedSpeculation(SPEC_LIKE))
    if name == "verl-async-like":
        return PhasedPolicy(name, _verl_async(job, schedule, transition_cost), NoTail(), levers=FixedAsync(),
                            policy_lag=1)
    if name == "rollpacker-like":
        return PhasedPolicy(name, inner, NoTail(), levers=FixedTailBatching(ROLLPACKER_LIKE))
    if name == "april-like":
        return PhasedPolicy(name, inner, NoTail(), levers=FixedPartialRollout(lag=1), policy_lag=1)
    return PhasedPolicy(name, inner, PatTail() if name == "pat-like" else RlhfuseTail())


def _verl_async(job: JobSpec, schedule: LengthSchedule | None, transition_cost: TransitionCost | None) -> StaticPolicy:
    """verl's one-step-off recipe as a static policy: the rollout alone on half the GPUs (a fixed split set
    once; verl's recipe takes both pools' sizes from its config, the half is ours), every other model on
    the rest with verl's FSDP and gradient checkpointing, verl's rollout TP, and the weights sent from
    the training pool to the rollout pool each step (``gather-broadcast``: verl's NCCL broadcast)."""
    alg, size = job.algorithm.name, _params_b(job)
    half = split_constraints(job, job.cluster.num_gpus // 2, _sharded_data_parallel)
    return StaticPolicy("verl-async-like", _verl_job(job), half, True,
                        schedule, transition_cost, system_recipe_tp("verl", alg, size)[0], "gather-broadcast")


# april-like: partial rollout (APRIL, arXiv 2509.18521: unfinished responses carried to the next step
# instead of waiting for them) at the smallest per-step budget that keeps every trained token at most one
# step old (half the longest response), on verl-like's layouts; the budget is fixed, not priced.
# spec-like's fixed rule, as an operator configures vLLM's model-free speculation once for a rollout: n-gram
# (prompt-lookup) drafts with num_speculative_tokens 5 (the n-gram example of vLLM's speculative-decoding
# docs), disabled above a fixed live batch (vLLM's disable_by_batch_size; TLT, arXiv 2511.16665, and
# FastGRPO, arXiv 2509.21792, switch speculation by batch size the same way). The threshold, 32 live
# sequences per replica, is ours: a fixed value set once, not priced per job.
SPEC_LIKE = Speculation("ngram", 5, 32)
# rollpacker-like: RollPacker's tail batching (arXiv 2509.21009): launch more prompt groups than a step
# trains, keep the first to end, defer the rest whole to dedicated long rounds; on verl-like's layouts. The
# over-launch factor, 1.5, is ours (fixed, not priced).
ROLLPACKER_LIKE = TailBatching(1.5)


BASELINES = ("fixed-oracle", "fixed-recipe", "verl-like", "openrlhf-like", "realhf-like")
INTRASTEP = ("nereus", "nereus-tail", "pat-like", "rlhfuse-like", "spec-like", "rollpacker-like", "april-like",
             "verl-async-like")
ALIASES = {"fixed-dp": "fixed-oracle"}  # the name fixed-oracle had before the recipe baseline existed
POLICIES = ("nereus", "nereus-tail", "nereus-interstep", "nereus-nocal", *BASELINES, "pat-like", "rlhfuse-like",
            "spec-like", "rollpacker-like", "april-like", "verl-async-like", *ALIASES)
