"""Where the long-tail traces stand, and what each tail lever could give (``nereus.cost.tail``).

Part 1 (``--sim``): the simulator on whole traces for ``nereus``, ``verl-like`` and ``fixed-oracle``: mean
step, throughput (tokens/s) and its ratio to ``verl-like``, side by side in one run; a policy that stops
(no feasible plan) is reported with the step it reached, and the ratios are then also given over the
steps every policy completed.

Part 2 (always): for sample steps of each trace, the planner's plan for that step's workload priced by
the cost model, then each lever's pricing applied to it: speculative decoding at the best draft length
per live batch (suffix drafts and a draft head at the trace's acceptance), tail batching at the best
over-launch factor (the trace's sibling correlation), partial rollout and one-step asynchrony at one step
of policy lag (the best per-step budget; the best split of the GPUs, training scaled linearly with its
GPUs). Gains are step-time ratios of the cost model; "x verl-like" multiplies the measured ratio of part 1's
``fixed-oracle`` (the best fixed layout, no lever) by the gain, an estimate of the lever alone on that
layout. ``nereus`` chooses levers itself, so its measured ratio already holds theirs and is not multiplied.

    python benchmarks/tail_levers.py [--sim] [--steps 0] [--jobs ppo_8b_h100 grpo_7b_h100] [--traces ...]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

from nereus.cost.decode import Replica, StepModel
from nereus.cost.hardware import Hardware
from nereus.cost.stages import ENGINE_MAX_SEQUENCES, generation_replica
from nereus.cost.tail import speculative as sp
from nereus.cost.tail.async_split import async_step
from nereus.cost.tail.lengths import GroupLengths, RolloutPool
from nereus.cost.tail.partial_rollout import best_budget
from nereus.cost.tail.tail_batching import best_over_launch
from nereus.planner.search import search
from nereus.sim.run import simulate
from nereus.spec import load_job
from nereus.spec.job import JobSpec
from nereus.spec.trace import Trace, load_trace

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("nereus", "verl-like", "fixed-oracle")
TRACES = ("long_tail_dapo", "r1_zero_growth", "deepscaler_stages")
JOBS = ("ppo_8b_h100", "grpo_7b_h100")
TARGETS = {0: 1.6, 1: 2.2}  # the goal: nereus over verl-like at policy lag 0 and 1


@dataclass
class SimResult:
    steps: list[tuple[float, float]]  # (step seconds, tokens) per completed step
    wall_s: float
    error: str = ""

    def over(self, n: int) -> tuple[float, float]:
        """(mean step s, tokens/s) over the first ``n`` completed steps."""
        part = self.steps[:n]
        seconds = sum(s for s, _ in part)
        return seconds / max(1, len(part)), sum(t for _, t in part) / seconds if seconds else 0.0


def run_sim(job: JobSpec, trace: Trace, policy: str, seed: int, steps: int) -> SimResult:
    done: list[tuple[float, float]] = []
    start = time.perf_counter()
    try:
        simulate(job, trace, policy, seed, steps, progress=lambda _s, m, _d: done.append((m.step_time_s, m.tokens)))
    except Exception as exc:  # a policy with no feasible plan stops; report where  # noqa: BLE001
        return SimResult(done, time.perf_counter() - start, f"{type(exc).__name__} at step {len(done)}: {exc}")
    return SimResult(done, time.perf_counter() - start)


def sim_part(job: JobSpec, trace: Trace, seed: int, steps: int) -> float | None:
    """Runs every policy on the trace; prints the table; returns fixed-oracle / verl-like throughput."""
    n = min(steps or trace.steps, trace.steps)
    res = {p: run_sim(job, trace, p, seed, n) for p in POLICIES}
    common = min(len(r.steps) for r in res.values())
    print(f"  simulator, {n} steps (seed {seed}); all policies completed {common}:")
    print(f"  {'policy':<14}{'steps':>6}{'mean step':>11}{'tokens/s':>11}{'x verl':>8}{'x verl (common)':>17}  wall")
    verl_all, verl_common = res["verl-like"].over(len(res["verl-like"].steps)), res["verl-like"].over(common)
    for p, r in res.items():
        mean, tps = r.over(len(r.steps))
        _, tps_c = r.over(common)
        ratio = tps / verl_all[1] if verl_all[1] else math.nan
        ratio_c = tps_c / verl_common[1] if verl_common[1] else math.nan
        print(f"  {p:<14}{len(r.steps):>6}{mean:>10.1f}s{tps:>11.0f}{ratio:>8.2f}{ratio_c:>17.2f}  {r.wall_s:.0f}s"
              + (f"  STOPPED: {r.error[:160]}" if r.error else ""))
    f_tps, v_tps = res["fixed-oracle"].over(common)[1], verl_common[1]
    return f_tps / v_tps if v_tps else None


@dataclass(frozen=True)
class Priced:
    step_s: float
    gen_s: float
    levers: dict[str, float]  # lever -> predicted step seconds


def price_step(job: JobSpec, trace: Trace, step: int) -> Priced:
    """The planner's plan for ``step``'s workload and every lever applied to it (cost model seconds)."""
    resp = trace.response_at(step)
    j = job.with_response(resp)
    hw = Hardware(j.cluster)
    est = search(hw, j).estimate
    gen_cost = est.costs["actor/generation"]
    phases, layout = gen_cost.decode, gen_cost.layout
    gen_s = est.phase_times["generation"]
    rest = est.step_time_s - gen_s
    arch = j.models["actor"]
    replica = generation_replica(hw, arch, layout.tp, j.options.weight_bytes)
    model = StepModel(replica)
    prompt = j.workload.prompt_length
    context = prompt + resp.mean
    scale = gen_s / phases.total_s  # the stage's other terms (PP hand-offs, shared host) scale alike
    levers: dict[str, float] = {}
    for kind, drafter in (("suffix", sp.suffix_drafter()), ("draft_head", sp.draft_head(arch))):
        alpha = trace.acceptance_at(kind, step) or drafter.acceptance.alpha
        levers[f"spec:{kind}"] = rest + scale * sp.generation_seconds(phases, model, drafter, context, 8, alpha)
    slots = phases.batch if phases.sequences > phases.batch else ENGINE_MAX_SEQUENCES
    pool = RolloutPool(replica, layout.dp, slots, prompt)
    g = j.algorithm.samples_per_prompt
    lengths = GroupLengths.of(resp, trace.sibling_correlation, g)
    tb = best_over_launch(pool, lengths, j.workload.prompts_per_step)
    levers["tail batching"] = rest + gen_s / tb.speedup
    pr = best_budget(pool, lengths, j.sequences_per_step(), policy_lag=1)
    levers["partial rollout (lag 1)"] = rest + gen_s / pr.speedup
    sync = est.phase_times["weight_sync"]
    levers["one-step async (lag 1)"] = _async(j, replica, layout.tp, lengths, rest, sync, 1.0)
    # Combinations, as products of the generation speedups (not priced jointly: an upper-bound estimate).
    spec = gen_s / (min(levers["spec:suffix"], levers["spec:draft_head"]) - rest)
    levers["spec + tail batching (lag 0)"] = rest + gen_s / (spec * tb.speedup)
    both = spec * pr.speedup
    levers["spec + partial + async (lag 1)"] = min(rest + gen_s / both,
                                                   _async(j, replica, layout.tp, lengths, rest, sync, both))
    return Priced(est.step_time_s, gen_s, levers)


def _async(job: JobSpec, replica: Replica, tp: int, lengths: GroupLengths, rest: float, sync: float,
           gen_speedup: float) -> float:
    """The best split: generation on g GPUs (g / TP replicas of the plan's rollout replica, its time
    divided by ``gen_speedup`` for levers that act on it), training and inference on the rest, their
    time scaled linearly from the whole cluster's."""
    n = job.cluster.num_gpus
    seqs = job.sequences_per_step()
    q = lengths.response_quantiles()
    best = math.inf
    for g in range(tp, n, max(tp, n // 16)):
        pool = RolloutPool(replica, g // tp, ENGINE_MAX_SEQUENCES, job.workload.prompt_length)
        gen = pool.seconds(seqs, q, lengths.mean, lengths.longest(seqs)) / gen_speedup
        best = min(best, async_step(g, n - g, gen, rest * n / (n - g), sync).step_s)
    return best


def lever_part(job: JobSpec, trace: Trace, ratio_now: float | None) -> None:
    """Prints each lever's gain at sample steps and, given the lever-free ratio to verl-like, its estimate."""
    samples = sorted({0, trace.steps // 2, trace.steps - 1})
    priced = [price_step(job, trace, s) for s in samples]
    print(f"  cost model at steps {samples}: step {', '.join(f'{p.step_s:.0f}' for p in priced)} s, "
          f"generation {', '.join(f'{100 * p.gen_s / p.step_s:.0f}%' for p in priced)} of it")
    print(f"  {'lever':<26}{'gain per step':>28}{'mean':>7}" + ("   x verl-like (est.)" if ratio_now else ""))
    for lever in priced[0].levers:
        gains = [p.step_s / p.levers[lever] for p in priced]
        mean = sum(gains) / len(gains)
        lag = 1 if "lag 1" in lever else 0
        est = f"   {ratio_now * mean:.2f} (target {TARGETS[lag]} at lag {lag})" if ratio_now else ""
        print(f"  {lever:<26}{', '.join(f'{x:.2f}' for x in gains):>28}{mean:>7.2f}{est}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", nargs="*", default=list(JOBS))
    ap.add_argument("--traces", nargs="*", default=list(TRACES))
    ap.add_argument("--sim", action="store_true", help="also run the simulator (minutes per trace)")
    ap.add_argument("--steps", type=int, default=0, help="simulated steps per trace (0: the whole trace)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for job_name in args.jobs:
        job = load_job(ROOT / "examples" / f"{job_name}.yaml")
        for name in args.traces:
            trace = load_trace(ROOT / "traces" / f"{name}.yaml")
            print(f"{job_name} on {name} ({trace.steps} steps, {job.cluster.num_gpus} GPUs)", flush=True)
            ratio = sim_part(job, trace, args.seed, args.steps) if args.sim else None
            lever_part(job, trace, ratio)


if __name__ == "__main__":
    main()
