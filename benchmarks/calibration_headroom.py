"""What calibrating costs against knowing: `nereus` as it runs (its cost-model factors fitted on the steps
it measured) against the same policy handed the simulator's hidden per-term factors
(``ControllerConfig.known_factors``: the truth a perfect fit would find), side by side per job, trace,
policy lag and seed over whole traces. The change of the mean step is the headroom a better calibration
could still win. Fitted from one rollout layout, a stage's terms share one factor (their columns move
together: ``cost.calibration``), so a truth whose decode memory reads and FLOPs are far apart (seed 3's:
0.53x and 1.67x the model) is where knowing should pay most.

    python benchmarks/calibration_headroom.py [--jobs grpo_7b_h100 ppo_8b_h100] [--traces long_tail_dapo ...]
        [--lags 0 1] [--seeds 0 1 2 3 4] [--steps 0 (whole traces)]
"""

from __future__ import annotations

import argparse
import statistics

from long_tail import ROOT, gpu_range, run_one

from nereus.control.controller import ControllerConfig
from nereus.sim.backend import TruthConfig, hidden_factors
from nereus.spec import load_job
from nereus.spec.trace import load_trace


def mean_steps(job, trace, lag: int, seed: int, steps: int) -> tuple[float, float]:
    """``nereus``'s mean step on ``trace`` with its factors fitted, and with them known (the run's hidden
    truth)."""
    first, biggest = gpu_range(job, trace)
    n = min(steps or trace.steps, trace.steps)
    known = ControllerConfig(known_factors=tuple(sorted(hidden_factors(seed, TruthConfig()).items())))
    fitted, knowing = (run_one(job.with_gpus(biggest), trace, f"nereus@lag{lag}", seed, n, first, config)
                       for config in (None, known))
    return fitted["mean_step_s"], knowing["mean_step_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", nargs="+", default=["grpo_7b_h100", "ppo_8b_h100"])
    ap.add_argument("--traces", nargs="+", default=["long_tail_dapo", "r1_zero_growth"])
    ap.add_argument("--lags", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--steps", type=int, default=0, help="steps per run (0: the whole trace)")
    args = ap.parse_args()
    print(f"  {'job':<14}{'trace':<18}{'lag':>4}{'seed':>5}{'fitted':>10}{'known':>10}{'change':>9}", flush=True)
    changes = []
    for job_name in args.jobs:
        job = load_job(ROOT / "examples" / f"{job_name}.yaml")
        for trace_name in args.traces:
            trace = load_trace(ROOT / "traces" / f"{trace_name}.yaml")
            for lag in args.lags:
                for seed in args.seeds:
                    fitted, known = mean_steps(job, trace, lag, seed, args.steps)
                    changes.append(known / fitted - 1)
                    print(f"  {job_name:<14}{trace_name:<18}{lag:>4}{seed:>5}{fitted:9.1f}s{known:9.1f}s"
                          f"{100 * changes[-1]:+8.1f}%", flush=True)
    mean = statistics.mean(changes)
    print(f"known factors against fitted, mean step over {len(changes)} runs: mean {100 * mean:+.1f}%, "
          f"best {100 * min(changes):+.1f}%, worst {100 * max(changes):+.1f}%")


if __name__ == "__main__":
    main()
