"""Predicted stage seconds of a published run (``sim.published_runs``): from the cost model, as the planner
and ``nereus estimate`` price a plan, or from the simulator's ground truth, as ``nereus simulate`` runs one.

Both give per-model-stage and per-phase seconds; the published columns follow from them the same way:

- a stage column is its model-stage's time (``t_gen_s`` the rollout, ``t_old_logprob_s`` the actor's
  inference, ``t_ref_s`` the reference's, ``t_values_s`` the critic's, ``t_update_*`` the training stages),
  ``t_weight_sync_s`` the weight-sync phase;
- ``t_step_s``: a synchronous step runs its phases one after another; a one-step-off or fully
  asynchronous one overlaps the rollout with the trainer's inference and training, then syncs weights:
  max(generation, inference + training) + weight sync (verl's one_step_off and fully_async recipes);
- in a colocated row ``t_gen_s`` also holds the weight sync: verl's trainer times ``gen`` around the
  worker's ``generate_sequences``, which enters the rollout sharding manager (reshard the trainer's weights
  into the engine, wake it) before decoding (volcengine/verl, verl/trainer/ppo/ray_trainer.py and
  verl/workers/fsdp_workers.py); the one-step-off rows' notes show the gap (generate_sequences 247 s
  inside gen 321 s);
- in a fully asynchronous row ``t_gen_s`` is the trainer's ``gen`` timer, not the rollout: its wait for
  samples and their assembly into a batch, with what the staleness threshold keeps them short by when the
  trainer is the bottleneck, else generation - (inference + training); ``t_step_s`` is that plus its work,
  the parameter sync outside it (``cost.fully_async``: a version's local steps stream its samples, at
  staleness 0 too; an empty ``staleness`` is verl's default threshold);
- ``tok_per_s_per_gpu``: the step's prompt and response tokens over the step and every GPU of the run;
- every stage call also moves the step's batch, padded to the length caps, through verl's single driver
  (``cost.controller``): its timers ``gen``, ``old_log_prob``, ``ref``, ``values`` and ``update_*`` hold
  that time, and so does each phase of the step. A one-step-off row's ``t_gen_s`` is the rollout worker's
  own ``generate_sequences`` timer (its notes), which does not, though its step waits for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from nereus.control.backend import RunToEnd, StepMetrics
from nereus.cost.controller import controller_time
from nereus.cost.decode import DecodePhases
from nereus.cost.fully_async import (
    LOCAL_STEPS_PER_VERSION,
    queue_assembly_time,
    sample_shortfall,
    trainer_step,
    trainer_wait,
)
from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.cost.verl_weight_sync import SYNC_FLOORS
from nereus.sim.backend import SimBackend, TruthConfig
from nereus.sim.published_runs import PublishedRun, RowSkipped
from nereus.sim.reality import Reality
from nereus.spec.errors import SpecError
from nereus.spec.layout import ModelStage
from nereus.spec.trace import LengthPoint, Trace

STAGE_OF = {"t_gen_s": "actor/generation", "t_old_logprob_s": "actor/inference", "t_ref_s": "reference/inference",
            "t_values_s": "critic/inference", "t_update_actor_s": "actor/training",
            "t_update_critic_s": "critic/training"}
ASYNC_MODES = ("one_step_off", "fully_async", "partial_rollout")
SOURCES = ("cost", "sim")
# The truth's mean for a row is estimated over simulated clusters, each drawing its own hidden efficiencies
# (log-normal, sigma ``sim.backend.TruthConfig.efficiency_spread`` = 0.25), GPU speeds, lengths and noise. Every
# row uses the same seeds, so a factor's sampling error is shared by all rows: over n clusters it is about
# 0.25/sqrt(n), 4.4% at 32 (12.5% at 4: the data set's reference log-prob column read 16.0% there, 21.9% at
# 32; docs/cost-model.md). One step a cluster: its steps share its factors, so more of them add little.
SIM_STEPS = 1  # simulated steps averaged per cluster
SIM_SEEDS = 32  # simulated clusters averaged per row


@dataclass(frozen=True)
class StepTimes:
    stages: dict[str, float]  # model-stage -> seconds
    phases: dict[str, float]  # generation, inference, training, weight_sync -> seconds
    tail_s: float = 0.0  # of the generation, the drain once no queued sequence is left to start
    tail_work_s: float = 0.0  # the drain's tokens at the pace of full slots (``drain_work``)


def cost_times(run: PublishedRun) -> StepTimes:
    """The cost model's times of the run's plan (``nereus estimate``); memory is not checked here: the
    runs fit through offload and sequence parallelism the memory model may not price."""
    est = estimate_plan(Hardware(run.job.cluster), run.job, run.plan)
    decode = est.costs["actor/generation"].decode
    if decode is None:
        return StepTimes(dict(est.stage_times), dict(est.phase_times))
    return StepTimes(dict(est.stage_times), dict(est.phase_times), decode.tail_s,
                     drain_work(decode, run.job.workload.response.mean))


def drain_work(decode: DecodePhases, mean_response: float) -> float:
    """Seconds the tokens decoded in a replica's drain take at the pace of its full slots: its sequences'
    tokens less those the bulk decoded with every slot live, each step ``batch`` tokens in ``bulk_step_s``."""
    if decode.batch <= 0:
        return 0.0
    drained = max(0.0, decode.sequences * mean_response - decode.batch * decode.bulk_steps)
    return drained * decode.bulk_step_s / decode.batch


def sim_times(run: PublishedRun, seeds: int = SIM_SEEDS, steps: int = SIM_STEPS) -> StepTimes:
    """The simulator's ground truth for the run's plan, its mean over ``seeds`` clusters (a published run
    is one draw of a real one): ``steps`` steps each on a one-point trace at the row's lengths, every
    generation run to its end. The truth's driver pass at the row's padded width (``sim.reality``) is
    taken out again, so both sources give device times that ``with_controller`` completes alike."""
    trace, truth = one_point(run, steps), truth_of(run)
    measured = [SimBackend(run.job, trace, seed, truth).run_step(run.plan, step, RunToEnd())
                for seed in range(seeds) for step in range(steps)]
    stages = {k: float(np.mean([without_driver(m, k) for m in measured])) for k in measured[0].stage_times_s}
    phases = {k: float(np.mean([m.phase_times_s[k] - m.detail["driver_s"] * _calls(m, k) for m in measured]))
              for k in measured[0].phase_times_s}
    return StepTimes(stages, phases)


def with_cost_drain(sim: StepTimes, cost: StepTimes) -> StepTimes:
    """The simulator's times with the cost model's drain (``StepTimes.tail_s``, ``tail_work_s``), scaled as
    the simulator's generation is to the cost model's. The simulator reports no drain of that kind: its
    generation's ``tail_s`` is the phase after a tail lever's switch point, which a run to the end barely has,
    and a production taken from it kept nearly the whole rollout."""
    priced = cost.phases.get("generation", 0.0)
    scale = sim.phases.get("generation", 0.0) / priced if priced > 0 else 1.0
    return replace(sim, tail_s=cost.tail_s * scale, tail_work_s=cost.tail_work_s * scale)


def one_point(run: PublishedRun, steps: int) -> Trace:
    """A trace of ``steps`` steps at the row's response lengths."""
    r = run.job.workload.response
    return Trace(run.run_id, "published run", steps, r.sigma, (LengthPoint(0, r.mean, r.max),))


def truth_of(run: PublishedRun) -> TruthConfig:
    """The simulator's truth, its driver's pass at the row's padded width."""
    return TruthConfig(reality=Reality(padded_slots=run.padded_tokens))


def without_driver(m: StepMetrics, name: str) -> float:
    seconds = m.stage_times_s[name]
    return seconds - m.detail["driver_s"] if seconds > 0 else seconds


def _calls(m: StepMetrics, phase: str) -> int:
    return sum(1 for name, t in m.stage_times_s.items() if t > 0 and name.split("/")[1] == phase)


def with_controller(run: PublishedRun, times: StepTimes) -> StepTimes:
    """The times with each stage call's pass through the driver (``cost.controller``) added: to every
    model-stage that runs, and to its phase once per model-stage."""
    moved = driver_seconds(run)
    stages, phases = dict(times.stages), dict(times.phases)
    for name, seconds in times.stages.items():
        if seconds > 0:
            stages[name] = seconds + moved
            phases[name.split("/")[1]] += moved
    return replace(times, stages=stages, phases=phases)


def streams(run: PublishedRun) -> bool:
    """A fully asynchronous run: its rollouter streams samples to a trainer that takes them a local step at
    a time (at staleness 0 too: the threshold bounds how far ahead the rollouter may run, not the stream)."""
    return run.sync_mode in ("fully_async", "partial_rollout")


def queue_assembly(run: PublishedRun) -> float:
    """The fully-async trainer's unpickling and concatenation of the samples it takes from the queue
    (``cost.fully_async.queue_assembly_time``); 0 in every other mode (their driver part is in the stages)."""
    if streams(run):
        return queue_assembly_time(run.job.sequences_per_step(), run.padded_tokens)
    return 0.0


def rollout_production(run: PublishedRun, times: StepTimes) -> float:
    """Seconds a streaming rollouter takes to produce one parameter version's samples. It keeps starting
    queued prompts while earlier ones decode, so only a sync can make it wait for its in-flight samples to
    end; with partial rollout it pauses them there and resumes them after instead (verl's fully_async
    "async stream pipeline with partial rollout", docs/advance/fully_async.md), so it never drains: the
    tokens the drain would decode with its slots emptying are decoded with every slot busy
    (``StepTimes.tail_work_s``), not left out."""
    generation = times.phases["generation"]
    return generation - times.tail_s + times.tail_work_s if run.partial_rollout else generation


def step_seconds(run: PublishedRun, times: StepTimes) -> float:
    p = times.phases
    if streams(run):  # the trainer's step timer: its wait and its work, the parameter sync outside it
        return trainer_step(rollout_production(run, times), queue_assembly(run), p["inference"] + p["training"],
                            run.staleness)
    if run.sync_mode in ASYNC_MODES:
        return max(p["generation"], p["inference"] + p["training"]) + p["weight_sync"]
    return sum(p.values())


@dataclass(frozen=True)
class ColumnPrediction:
    """One predicted column: its value and how it was made, the terms' seconds written out
    (``benchmarks/e2e_validation.py --explain``)."""

    value: float
    how: str


def driver_seconds(run: PublishedRun) -> float:
    """One stage call's pass of the padded batch through verl's driver (``cost.controller``)."""
    return controller_time(run.job.sequences_per_step(), run.padded_tokens)


def predicted(run: PublishedRun, device: StepTimes) -> dict[str, float]:
    """Predicted values of the columns the row publishes that the job has (a stage of a model the row
    does not run is left out); ``device`` are the stages' times without the driver's part."""
    return {c: p.value for c, p in predicted_parts(run, device).items()}


def predicted_parts(run: PublishedRun, device: StepTimes) -> dict[str, ColumnPrediction]:
    """``predicted``, each value with its formula."""
    times, moved = with_controller(run, device), driver_seconds(run)
    p, step = times.phases, step_part(run, times)
    out = {}
    for column in run.published:
        stage = STAGE_OF.get(column)
        if column == "t_gen_s":
            out[column] = generation_part(run, device, times, moved)
        elif stage in times.stages:
            how = f"{stage} {device.stages[stage]:.2f} + driver {moved:.2f}"
            out[column] = ColumnPrediction(times.stages[stage], how)
        elif column == "t_weight_sync_s":
            out[column] = ColumnPrediction(p["weight_sync"], f"{run.plan.weight_sync} {p['weight_sync']:.2f}")
        elif column == "t_step_s":
            out[column] = step
        elif column == "tok_per_s_per_gpu":
            wl, gpus = run.job.workload, run.job.cluster.num_gpus
            tokens = run.job.sequences_per_step() * (wl.prompt_length + wl.response.mean)
            how = f"{tokens:,.0f} tokens / ({step.value:.2f} s step x {gpus} GPUs)"
            out[column] = ColumnPrediction(tokens / (step.value * gpus), how)
    return out


def generation_part(run: PublishedRun, device: StepTimes, times: StepTimes, moved: float) -> ColumnPrediction:
    """``t_gen_s``: what the row's timer wraps in its mode and placement."""
    gen, p = device.stages[STAGE_OF["t_gen_s"]], times.phases
    if run.sync_mode == "one_step_off":
        return ColumnPrediction(gen, f"generation {gen:.2f}; the rollout worker's own generate_sequences timer")
    if streams(run):
        return wait_part(run, times)
    if run.plan.strategy == "colocated":
        how = (f"generation {gen:.2f} + driver {moved:.2f} + weight sync {p['weight_sync']:.2f}; the gen timer "
               "holds the reshard")
        return ColumnPrediction(gen + moved + p["weight_sync"], how)
    return ColumnPrediction(gen + moved, f"generation {gen:.2f} + driver {moved:.2f}")


def wait_part(run: PublishedRun, times: StepTimes) -> ColumnPrediction:
    """A streaming trainer's wait for a version's samples (``cost.fully_async.trainer_wait``); ``times``
    include the driver's part."""
    p = times.phases
    production, assembly, work = rollout_production(run, times), queue_assembly(run), p["inference"] + p["training"]
    shortfall = sample_shortfall(production, work, run.staleness)
    how = (f"max(queue assembly {assembly:.2f} + samples short {shortfall:.2f}, rollout production "
           f"{production:.2f} - trainer work {work:.2f}); staleness threshold {run.staleness:g}, "
           f"{LOCAL_STEPS_PER_VERSION} local steps a version")
    return ColumnPrediction(trainer_wait(production, assembly, work, run.staleness), how)


def step_part(run: PublishedRun, times: StepTimes) -> ColumnPrediction:
    """``t_step_s`` (``step_seconds``) with its formula; ``times`` include the driver's part."""
    p = times.phases
    if streams(run):
        how = (f"trainer wait {wait_part(run, times).value:.2f} + inference {p['inference']:.2f} + training "
               f"{p['training']:.2f}; the weight sync outside it")
        return ColumnPrediction(step_seconds(run, times), how)
    if run.sync_mode in ASYNC_MODES:
        how = (f"max(generation {p['generation']:.2f}, inference and training {p['inference'] + p['training']:.2f}) "
               f"+ weight sync {p['weight_sync']:.2f}")
        return ColumnPrediction(step_seconds(run, times), how)
    how = " + ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in p.items())
    return ColumnPrediction(step_seconds(run, times), how)


def predict(run: PublishedRun, source: str) -> dict[str, float]:
    """The row's predicted columns; ``RowSkipped`` when its plan is one the cost model rejects (a degree
    that does not split the model, a batch that leaves a rank no sequence), with the model's reason."""
    return predicted(*priced(run, source))


def priced(run: PublishedRun, source: str) -> tuple[PublishedRun, StepTimes]:
    """The run as priced and its stages' device times from ``source``. A generation the cost model finds no
    memory for (its time infinite) is the cost model's on both sources: the simulator's truth checks no
    memory of its own, and no real run decodes without its weights. A colocated row that leaves its host
    state unstated gets the room first (``with_room_for_the_rollout``)."""
    try:
        times = cost_times(run)
        roomy = with_room_for_the_rollout(run, times)
        if roomy is not run:
            run, times = roomy, cost_times(roomy)
        if source == "sim" and all(math.isfinite(t) for t in times.stages.values()):
            times = with_cost_drain(sim_times(run), times)
    except SpecError as err:
        raise RowSkipped(f"its plan cannot be priced: {err}") from None
    return run, times


def with_room_for_the_rollout(run: PublishedRun, times: StepTimes | None = None) -> PublishedRun:
    """The run, or, where it is colocated, leaves its host state unstated and its rollout finds no memory
    beside the trainer's resident state, the run with that state offloaded between stages and the
    optimizer swapped in for the update (``sim.published_runs``: the run ran, so the state was off the GPU).
    ``times``: the run's cost-model times, where already priced."""
    if run.offload_stated or run.plan.strategy != "colocated" or run.job.options.offload != "none":
        return run
    if math.isfinite((times or cost_times(run)).stages.get(STAGE_OF["t_gen_s"], 0.0)):
        return run
    return replace(run, job=replace(run.job, options=replace(run.job.options, offload="param+optimizer-swap")))


def floors(run: PublishedRun) -> dict[str, float]:
    """The least seconds any run of the row's plan takes in a column, where physics bounds it: a weight
    sync that broadcasts the whole model to every receiver (``cost.verl_weight_sync.SYNC_FLOORS``). A
    published value below its floor timed something other than its column, so it is not compared."""
    floor = SYNC_FLOORS.get(run.plan.weight_sync)
    if floor is None or "t_weight_sync_s" not in run.published:
        return {}
    train = run.plan.placement(ModelStage("actor", "training"))
    gen = run.plan.placement(ModelStage("actor", "generation"))
    return {"t_weight_sync_s": floor(Hardware(run.job.cluster), run.job, train, gen)}
