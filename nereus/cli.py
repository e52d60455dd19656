"""`nereus` command line: plan, estimate, transition, simulate, report, run, profile (more subcommands land with
their features)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from nereus.spec.errors import InfeasibleError, SpecError


def _load(args: argparse.Namespace):
    from nereus.spec.job import load_job

    job = load_job(args.job)
    if getattr(args, "gpus", None):
        job = job.with_gpus(args.gpus)
    return job


def cmd_plan(args: argparse.Namespace) -> int:
    from nereus.cost.hardware import Hardware
    from nereus.planner.explain import explain_text, result_json
    from nereus.planner.search import search

    job = _load(args)
    result = search(Hardware(job.cluster), job)
    if args.json:
        print(json.dumps(result_json(job, result), indent=1))
    else:
        print(explain_text(job, result))
    if args.out:
        Path(args.out).write_text(json.dumps(result_json(job, result), indent=1))
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from nereus.cost.hardware import Hardware
    from nereus.cost.plan_cost import estimate_plan
    from nereus.planner.explain import estimate_text
    from nereus.planner.layouts import plan_from_layout, read_plan_file

    job = _load(args)
    hw = Hardware(job.cluster)
    if args.plan:
        plan = read_plan_file(args.plan)
    elif args.layout:
        plan = plan_from_layout(hw, job, args.layout)
    else:
        raise SpecError("--plan", "give a plan file (as `nereus plan --json` writes) or, for a training-only "
                                  "job, --layout tp=..,pp=..")
    est = estimate_plan(hw, job, plan)
    if args.json:
        print(json.dumps({"plan": plan.to_dict(), **est.to_dict()}, indent=1))
    else:
        print("\n".join(estimate_text(job, est, {str(p.model_stage): p.gpus for p in plan.placements})))
    return 0 if est.feasible else 3


def cmd_simulate(args: argparse.Namespace) -> int:
    from nereus.sim.baselines import POLICIES
    from nereus.sim.run import simulate
    from nereus.spec.trace import load_trace

    if args.policy not in POLICIES:
        raise SpecError("--policy", f"{args.policy!r} is not a policy; choose one of {list(POLICIES)}")
    job = _load(args)
    trace = load_trace(args.trace)
    steps = args.steps or trace.steps
    first = trace.gpus_at(0, job.cluster.num_gpus)
    job = job.with_gpus(max([first, *(n for _, n in trace.gpus)]))

    def progress(step: int, m, decision) -> None:
        if not args.json and (step % max(1, steps // 20) == 0 or decision.action != "keep"):
            note = f"  {decision.action}: {decision.reason}" if decision.action != "keep" else ""
            print(f"[{step + 1:>5}/{steps}] step {m.step_time_s:8.2f} s  gpus {m.gpus:>5}{note}",
                  file=sys.stderr)

    record = simulate(job, trace, args.policy, args.seed, steps, initial_gpus=first, progress=progress)
    if args.out:
        record.save(args.out)
    summary = record.summary()
    if args.json:
        print(json.dumps({"summary": summary, "decisions": [d for d in record.decisions if d["action"] != "keep"]},
                         indent=1))
    else:
        for key, value in summary.items():
            print(f"{key:<34} {value:.6g}" if isinstance(value, float) else f"{key:<34} {value}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from nereus.sim.report import write_report

    outputs = write_report(args.runs, args.out)
    print((Path(args.out) / "report.md").read_text())
    for name, path in outputs.items():
        print(f"{name}: {path}")
    return 0


def _read_plan_arg(flag: str, path: str):
    from nereus.planner.layouts import read_plan_file

    try:
        return read_plan_file(path)
    except SpecError as err:
        raise SpecError(f"{flag} {err.path}", err.message) from None


def cmd_transition(args: argparse.Namespace) -> int:
    from nereus.cost.hardware import Hardware
    from nereus.elastic.graph import TransitionOptions
    from nereus.elastic.timeline import write_trace
    from nereus.elastic.transition import change_lines, check_job_plans, plan_transition

    job = _load(args)
    old, new = _read_plan_arg("--from", args.from_plan), _read_plan_arg("--to", args.to_plan)
    job = check_job_plans(job, old, new)
    if args.chunk_mb <= 0:
        raise SpecError("--chunk-mb", f"must be > 0, got {args.chunk_mb}")
    if args.storage_gb_per_s <= 0:
        raise SpecError("--storage-gb-per-s", f"must be > 0, got {args.storage_gb_per_s}")
    options = TransitionOptions(chunk_bytes=int(args.chunk_mb * 2**20))
    result = plan_transition(job, old, new, Hardware(job.cluster), options, args.storage_gb_per_s * 1e9)
    changes = change_lines(old, new)
    if args.json:
        print(json.dumps({"job": job.name, "num_gpus": result.graph.num_gpus, "changes": changes,
                          **result.report.to_dict()}, indent=1))
    else:
        c = job.cluster
        print(f"Transition for '{job.name}' on {result.graph.num_gpus} x {c.gpu.name} "
              f"({c.nodes} node(s) x {c.gpus_per_node})")
        print("\n".join(changes))
        print(result.report.text())
    if args.timeline:
        write_trace(args.timeline, result.graph, result.schedule)
    if args.graph:
        Path(args.graph).write_text(json.dumps(result.graph.to_json()))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    if args.workers < 2:
        raise SpecError("--workers", f"must be >= 2 (collectives need two workers), got {args.workers}")
    if not args.memory_gb > 0:
        raise SpecError("--memory-gb", f"must be > 0, got {args.memory_gb}")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise SpecError("--out", f"folder {Path(args.out).resolve().parent} does not exist")
    try:
        import torch.multiprocessing as mp

        from nereus.runtime import profile
    except ImportError as err:
        raise SpecError("profile", f"needs the runtime's dependencies ({err.name} is missing); "
                                   "install them with: pip install -e '.[runtime]'") from None
    print(f"nereus profile: measuring on {args.workers} local worker processes ...", file=sys.stderr)
    if profile.load_average() > 0.5 * (os.cpu_count() or 1):
        print(f"nereus profile: note: load average {profile.load_average():.1f} on {os.cpu_count()} CPUs; other "
              "processes will lower the figures", file=sys.stderr)
    try:
        result = profile.measure(args.workers, args.memory_gb)
    except mp.ProcessException as err:
        last = [line for line in str(err).splitlines() if line.strip()][-1:] or ["no message"]
        raise SpecError("profile", f"a worker failed: {last[0].strip()}") from None
    text = result.to_yaml()
    print(text, end="")
    if args.out:
        try:
            Path(args.out).write_text(text)
        except OSError as err:
            raise SpecError("--out", f"cannot write {args.out}: {err.strerror}") from None
        print(f"nereus profile: wrote {args.out}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nereus", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="search a memory-feasible global plan and explain it")
    p.add_argument("job", help="job spec (YAML)")
    p.add_argument("--gpus", type=int, help="plan for this many GPUs instead of the spec's cluster size")
    p.add_argument("--json", action="store_true", help="print JSON (plan, step_time_s, per-stage, memory)")
    p.add_argument("--out", help="also write the JSON to this file")
    p.set_defaults(func=cmd_plan)
    e = sub.add_parser("estimate", help="predict step time and memory of a given plan")
    e.add_argument("job", help="job spec (YAML)")
    e.add_argument("--plan", help="plan file in the format `nereus plan --json` writes")
    e.add_argument("--layout", help="training-only jobs: tp=..,pp=..[,dp=..,micro_batch_size=..,interleave=..]")
    e.add_argument("--gpus", type=int, help="cluster size to assume")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_estimate)
    s = sub.add_parser("simulate", help="run a policy over a trace on the simulated cluster")
    s.add_argument("trace", help="trace file (YAML or JSON; see docs/simulator.md)")
    s.add_argument("--job", required=True, help="job spec (YAML)")
    s.add_argument("--policy", default="nereus", help="nereus, nereus-nocal, fixed-dp, verl-like, "
                                                      "openrlhf-like, realhf-like")
    s.add_argument("--seed", type=int, default=0, help="fixes hidden efficiencies, noise and length draws")
    s.add_argument("--steps", type=int, help="steps to run (default: the trace's)")
    s.add_argument("--out", help="write the run record (JSON) here, for `nereus report`")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_simulate)
    r = sub.add_parser("report", help="Markdown table, PNG plots and a Perfetto timeline of runs")
    r.add_argument("runs", nargs="+", help="run files written by `nereus simulate --out`")
    r.add_argument("--out", default="report", help="output folder")
    r.set_defaults(func=cmd_report)
    t = sub.add_parser("transition", help="plan the move from one plan to another: graph, schedule, cost, baselines")
    t.add_argument("job", help="job spec (YAML)")
    t.add_argument("--from", dest="from_plan", required=True, help="current plan file (as `nereus plan --json` writes)")
    t.add_argument("--to", dest="to_plan", required=True, help="target plan file")
    t.add_argument("--json", action="store_true", help="print JSON (times, bytes, memory per device, baselines)")
    t.add_argument("--timeline", help="write the schedule as Chrome/Perfetto trace JSON to this file")
    t.add_argument("--graph", help="write the transition plan (every typed step and piece; docs/transitions.md) "
                                   "as JSON to this file")
    t.add_argument("--storage-gb-per-s", type=float, default=2.0,
                   help="checkpoint baseline: shared-storage bandwidth per node (default 2)")
    t.add_argument("--chunk-mb", type=float, default=256, help="transfer chunk (staging buffer) size (default 256)")
    t.set_defaults(func=cmd_transition)
    f = sub.add_parser("profile", help="measure this machine's cpu-local hardware profile (FLOP/s, memory "
                                       "bandwidth, gloo collectives) as a job spec's cluster section")
    f.add_argument("--workers", type=int, default=4, help="local worker processes, one thread each (default 4)")
    f.add_argument("--memory-gb", type=float, default=4.0,
                   help="memory budget per worker written as gpu.memory_gb (configured, not measured; default 4)")
    f.add_argument("--out", help="also write the YAML to this file (a job includes it as cluster: {profile: FILE})")
    f.set_defaults(func=cmd_profile)
    from nereus.run.cli import add_parser as add_run_parser  # argparse only; torch loads when it runs

    add_run_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (SpecError, InfeasibleError) as err:
        print(f"nereus: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
