"""The controller's cost at 1,024 GPUs with the tail levers: plan search plus the lever choice, and a
1,000-step simulated run, timed on this machine (no assertion: timings are noisy here).

Part 1: the planner's search for the 8B PPO example at 1,024 GPUs, then the lever choice on its plan
(``control.tail_policy.NereusLevers.choose``: speculation's draft kind, length and live-batch threshold priced at
sequence granularity; partial rollout at policy lag 1), median of ``--repeats``. Target: <= 0.5 s. Then the
choice made at the start and on a GPU change: the rollout's TP priced with the levers and, at lag 1, the
pool split (``control.pools.PoolRule``: one search and lever choice per option).
Part 2: ``nereus`` on ``r1_zero_growth`` at 1,024 GPUs for ``--steps`` steps (target: 1,000 steps <= 60 s),
and ``verl-like`` next to it for scale.

    python benchmarks/lever_scale.py [--repeats 3] [--steps 1000 (0: part 1 only)] [--lag 0]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from nereus.control.pools import PoolRule
from nereus.control.tail_policy import NereusLevers, generation_forecast
from nereus.cost.hardware import Hardware
from nereus.planner.search import search
from nereus.sim.run import simulate
from nereus.spec import load_job
from nereus.spec.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", default=str(ROOT / "examples" / "ppo_8b_h100.yaml"))
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1000, help="steps of part 2 (0: part 1 only)")
    ap.add_argument("--lag", type=int, default=0)
    args = ap.parse_args()
    job = load_job(args.job).with_gpus(args.gpus)
    hw = Hardware(job.cluster)
    searches, choices = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        plan = search(hw, job).plan
        t1 = time.perf_counter()
        model, bulk, f, _ = generation_forecast(job, plan, {})
        choice = NereusLevers().choose(model, bulk, f, args.lag)
        t2 = time.perf_counter()
        searches.append(t1 - t0)
        choices.append(t2 - t1)
    total = [a + b for a, b in zip(searches, choices, strict=True)]
    print(f"{args.gpus} GPUs, {job.name}: plan search {statistics.median(searches):.3f} s, lever choice "
          f"{statistics.median(choices):.3f} s, together {statistics.median(total):.3f} s median "
          f"(max {max(total):.3f} s; target <= 0.5 s); chose {choice.levers.to_dict() if choice else None}")
    starts = []
    for _ in range(args.repeats):  # once at the start and on a GPU change, not per decision
        t0 = time.perf_counter()
        start = PoolRule().choose(job, {}, NereusLevers(), args.lag, None)
        starts.append(time.perf_counter() - t0)
    print(f"  the start's choice of the rollout's TP{' and pool split' if args.lag else ''} (control.pools): "
          f"{statistics.median(starts):.3f} s median; rollout TP "
          f"{start.plan.placement('actor/generation').layout.tp} on {start.gen_gpus or args.gpus} GPUs", flush=True)
    trace = load_trace(ROOT / "traces" / "r1_zero_growth.yaml")
    for policy in ("nereus", "verl-like") if args.steps > 0 else ():
        t0 = time.perf_counter()
        record = simulate(job, trace, policy, 0, args.steps, policy_lag=args.lag)
        wall = time.perf_counter() - t0
        print(f"{policy}: {args.steps} steps at {args.gpus} GPUs in {wall:.1f} s wall "
              f"({'target <= 60 s' if policy == 'nereus' else 'for scale'}); mean step "
              f"{record.summary()['mean_step_s']:.1f} s simulated", flush=True)


if __name__ == "__main__":
    main()
