"""Effective training time under injected failures, in the simulator: Nereus's live recovery against
checkpoint-restart (verl-like), side by side on the same failures at the same wall-clock times.

    python benchmarks/fault_injection.py --gpus 1024 --failure-fraction 0.1 [--steps 1000] [--seed 0] [--json]

The job is examples/ppo_8b_h100.yaml (PPO, Llama-3-8B actor, critic, reference and reward) on the
response lengths of traces/node_failures_1024.yaml with its own failures removed: the Nereus policy's
failure-free run gives every step's phases and the live transitions. Both mechanisms replay those step
times, so the comparison isolates recovery. Failures: ``nereus.sim.faults`` (the Llama 3 mix, the rate
set by --failure-fraction); costs: ``nereus.sim.fault_costs`` and ``nereus.sim.fault_replay`` (measured
runtime figures, the cost model, cited assumptions). The last line with --json is
{"nereus_ettr", "restart_ettr", "failures", "steps_lost", "samples_lost"} (Nereus's figures).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nereus.control.forecast import LengthSchedule  # noqa: E402
from nereus.control.record import RunRecord  # noqa: E402
from nereus.control.transition_cost import TransitionCoster  # noqa: E402
from nereus.sim.baselines import make_policy  # noqa: E402
from nereus.sim.fault_costs import live_recovery, restart_recovery, timeline_from_record  # noqa: E402
from nereus.sim.fault_replay import (  # noqa: E402
    LiveRecovery,
    ReplayResult,
    RestartRecovery,
    StepTimeline,
    replay_live,
    replay_restart,
)
from nereus.sim.faults import KINDS, WHILE_RECOVERING, FaultModel, draw_faults, llama3_gpu_hours_per_failure  # noqa: E402
from nereus.sim.run import simulate  # noqa: E402
from nereus.spec import load_job  # noqa: E402
from nereus.spec.job import JobSpec  # noqa: E402
from nereus.spec.layout import Plan  # noqa: E402
from nereus.spec.trace import Trace, load_trace  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=1024, help="GPUs of the job (whole nodes of 8)")
    p.add_argument("--failure-fraction", type=float, default=0.1,
                   help="share of the job's machines failing over the failure-free run (a shorter "
                        "--steps packs as many failures into less time)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=20, help="restart baseline: steps between checkpoints")
    p.add_argument("--relaunch-s", type=float, default=300.0, help="restart baseline: relaunch seconds")
    p.add_argument("--fault-draws", type=int, default=1,
                   help="also summarise this many failure draws (seeds SEED, SEED+1, ...) on the same run")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = p.parse_args(argv)
    if args.gpus < 16 or args.gpus % 8:
        p.error(f"--gpus {args.gpus}: give a multiple of 8 of at least 16 (whole nodes, one may fail)")
    if not 0 < args.steps <= 1000:
        p.error(f"--steps {args.steps}: give 1 to 1000 (the trace's length)")
    if not 0 <= args.failure_fraction <= 10:
        p.error(f"--failure-fraction {args.failure_fraction}: give a share of machines in [0, 10]")
    if not 1 <= args.fault_draws <= 1000:
        p.error(f"--fault-draws {args.fault_draws}: give 1 to 1000")
    if args.checkpoint_every < 1:
        p.error(f"--checkpoint-every {args.checkpoint_every}: give at least 1")
    return args


def worst_live_recovery(job: JobSpec, trace: Trace, record: RunRecord, steps: int,
                        coster: TransitionCoster) -> tuple[LiveRecovery, Plan]:
    """Nereus's costs for the plan in force whose loss of a node costs most to re-shard."""
    gpn = job.cluster.gpus_per_node
    policy = make_policy("nereus", job, LengthSchedule(trace), steps, coster)
    costs = []
    for entry in record.plans:
        plan = Plan.from_dict(entry["plan"])
        survivors = policy.survivor_plan(plan.num_gpus - gpn, entry["step"])
        costs.append(live_recovery(job, plan, survivors, coster))
    return max(costs, key=lambda c: c.recover_s() + c.regrow_s), Plan.from_dict(record.plans[0]["plan"])


def young_interval(checkpoint_s: float, mtbf_s: float, step_s: float) -> int:
    """Steps between checkpoints that minimise the time lost, sqrt(2 · checkpoint cost · MTBF) (Young
    1974, "A first order approximation to the optimum checkpoint interval", CACM 17(9))."""
    return max(1, round((2 * checkpoint_s * mtbf_s) ** 0.5 / step_s))


def draws_summary(timeline: StepTimeline, model: FaultModel, live_cost: LiveRecovery, restart_cost: RestartRecovery,
                  nodes: int, run_s: float, seed: int, draws: int) -> str:
    """ETTR over ``draws`` failure draws of the same failure-free run: mean, lowest and highest."""
    kw = {"straggler_slowdown": model.straggler_slowdown, "straggler_spot_s": model.straggler_spot_s}
    live, restart = [], []
    for s in range(seed, seed + draws):
        faults = draw_faults(model, nodes, run_s, 50 * run_s, s)
        live.append(replay_live(timeline, faults, live_cost, **kw).ettr)
        restart.append(replay_restart(timeline, faults, restart_cost, **kw).ettr)
    wins = sum(a > b for a, b in zip(live, restart, strict=True))
    return (f"over {draws} failure draws (seeds {seed}-{seed + draws - 1}): Nereus ETTR mean "
            f"{100 * sum(live) / draws:.1f}% ({100 * min(live):.1f}-{100 * max(live):.1f}%, at least 95% in "
            f"{sum(x >= 0.95 for x in live)}), checkpoint-restart {100 * sum(restart) / draws:.1f}% "
            f"({100 * min(restart):.1f}-{100 * max(restart):.1f}%); Nereus ahead in {wins}")


def table(live: ReplayResult, restart: ReplayResult) -> list[str]:
    rows = [f"{'':<22}{'Nereus (live)':>26}{'checkpoint-restart':>26}",
            f"{'failure kind':<22}{'count   lost min':>26}{'count   lost min':>26}"]
    for kind in (*KINDS, WHILE_RECOVERING):
        cells = [f"{r.failures.get(kind, 0):5d} {r.lost_s.get(kind, 0.0) / 60:10.1f}" for r in (live, restart)]
        rows.append(f"{kind:<22}{cells[0]:>26}{cells[1]:>26}")
    rows.append(f"{'running on survivors':<22}{live.lost_s.get('survivors_slower', 0.0) / 60:>26.1f}{'-':>26}")
    for label, fn in (("ETTR", lambda r: f"{100 * r.ettr:.1f}%"), ("wall time", lambda r: f"{r.wall_s / 3600:.2f} h"),
                      ("steps lost", lambda r: str(r.steps_lost)), ("samples lost", lambda r: str(r.samples_lost)),
                      ("overhead (snapshots, checkpoints, transitions)", lambda r: f"{r.overhead_s / 60:.1f} min")):
        rows.append(f"{label:<22}{fn(live):>26}{fn(restart):>26}" if len(label) <= 22 else
                    f"{label}:  {fn(live)} | {fn(restart)}")
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    base = load_job(ROOT / "examples" / "ppo_8b_h100.yaml")
    job = base.with_gpus(args.gpus)
    trace = load_trace(ROOT / "traces" / "node_failures_1024.yaml")
    trace = replace(trace, gpus=((0, args.gpus),), failures=(), failure_rate=(0.0, 0))
    coster = TransitionCoster()
    record = simulate(job, trace, "nereus", args.seed, args.steps)
    samples = job.workload.prompts_per_step * job.algorithm.samples_per_prompt
    nodes = args.gpus // job.cluster.gpus_per_node
    timeline = timeline_from_record(record, samples, nodes)
    live_cost, first_plan = worst_live_recovery(job, trace, record, args.steps, coster)
    restart_cost = restart_recovery(job, first_plan, relaunch_s=args.relaunch_s,
                                    checkpoint_every=args.checkpoint_every)
    model = FaultModel(args.failure_fraction)
    run_s = timeline.productive_s + sum(timeline.transition_s)
    faults = draw_faults(model, nodes, run_s, 50 * run_s, args.seed)
    kw = {"straggler_slowdown": model.straggler_slowdown, "straggler_spot_s": model.straggler_spot_s}
    live = replay_live(timeline, faults, live_cost, **kw)
    restart = replay_restart(timeline, faults, restart_cost, **kw)
    young = young_interval(restart_cost.checkpoint_s, run_s / max(model.rate_per_s(nodes, run_s) * run_s, 1e-9),
                           run_s / args.steps)
    restart_young = replay_restart(timeline, faults, replace(restart_cost, checkpoint_every=young), **kw)

    print(f"PPO 8B on {args.gpus} GPUs ({nodes} nodes), {args.steps} steps, seed {args.seed}: failure-free "
          f"{run_s / 3600:.2f} h, {samples} samples a step")
    print(f"failures: {args.failure_fraction:.0%} of machines over the failure-free run = "
          f"{model.gpu_hours_per_failure(args.gpus, nodes, run_s):,.0f} GPU-hours between failures "
          f"(Llama 3 pre-training: {llama3_gpu_hours_per_failure():,.0f}); mix "
          + ", ".join(f"{k} {v:.1%}" for k, v in model.shares().items()))
    print(f"Nereus recovery: detect 0 s (process) / {live_cost.detect_node_s:.0f} s (node), then "
          f"{live_cost.recover_s():.1f} s (re-form {live_cost.reform_s} s + restore {live_cost.restore_s} s + "
          f"communicators {live_cost.comm_init_s:.0f} s + re-shard {live_cost.reshard_s:.1f} s), re-grow "
          f"{live_cost.regrow_s:.1f} s after {live_cost.spare_s:.0f} s; snapshot {live_cost.snapshot_s:.2f} s a step")
    print(f"restart: relaunch {restart_cost.relaunch_s:.0f} s + load {restart_cost.load_s:.1f} s; checkpoint "
          f"every {restart_cost.checkpoint_every} steps ({restart_cost.checkpoint_s:.1f} s each)")
    print("\n".join(table(live, restart)))
    print(f"checkpoint-restart at Young's interval (every {young} steps): ETTR {100 * restart_young.ettr:.1f}%, "
          f"{restart_young.steps_lost} steps lost")
    if args.fault_draws > 1:
        print(draws_summary(timeline, model, live_cost, restart_cost, nodes, run_s, args.seed, args.fault_draws))
    if args.json:
        print(json.dumps({"nereus_ettr": round(live.ettr, 4), "restart_ettr": round(restart.ettr, 4),
                          "failures": live.failure_count, "steps_lost": live.steps_lost,
                          "samples_lost": live.samples_lost}))


if __name__ == "__main__":
    main()
