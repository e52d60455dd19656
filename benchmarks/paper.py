"""The reference paper's three experiments, re-run in the simulator side by side, on traces built from
published data (traces/*.yaml cite their sources). Every figure below is measured in this run.

(a) mean step latency, online TP/PP adaptation vs a fixed initial TP/PP with DP scaling (paper: −27.7%);
(b) a 1,000-step run growing to 1,024 GPUs: transitions and their share of run time (paper: 6, 0.079%);
(c) 8B PPO throughput against verl-like and OpenRLHF-like policies on three cluster shapes
    (paper: 1.10–1.47× and 2.14–7.27×).

Each experiment is measured against both fixed baselines (docs/simulator.md): ``fixed-oracle`` starts from
the planner's own best plan, ``fixed-recipe`` from the rollout TP that public verl/OpenRLHF example scripts
set for the model size; both then scale DP only. Each runs under two batch assumptions: a fixed global
batch (the job's prompts per step at every GPU count, as published runs set it) and a batch that grows
with the GPUs (the job's prompts per GPU on its own cluster kept as GPUs come and go). ``nereus`` adapts
between and inside steps; ``nereus-interstep`` only between steps (the paper's setting); ``nereus-nocal``
between steps without calibration, to show what calibration contributes.

    python benchmarks/paper.py [--seed 0] [--quick] [--plots docs/img]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from nereus.sim.report import plot_runs
from nereus.sim.run import simulate
from nereus.sim.workload import GrowingBatchJob
from nereus.spec import load_job
from nereus.spec.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent
FIXED = ("fixed-oracle", "fixed-recipe")
OURS = ("nereus", "nereus-interstep", "nereus-nocal")  # nereus adapts inside the step too (docs/adaptation.md)


def run(job, trace_name: str, policy: str, seed: int, steps: int | None, gpus: int | None = None):
    trace = load_trace(ROOT / "traces" / f"{trace_name}.yaml")
    first = gpus or trace.gpus_at(0, job.cluster.num_gpus)
    biggest = max([first, *(n for _, n in trace.gpus)])
    start = time.perf_counter()
    record = simulate(job.with_gpus(biggest), trace, policy, seed, steps, initial_gpus=first)
    s = record.summary()
    print(f"    {policy:<14} mean step {s['mean_step_s']:8.2f} s  tokens/s {s['tokens_per_s']:>10,.0f}  "
          f"transitions {s['transitions']:>2} ({100 * s['transition_share']:.3f}% of run)  "
          f"controller {1000 * s['controller_overhead_s_per_step']:.1f} ms/step  [{time.perf_counter() - start:.0f} s]",
          flush=True)
    return record


def pct(a: float, b: float) -> str:
    return f"{100 * (a / b - 1):+.1f}%"


def experiment_a(jobs: dict, seed: int, quick: bool, rows: list) -> dict:
    print("(a) online TP/PP adaptation vs fixed initial TP/PP with DP scaling (paper: -27.7% mean step latency)")
    first = {}
    for name, steps, gpus in (("growth_from_16", 200 if quick else None, None),
                              ("deepscaler_stages", 200 if quick else None, 64),
                              ("long_tail_dapo", 150 if quick else None, 64)):
        for batch, job in jobs.items():
            if gpus is not None and batch != "fixed batch" and gpus == jobs["fixed batch"].cluster.num_gpus:
                continue  # a constant GPU count equal to the job's own: both assumptions give the same batch
            print(f"  trace {name}, {batch}:")
            runs = {p: run(job, name, p, seed, steps, gpus) for p in (*OURS, *FIXED)}
            mean = {p: r.summary()["mean_step_s"] for p, r in runs.items()}
            for p in OURS:
                print(f"    => {p}: {pct(mean[p], mean['fixed-oracle'])} vs fixed-oracle, "
                      f"{pct(mean[p], mean['fixed-recipe'])} vs fixed-recipe (mean step latency)")
            where = name if gpus is None else f"{name}, {gpus} GPUs"
            rows.append(("(a) mean step latency", where, batch if gpus is None else "either (same batch)",
                         pct(mean["nereus"], mean["fixed-oracle"]), pct(mean["nereus"], mean["fixed-recipe"]),
                         *(f"{pct(mean[p], mean['fixed-oracle'])} / {pct(mean[p], mean['fixed-recipe'])}"
                           for p in OURS[1:]), ""))
            first.setdefault(batch, runs)
    return first


def experiment_b(jobs: dict, seed: int, quick: bool, rows: list) -> dict:
    print("(b) 1,000-step run growing to 1,024 GPUs (paper: 6 transitions, 0.079% of run time)")
    steps = 300 if quick else None
    out = {}
    for batch, job in jobs.items():
        print(f"  trace growth_to_1024, {batch}:")
        runs = {p: run(job, "growth_to_1024", p, seed, steps) for p in (*OURS, *FIXED)}
        s = {p: r.summary() for p, r in runs.items()}
        for p in OURS:
            print(f"    => {p}: {s[p]['transitions']} transitions, {100 * s[p]['transition_share']:.4f}% of run time, "
                  f"mean step {pct(s[p]['mean_step_s'], s['fixed-oracle']['mean_step_s'])} vs fixed-oracle, "
                  f"{pct(s[p]['mean_step_s'], s['fixed-recipe']['mean_step_s'])} vs fixed-recipe; "
                  f"simulated in {s[p]['wall_s']:.0f} s")
        n, oracle, recipe = (s[p]["mean_step_s"] for p in ("nereus", "fixed-oracle", "fixed-recipe"))
        rows.append(("(b) mean step latency", "growth_to_1024", batch, pct(n, oracle), pct(n, recipe),
                     *(f"{pct(s[p]['mean_step_s'], oracle)} / {pct(s[p]['mean_step_s'], recipe)}" for p in OURS[1:]),
                     "transitions, share of run time: " + "; ".join(
                         f"{p} {s[p]['transitions']}, {100 * s[p]['transition_share']:.3f}%" for p in OURS)))
        out[batch] = runs
    return out


def experiment_c(jobs: dict, seed: int, quick: bool, rows: list) -> None:
    print("(c) 8B PPO throughput vs verl-like and OpenRLHF-like (paper: 1.10-1.47x and 2.14-7.27x)")
    steps = 100 if quick else 200
    others = ("verl-like", "openrlhf-like", *FIXED)
    for batch, job in jobs.items():
        for gpus in (32, 128, 512):
            print(f"  {gpus} GPUs, trace r1_zero_growth steps 0-{steps}, {batch}:")
            runs = {p: run(job, "r1_zero_growth", p, seed, steps, gpus) for p in (*OURS, *others)}
            tput = {p: r.summary()["tokens_per_s"] for p, r in runs.items()}
            for p in OURS:
                print(f"    => {p}: " + ", ".join(f"{tput[p] / tput[o]:.2f}x {o}" for o in others))
            n = tput["nereus"]
            rows.append(("(c) throughput", f"r1_zero_growth, {gpus} GPUs", batch,
                         f"{n / tput['fixed-oracle']:.2f}×", f"{n / tput['fixed-recipe']:.2f}×",
                         *(f"{tput[p] / tput['fixed-oracle']:.2f}× / {tput[p] / tput['fixed-recipe']:.2f}×"
                           for p in OURS[1:]),
                         f"{n / tput['verl-like']:.2f}× verl-like, {n / tput['openrlhf-like']:.2f}× OpenRLHF-like"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="shorter runs (a smoke test of the script)")
    parser.add_argument("--plots", default=None, help="write PNG plots of (a) and (b) here")
    parser.add_argument("--job", default=str(ROOT / "examples" / "ppo_8b_h100.yaml"))
    args = parser.parse_args()
    job = load_job(args.job)
    per_gpu = job.workload.prompts_per_step / job.cluster.num_gpus
    jobs = {"fixed batch": job, "growing batch": GrowingBatchJob.of(job, per_gpu)}
    print(f"batch assumptions: fixed batch = {job.workload.prompts_per_step:,} prompts per step at every GPU "
          f"count; growing batch = {per_gpu:g} prompts per GPU ({job.workload.prompts_per_step:,} on the job's "
          f"{job.cluster.num_gpus} GPUs), following the GPUs available\n")
    start = time.perf_counter()
    rows: list = []
    a = experiment_a(jobs, args.seed, args.quick, rows)
    b = experiment_b(jobs, args.seed, args.quick, rows)
    experiment_c(jobs, args.seed, args.quick, rows)
    print("\n| experiment | trace | batch | nereus vs fixed-oracle | nereus vs fixed-recipe "
          "| between steps only (vs oracle / recipe) | without calibration, between steps (vs oracle / recipe) "
          "| also |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    if args.plots:
        out = Path(args.plots)
        for tag, runs in (("a_growth_from_16", a["fixed batch"]), ("b_growth_to_1024", b["fixed batch"])):
            for path in plot_runs([r.to_dict() for r in runs.values()], out):
                path.rename(out / f"{tag}_{path.name}")
        print(f"plots in {out}")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
