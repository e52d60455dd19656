"""The reference paper's three experiments, re-run in the simulator side by side, on traces built from
published data (traces/*.yaml cite their sources). Every figure below is measured in this run.

(a) mean step latency, online TP/PP adaptation vs fixed initial TP/PP with DP scaling (paper: −27.7%);
(b) a 1,000-step run growing to 1,024 GPUs: transitions and their share of run time (paper: 6, 0.079%);
(c) 8B PPO throughput against verl-like and OpenRLHF-like policies on three cluster shapes
    (paper: 1.10–1.47× and 2.14–7.27×).
Each also without calibration (``nereus-nocal``), to show what calibration contributes.

    python benchmarks/paper.py [--seed 0] [--quick] [--plots docs/img]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from nereus.sim.report import plot_runs
from nereus.sim.run import simulate
from nereus.spec import load_job
from nereus.spec.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent


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


def experiment_a(job, seed: int, quick: bool) -> list:
    print("(a) online TP/PP adaptation vs fixed initial TP/PP with DP scaling (paper: -27.7% mean step latency)")
    out = []
    for name, steps, gpus in (("growth_from_16", 200 if quick else None, None),
                              ("deepscaler_stages", 200 if quick else None, 64),
                              ("long_tail_dapo", 150 if quick else None, 64)):
        print(f"  trace {name}:")
        runs = {p: run(job, name, p, seed, steps, gpus) for p in ("nereus", "nereus-nocal", "fixed-dp")}
        base = runs["fixed-dp"].summary()["mean_step_s"]
        for p in ("nereus", "nereus-nocal"):
            print(f"    => {p}: {100 * (runs[p].summary()['mean_step_s'] / base - 1):+.1f}% mean step latency")
        out.append(runs)
    return out


def experiment_b(job, seed: int, quick: bool) -> dict:
    print("(b) 1,000-step run growing to 1,024 GPUs (paper: 6 transitions, 0.079% of run time)")
    steps = 300 if quick else None
    runs = {p: run(job, "growth_to_1024", p, seed, steps) for p in ("nereus", "nereus-nocal")}
    for p, r in runs.items():
        s = r.summary()
        print(f"    => {p}: {s['transitions']} transitions, {100 * s['transition_share']:.4f}% of run time, "
              f"simulated in {s['wall_s']:.0f} s")
    return runs


def experiment_c(job, seed: int, quick: bool) -> None:
    print("(c) 8B PPO throughput vs verl-like and OpenRLHF-like (paper: 1.10-1.47x and 2.14-7.27x)")
    for gpus in (32, 128, 512):
        print(f"  {gpus} GPUs, trace r1_zero_growth steps 0-{100 if quick else 200}:")
        runs = {p: run(job, "r1_zero_growth", p, seed, 100 if quick else 200, gpus)
                for p in ("nereus", "nereus-nocal", "verl-like", "openrlhf-like")}
        tput = {p: r.summary()["tokens_per_s"] for p, r in runs.items()}
        for p in ("nereus", "nereus-nocal"):
            print(f"    => {p}: {tput[p] / tput['verl-like']:.2f}x verl-like, "
                  f"{tput[p] / tput['openrlhf-like']:.2f}x openrlhf-like")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="shorter runs (a smoke test of the script)")
    parser.add_argument("--plots", default=None, help="write PNG plots of (a) and (b) here")
    parser.add_argument("--job", default=str(ROOT / "examples" / "ppo_8b_h100.yaml"))
    args = parser.parse_args()
    job = load_job(args.job)
    start = time.perf_counter()
    a = experiment_a(job, args.seed, args.quick)
    b = experiment_b(job, args.seed, args.quick)
    experiment_c(job, args.seed, args.quick)
    if args.plots:
        out = Path(args.plots)
        for tag, runs in (("a_growth_from_16", a[0]), ("b_growth_to_1024", b)):
            for path in plot_runs([r.to_dict() for r in runs.values()], out):
                path.rename(out / f"{tag}_{path.name}")
        print(f"plots in {out}")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
