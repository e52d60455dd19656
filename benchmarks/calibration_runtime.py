"""Calibration on the real runtime: fit the cost model to one plan, predict others.

Runs the PPO job of ``examples/ppo_tiny.yaml`` on local Ray workers. It runs ``--fit-steps`` steps on one
plan (every model-stage DP over the workers), feeding each step's measured stage times to the controller's
calibrator (``nereus.cost.calibration``, per-term factors by non-negative least squares), then moves the
job live to each of five other plans (TP 2, PP 2, DP 2 with micro-batches of 4 and of 16, one worker) and
runs ``--steps`` steps there. For every model-stage of every
other plan it prints the calibrated prediction (fitted on the first plan only, for the workload each step
actually had) against the measured time, and the uncalibrated prediction for comparison.

    python benchmarks/calibration_runtime.py [--fit-steps 6] [--steps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nereus.cost.hardware import Hardware  # noqa: E402
from nereus.cost.plan_cost import estimate_plan  # noqa: E402
from nereus.run.adaptive import controller_for  # noqa: E402
from nereus.run.backend import step_metrics  # noqa: E402
from nereus.spec.job import load_job  # noqa: E402
from nereus.spec.layout import Layout, ModelStage, Placement, Plan  # noqa: E402

WORKERS = 2


def uniform_plan(job, tp: int = 1, pp: int = 1, dp: int = WORKERS, mbs: int = 8, gpus=None) -> Plan:
    """Every model-stage under one layout (training and inference micro-batches of ``mbs``)."""
    gpus = tuple(gpus or range(tp * pp * dp))
    out = []
    for ms in job.model_stages():
        lay = Layout(tp=tp, pp=pp, dp=dp, micro_batch_size=1 if ms.stage == "generation" else mbs,
                     recompute="none", sequence_parallel=False, zero1=ms.stage == "training")
        out.append(Placement(ModelStage(ms.model, ms.stage), lay, gpus))
    return Plan(tuple(out), WORKERS)


def _observed(ctrl, m, plan, factors):
    from nereus.control.controller import observed_job

    job = observed_job(ctrl.job, m, ctrl.forecaster.sigma).with_gpus(WORKERS)
    return estimate_plan(Hardware(job.cluster), job, plan, factors).costs


def run(fit_steps: int, steps: int) -> dict:
    from nereus.run.job import RLJob

    job = load_job(ROOT / "examples" / "ppo_tiny.yaml")
    adapt = replace(job.run.adapt, availability=((0, WORKERS),))
    out = Path(tempfile.mkdtemp(prefix="calib_", dir=ROOT / ".tmp"))
    job = replace(job, run=replace(job.run, adapt=adapt, steps=fit_steps + 10 * steps, workers=WORKERS,
                                   checkpoint_dir=str(out),
                                   rollout_slots=0, rollout_midstep=None))  # the fixed batch every step
    rl = RLJob(job, quiet=True)
    ctrl = controller_for(job)
    ctrl.resume(rl.plan)
    others = {"TP2": uniform_plan(job, tp=2, dp=1), "PP2": uniform_plan(job, pp=2, dp=1),
              "DP2 mbs4": uniform_plan(job, mbs=4), "DP2 mbs16": uniform_plan(job, mbs=16),
              "DP1 (one worker)": uniform_plan(job, dp=1, mbs=16)}
    rows, step = [], 0
    try:
        rl._fresh()
        print(f"fitting on {len(rl.plan.placements)} model-stages of the initial plan, {fit_steps} steps",
              file=sys.stderr)
        for _ in range(fit_steps):
            m = step_metrics(step, rl.backend.rl_step.step(step), WORKERS)
            ctrl._observe(m)
            step += 1
        factors = ctrl.calibrator.fit()
        for name, plan in others.items():
            rl.backend.apply_transition(rl.backend.plan, plan, step)
            print(f"plan {name}: {steps} steps", file=sys.stderr)
            for _ in range(steps):
                m = step_metrics(step, rl.backend.rl_step.step(step), WORKERS)
                cal, raw = _observed(ctrl, m, plan, factors), _observed(ctrl, m, plan, None)
                for ms, t in m.stage_times_s.items():
                    rows.append({"plan": name, "stage": ms, "measured_s": t, "calibrated_s": cal[ms].time(factors),
                                 "uncalibrated_s": raw[ms].time()})
                step += 1
    finally:
        rl.release()
    return {"factors": factors, "rows": rows}


def summarize(result: dict) -> list[dict]:
    by: dict[tuple[str, str], list[dict]] = {}
    for r in result["rows"]:
        by.setdefault((r["plan"], r["stage"]), []).append(r)
    out = []
    for (plan, stage), rs in by.items():
        meas = statistics.median(r["measured_s"] for r in rs)
        cal = statistics.median(r["calibrated_s"] for r in rs)
        raw = statistics.median(r["uncalibrated_s"] for r in rs)
        out.append({"plan": plan, "stage": stage, "measured_s": meas, "calibrated_s": cal,
                    "calibrated_error": cal / meas - 1, "uncalibrated_s": raw, "uncalibrated_error": raw / meas - 1})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit-steps", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    result = run(args.fit_steps, args.steps)
    table = summarize(result)
    print(f"{'plan':<18} {'model-stage':<22} {'measured':>9} {'calibrated':>11} {'error':>7} "
          f"{'uncalibrated':>13} {'error':>7}")
    for r in table:
        print(f"{r['plan']:<18} {r['stage']:<22} {r['measured_s']:9.3f} {r['calibrated_s']:11.3f} "
              f"{100 * r['calibrated_error']:+6.1f}% {r['uncalibrated_s']:13.3f} "
              f"{100 * r['uncalibrated_error']:+6.1f}%")
    for plan in dict.fromkeys(r["plan"] for r in table):
        errs = [abs(r["calibrated_error"]) for r in table if r["plan"] == plan]
        raw = [abs(r["uncalibrated_error"]) for r in table if r["plan"] == plan]
        rows = [r for r in table if r["plan"] == plan]
        # the step's stage time as the controller compares plans: the sum over model-stages
        total = sum(r["calibrated_s"] for r in rows) / sum(r["measured_s"] for r in rows) - 1
        print(f"{plan}: calibrated mean |error| {100 * statistics.mean(errs):.1f}% (worst "
              f"{100 * max(errs):.1f}%), uncalibrated {100 * statistics.mean(raw):.1f}%; "
              f"model-stages within 20%: {sum(e <= 0.2 for e in errs)}/{len(errs)}; "
              f"sum of stage times {100 * total:+.1f}%")
    print("factors: " + ", ".join(f"{k}={v:.2f}" for k, v in sorted(result["factors"].items())))
    if args.json:
        args.json.write_text(json.dumps({**result, "table": table}, indent=1))


if __name__ == "__main__":
    main()
