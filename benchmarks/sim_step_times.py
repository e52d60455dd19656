"""Simulated step times of every policy on every repository trace, saved and compared across two code versions.

A refactoring of the simulator or of the policies must not move a single simulated number. This script
runs ``nereus simulate``'s code path (``sim.run.simulate``, the job ``examples/ppo_8b_h100.yaml`` grown to
the trace's largest GPU count, as ``benchmarks/long_tail.py`` runs it) for every trace in ``traces/`` ×
every policy name of ``sim.baselines.POLICIES`` (aliases left out), and writes each run's per-step times
to JSON. ``--compare BEFORE AFTER`` prints, per trace and policy, the mean step time of both files and the
largest relative difference of any step's time (0 means bit-identical).

    python benchmarks/sim_step_times.py --out after.json [--steps 200] [--traces ...] [--policies ...]
    PYTHONPATH=/path/to/old/checkout python benchmarks/sim_step_times.py --out before.json
    python benchmarks/sim_step_times.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_all(job_path: str, traces: list[str], policies: list[str], seed: int, steps: int | None) -> dict:
    from nereus.sim.run import simulate
    from nereus.spec import load_job
    from nereus.spec.trace import load_trace

    job = load_job(job_path)
    out: dict[str, dict] = {}
    for name in traces:
        trace = load_trace(ROOT / "traces" / f"{name}.yaml")
        first = trace.gpus_at(0, job.cluster.num_gpus)
        biggest = max([first, *(n for _, n in trace.gpus)])
        n = min(steps or trace.steps, trace.steps)
        for p in policies:
            t0 = time.perf_counter()
            try:
                record = simulate(job.with_gpus(biggest), trace, p, seed, n, initial_gpus=first)
            except ValueError as err:  # a policy that finds no feasible plan (SpecError, InfeasibleError)
                out[f"{name}/{p}"] = {"error": f"{type(err).__name__}: {err}"}
                print(f"  {name:<22}{p:<18}{n:>5} steps  {type(err).__name__}", flush=True)
                continue
            out[f"{name}/{p}"] = {"step_time_s": [s["step_time_s"] for s in record.steps],
                                  "transition_s": [s["transition_s"] for s in record.steps],
                                  "run_s": record.summary()["run_s"], "sim_s": time.perf_counter() - t0}
            print(f"  {name:<22}{p:<18}{n:>5} steps  mean {record.summary()['mean_step_s']:9.3f} s  "
                  f"[{time.perf_counter() - t0:.1f} s]", flush=True)
    return out


def compare(before: dict, after: dict) -> float:
    """Print the before/after table; the largest relative difference of any step or transition time."""
    print(f"{'trace/policy':<42}{'steps':>6}{'mean before s':>15}{'mean after s':>15}{'max rel diff':>14}")
    worst = 0.0
    for key in sorted(before.keys() | after.keys()):
        if key not in before or key not in after:
            print(f"{key:<42}  only in {'after' if key in after else 'before'}")
            worst = float("inf")
            continue
        b, a = before[key], after[key]
        if "error" in b or "error" in a:
            same = b.get("error") == a.get("error")
            error = (b.get("error") or a.get("error"))[:60]
            print(f"{key:<42}  {'the same error' if same else 'errors differ'}: {error}")
            worst = worst if same else float("inf")
            continue
        diffs = [abs(x - y) / max(abs(x), 1e-300) for f in ("step_time_s", "transition_s")
                 for x, y in zip(b[f], a[f], strict=True) if x or y]
        if len(b["step_time_s"]) != len(a["step_time_s"]):
            diffs.append(float("inf"))
        d = max(diffs, default=0.0)
        worst = max(worst, d)
        mb, ma = (sum(r["step_time_s"]) / len(r["step_time_s"]) for r in (b, a))
        print(f"{key:<42}{len(b['step_time_s']):>6}{mb:>15.6f}{ma:>15.6f}{d:>14.2e}")
    print(f"largest relative difference over every step: {worst:.2e}")
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", default=str(ROOT / "examples" / "ppo_8b_h100.yaml"))
    ap.add_argument("--steps", type=int, default=0, help="steps per trace (0: the whole trace)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--traces", nargs="*", default=sorted(p.stem for p in (ROOT / "traces").glob("*.yaml")))
    ap.add_argument("--policies", nargs="*", default=None, help="default: every policy name but the aliases")
    ap.add_argument("--out", help="write the per-step times here (JSON)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two files written by --out")
    args = ap.parse_args()
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        compare(before, after)
        return
    from nereus.sim.baselines import ALIASES, POLICIES

    policies = args.policies or [p for p in POLICIES if p not in ALIASES]
    res = run_all(args.job, args.traces, policies, args.seed, args.steps or None)
    if args.out:
        Path(args.out).write_text(json.dumps(res))


if __name__ == "__main__":
    main()
