"""Adaptation inside the step, measured: every policy on every repo trace in one run.

Generation runs at sequence granularity in the simulator's ground truth (``cost.generation``: each step's
lengths drawn from the trace, slots refilled, the tail drained) for every policy alike. Per trace it prints
each policy's mean step latency, its change against ``fixed-oracle``, its throughput (tokens/s) against
``verl-like``, and where the generation stage's time went: bulk (until the tail begins: the move's trigger,
or 10% of the sequences left without one), migration (the pause for a mid-step move), tail, the inference
seconds run early on GPUs the tail freed, and the share of GPU-time idle during generation. For the policies
that move inside the step: moves run, refused, and predicted vs realised gain and migration cost.

    python benchmarks/long_tail.py [--steps 200] [--seed 0] [--traces long_tail_dapo ...] [--policies ...]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from nereus.sim.run import simulate
from nereus.spec import load_job
from nereus.spec.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("nereus", "nereus-interstep", "pat-like", "rlhfuse-like", "fixed-oracle", "fixed-recipe", "verl-like",
            "openrlhf-like")
LONG_TAIL = ("long_tail_dapo", "deepscaler_stages", "r1_zero_growth")  # the long-tail traces the target is set on


def run_trace(job, name: str, policies: tuple[str, ...], seed: int, steps: int | None) -> dict[str, dict]:
    trace = load_trace(ROOT / "traces" / f"{name}.yaml")
    first = trace.gpus_at(0, job.cluster.num_gpus)
    biggest = max([first, *(n for _, n in trace.gpus)])
    n = min(steps or trace.steps, trace.steps)
    print(f"trace {name}: {n} of {trace.steps} steps, {first}..{biggest} GPUs")
    out = {}
    for p in policies:
        start = time.perf_counter()
        record = simulate(job.with_gpus(biggest), trace, p, seed, n, initial_gpus=first)
        s, g = record.summary(), record.generation_summary()
        step_gpu_s = sum(st["step_time_s"] * st["gpus"] for st in record.steps)
        out[p] = {**s, **{f"gen_{k}": v for k, v in g.items()},
                  "idle_share": sum(st.get("generation", {}).get("idle_gpu_s", 0.0) for st in record.steps)
                  / step_gpu_s if step_gpu_s else 0.0, "sim_s": time.perf_counter() - start}
    return out


def report(name: str, res: dict[str, dict]) -> None:
    oracle, verl = res.get("fixed-oracle"), res.get("verl-like")
    print(f"  {'policy':<17}{'mean step':>10}{'vs oracle':>10}{'vs verl':>9}{'bulk':>8}{'migr':>7}{'tail':>8}"
          f"{'overlap':>8}{'idle':>7}  moves (refused)  gain pred/real  migration pred/real")
    for p, s in res.items():
        vs_o = f"{100 * (s['mean_step_s'] / oracle['mean_step_s'] - 1):+.1f}%" if oracle else "-"
        vs_v = f"{s['tokens_per_s'] / verl['tokens_per_s']:.2f}x" if verl else "-"
        moves = (f"{s['gen_moved']:>5} ({s['gen_refused']})   "
                 f"{s['gen_predicted_gain_s']:6.2f}/{s['gen_realised_gain_s']:6.2f} s   "
                 f"{s['gen_predicted_migration_s']:.3f}/{s['gen_realised_migration_s']:.3f} s"
                 if s["gen_planned"] else "")
        print(f"  {p:<17}{s['mean_step_s']:9.2f}s{vs_o:>10}{vs_v:>9}{s['gen_bulk_s']:7.1f}s{s['gen_migration_s']:6.2f}s"
              f"{s['gen_tail_s']:7.1f}s{s['gen_overlap_s']:7.2f}s{100 * s['idle_share']:6.1f}%  {moves}"
              f"  [{s['sim_s']:.0f} s]", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", default=str(ROOT / "examples" / "ppo_8b_h100.yaml"))
    ap.add_argument("--steps", type=int, default=200, help="steps per trace (0: the whole trace)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--traces", nargs="*", default=sorted(p.stem for p in (ROOT / "traces").glob("*.yaml")))
    ap.add_argument("--policies", nargs="*", default=list(POLICIES))
    args = ap.parse_args()
    job = load_job(args.job)
    goal = []
    for name in args.traces:
        res = run_trace(job, name, tuple(args.policies), args.seed, args.steps or None)
        report(name, res)
        if name in LONG_TAIL and {"nereus", "fixed-oracle", "verl-like"} <= res.keys():
            n, o, v = res["nereus"], res["fixed-oracle"], res["verl-like"]
            beats = all(n["mean_step_s"] < res[p]["mean_step_s"] for p in ("pat-like", "rlhfuse-like") if p in res)
            goal.append((name, 100 * (1 - n["mean_step_s"] / o["mean_step_s"]),
                         n["tokens_per_s"] / v["tokens_per_s"], beats))
    if goal:
        print("goal on the long-tail traces (>= 25% below fixed-oracle, >= 1.4x verl-like, "
              "beats pat-like and rlhfuse-like):")
        for name, lower, thr, beats in goal:
            print(f"  {name:<20} {lower:+.1f}% lower step latency  {thr:.2f}x verl-like throughput  "
                  f"beats pat-like and rlhfuse-like: {'yes' if beats else 'no'}")


if __name__ == "__main__":
    main()
