"""Planner search time against cluster size, for the 8B four-model PPO example.

Prints the median and worst of several searches per size on this machine (no assertion: timings are
noisy here). Target: median <= 1 s at 1,024 GPUs; aim 0.1 s.

    python benchmarks/plan_search.py [--job examples/ppo_8b_h100.yaml] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from nereus.cost.hardware import Hardware
from nereus.planner.search import search
from nereus.spec import load_job

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", default=str(ROOT / "examples" / "ppo_8b_h100.yaml"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default="8,16,32,64,128,256,512,1024")
    args = parser.parse_args()
    base = load_job(args.job)
    print(f"job {base.name}: {len(base.model_stages())} model-stages; {args.repeats} searches per size")
    print(f"{'GPUs':>6} {'median s':>10} {'max s':>8} {'layouts':>8} {'step s':>9}  strategy")
    for n in (int(x) for x in args.sizes.split(",")):
        job = base.with_gpus(n)
        hw = Hardware(job.cluster)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            result = search(hw, job)
            times.append(time.perf_counter() - start)
        print(f"{n:>6} {statistics.median(times):>10.3f} {max(times):>8.3f} {result.evaluated_layouts:>8} "
              f"{result.estimate.step_time_s:>9.2f}  {result.plan.strategy}", flush=True)


if __name__ == "__main__":
    main()
