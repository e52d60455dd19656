"""Recovering from lost GPUs in the simulator: live re-planning onto the survivors (Nereus) against
checkpoint-restart (relaunch, reload the last checkpoint, redo the steps since), side by side on the same
traces, seeds and failures.

    python benchmarks/failures_sim.py [--seed 0] [--steps N] [--checkpoint-every 50] [--restart-s 300]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nereus.control.loop import Recovery
from nereus.sim.run import simulate
from nereus.spec import load_job
from nereus.spec.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--restart-s", type=float, default=300.0)
    args = parser.parse_args()
    job = load_job(ROOT / "examples" / "ppo_8b_h100.yaml")
    for name in ("cluster_churn", "node_failures_1024"):
        trace = load_trace(ROOT / "traces" / f"{name}.yaml")
        first = trace.gpus_at(0, job.cluster.num_gpus)
        big = job.with_gpus(max([first, *(n for _, n in trace.gpus)]))
        print(f"trace {name} ({args.steps or trace.steps} steps, seed {args.seed}):")
        results = {}
        for mode in ("live", "restart"):
            recovery = Recovery(mode, args.checkpoint_every, args.restart_s)
            r = simulate(big, trace, "nereus", args.seed, args.steps, initial_gpus=first, recovery=recovery)
            s = results[mode] = r.summary()
            print(f"  {mode:<8} run {s['run_s'] / 3600:7.2f} h  failures {s['failures']}  lost to failures "
                  f"{s['lost_s'] / 60:7.1f} min ({100 * s['lost_s'] / s['run_s']:.2f}% of run)  "
                  f"transitions {s['transitions']} ({s['transition_s']:.1f} s)")
        live, restart = results["live"], results["restart"]
        if restart["lost_s"] > 0:
            print(f"  => live recovery loses {live['lost_s'] / restart['lost_s']:.3f}x the time of checkpoint-restart; "
                  f"run time {live['run_s'] / restart['run_s']:.3f}x")


if __name__ == "__main__":
    main()
