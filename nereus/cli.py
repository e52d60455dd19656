"""`nereus` command line: plan, estimate, transition, simulate, report, run, profile (more subcommands land with
their features)."""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from nereus.spec.errors import InfeasibleError, RuntimeFailure, SpecError, cut
from nereus.spec.fields import MAX_SEED, MAX_STEPS
from nereus.spec.files import write_text_file

# Exit codes: 2 bad input (one line naming the file or key and the fix), 3 a plan that does not fit
# (estimate), 70 an internal error (EX_SOFTWARE; the traceback goes to a log file), 130 interrupted,
# 141 stdout closed early (`nereus plan job.yaml | head`: 128 + SIGPIPE, as other Unix tools exit).
EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 1, 2, 70, 130, 141
# Write failures that no check can foresee (the disk fills during a run): one line naming the file, exit 2
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def _load(args: argparse.Namespace):
    from nereus.spec.job import load_job

    job = load_job(args.job)
    if getattr(args, "gpus", None) is not None:  # an explicit 0 is refused by with_gpus, never ignored
        job = job.with_gpus(args.gpus)
    return job


def _as_run(job):
    """``job`` priced as ``nereus run`` runs it when it has a ``run`` section: the runtime's capability narrows
    the options (padded batches where no token budget packs them, its recompute and FSDP choices), as the
    run's own planner and controller do (``run.setup``, ``run.adaptive``); the capability, to constrain a
    search (None for a planning-only job)."""
    if job.run is None:
        return job, None
    from nereus.runtime.capability import priced_as_run

    return priced_as_run(job)


def _check_out(flag: str, path: str | None, folder: bool = False) -> None:
    """Refuse an output path that cannot be written before any work is done (a failure loses nothing)."""
    if path is None:
        return
    p = Path(path)
    if not folder and p.is_dir():
        raise SpecError(flag, f"{path} is a directory; give a file path")
    if folder and p.exists() and not p.is_dir():
        raise SpecError(flag, f"{path} is a file; give a folder")
    parent = p if folder and p.is_dir() else p.resolve().parent
    if not parent.is_dir():
        raise SpecError(flag, f"folder {parent} does not exist; create it or give another path")
    if not os.access(parent, os.W_OK) or p.exists() and not os.access(p, os.W_OK):
        raise SpecError(flag, f"cannot write {path}: permission denied; give a writable path")


def _number(flag: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    """A finite flag value within [low, high] (or (low, high]): NaN passes every comparison, so check it."""
    if not math.isfinite(value):
        raise SpecError(flag, f"{value} is not a finite number")
    if value < low or low_open and value == low:
        raise SpecError(flag, f"must be {'>' if low_open else '>='} {low:g}, got {value:g}")
    if value > high:
        raise SpecError(flag, f"must be <= {high:g}, got {value:g}")


def cmd_plan(args: argparse.Namespace) -> int:
    from nereus.cost.hardware import Hardware
    from nereus.planner.explain import explain_text, result_json
    from nereus.planner.search import Constraints, search

    _check_out("--out", args.out)
    job, capability = _as_run(_load(args))
    result = search(Hardware(job.cluster), job, constraints=Constraints(capability=capability))
    if args.out is not None:  # the file first: a closed stdout (| head) must not lose it
        write_text_file(args.out, json.dumps(result_json(job, result), indent=1), "--out")
    if args.json:
        print(json.dumps(result_json(job, result), indent=1))
    else:
        print(explain_text(job, result))
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from nereus.cost.hardware import Hardware
    from nereus.cost.plan_cost import check_runnable, estimate_plan
    from nereus.planner.explain import estimate_text
    from nereus.planner.layouts import plan_from_layout, read_plan_file

    job, _ = _as_run(_load(args))
    hw = Hardware(job.cluster)
    if args.plan:
        plan = read_plan_file(args.plan)
        check_runnable(job, plan)  # a user's plan: what run accepts (the cost model prices more)
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
    from nereus.sim.run import check_gpus_remain, simulate
    from nereus.spec.levers import check_policy_lag
    from nereus.spec.trace import load_trace

    if args.policy not in POLICIES:
        raise SpecError("--policy", f"{args.policy!r} is not a policy; choose one of {list(POLICIES)}")
    if args.steps is not None:
        _number("--steps", args.steps, 1, MAX_STEPS)  # 0 is refused, not read as "the trace's"
    _number("--seed", args.seed, 0, MAX_SEED)
    _check_out("--out", args.out)
    job = _load(args)
    if job.algorithm.name == "train":
        raise SpecError("--job", f"{args.job} is a training-only job (algorithm: train); the simulator runs RL "
                                 "jobs (ppo, grpo): give one of those")
    trace = load_trace(args.trace)
    steps = args.steps if args.steps is not None else trace.steps
    first = trace.gpus_at(0, job.cluster.num_gpus)
    job = job.with_gpus(max([first, *(n for _, n in trace.gpus)]))

    def progress(step: int, m, decision) -> None:
        if not args.json and (step % max(1, steps // 20) == 0 or decision.action != "keep"):
            note = f"  {decision.action}: {decision.reason}" if decision.action != "keep" else ""
            print(f"[{step + 1:>5}/{steps}] step {m.step_time_s:8.2f} s  gpus {m.gpus:>5}{note}",
                  file=sys.stderr)

    check_gpus_remain(trace, args.seed, first, steps, args.trace)  # before any step is simulated
    lag = None if args.policy_lag is None else check_policy_lag(args.policy_lag, "--policy-lag")
    record = simulate(job, trace, args.policy, args.seed, steps, initial_gpus=first, progress=progress,
                      policy_lag=lag)
    data = record.to_dict()
    if args.out is not None:
        write_text_file(args.out, json.dumps(data), "--out")
    if args.json:
        print(json.dumps({"summary": data["summary"],
                          "decisions": [d for d in record.decisions if d["action"] != "keep"]}, indent=1))
    else:
        print("\n".join(simulate_text(data)))
    return 0


def simulate_text(run: dict) -> list[str]:
    """What ``nereus simulate`` prints: the summary under plain labels, tail batching and speculation in
    words, and the decisions inside the step with identical consecutive ones grouped."""
    from nereus.sim.explain import decision_lines, notes, summary_lines

    lines = [*summary_lines(run["summary"], simulated=True), "", *notes(run, markdown=False)]
    inside = decision_lines(run)
    if inside:
        lines += ["decisions inside the step (identical consecutive ones grouped):", *(f"  {x}" for x in inside)]
    return [line for i, line in enumerate(lines) if line or (i and lines[i - 1])]  # no doubled blank lines


def cmd_report(args: argparse.Namespace) -> int:
    from nereus.sim.report import load_run, write_report

    _check_out("--out", args.out, folder=True)
    for path in args.runs:  # every file checked before anything is written
        load_run(path)
    try:
        outputs = write_report(args.runs, args.out)
        text = (Path(args.out) / "report.md").read_text()
    except OSError as err:
        raise SpecError("--out", f"cannot write the report into {args.out}: {err.strerror or err}; "
                                 "give a writable folder") from None
    print(text)
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

    # a chunk of at least one byte and at most 1 TiB (more than any device holds); storage up to 1 PB/s
    _number("--chunk-mb", args.chunk_mb, 0, 2**20, low_open=True)
    if args.chunk_mb * 2**20 < 1:
        raise SpecError("--chunk-mb", f"{args.chunk_mb:g} MiB is less than one byte; give at least {2**-20:g}")
    _number("--storage-gb-per-s", args.storage_gb_per_s, 0, 1e6, low_open=True)
    _check_out("--timeline", args.timeline)
    _check_out("--graph", args.graph)
    job = _load(args)
    old, new = _read_plan_arg("--from", args.from_plan), _read_plan_arg("--to", args.to_plan)
    job = check_job_plans(job, old, new)
    options = TransitionOptions(chunk_bytes=int(args.chunk_mb * 2**20))
    result = plan_transition(job, old, new, Hardware(job.cluster), options, args.storage_gb_per_s * 1e9)
    changes = change_lines(old, new)
    if args.timeline is not None:  # files first: a closed stdout (| head) must not lose them
        try:
            write_trace(args.timeline, result.graph, result.schedule)
        except OSError as err:
            raise SpecError("--timeline", f"cannot write {args.timeline}: {err.strerror or err}") from None
    if args.graph is not None:
        write_text_file(args.graph, json.dumps(result.graph.to_json()), "--graph")
    if args.json:
        print(json.dumps({"job": job.name, "num_gpus": result.graph.num_gpus, "changes": changes,
                          **result.report.to_dict()}, indent=1))
    else:
        c = job.cluster
        print(f"Transition for '{job.name}' on {result.graph.num_gpus} x {c.gpu.name} "
              f"({c.nodes} node(s) x {c.gpus_per_node})")
        print("\n".join(changes))
        print(result.report.text())
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    if args.workers < 2:
        raise SpecError("--workers", f"must be >= 2 (collectives need two workers), got {args.workers}")
    if args.workers > max_profile_workers():
        raise SpecError("--workers", f"{args.workers} is more than {max_profile_workers()} (4 per CPU of this "
                                     "machine): more processes only time-share the cores and the figures would "
                                     "measure the scheduler; give fewer")
    _number("--memory-gb", args.memory_gb, 0, 1e6, low_open=True)
    _check_out("--out", args.out)
    try:
        import torch.multiprocessing as mp

        from nereus.runtime.cluster import profile
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


def max_profile_workers() -> int:
    """Most local worker processes ``nereus profile`` starts: 4 per CPU, at least 4, at most 256."""
    return min(256, max(4, 4 * (os.cpu_count() or 1)))


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (argparse prints the usage block first)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("simulate", help="run a policy over a trace on the simulated cluster")
    s.add_argument("trace", help="trace file (YAML or JSON; see docs/simulator.md)")
    s.add_argument("--job", required=True, help="job spec (YAML)")
    s.add_argument("--policy", default="nereus", help="nereus, nereus-tail, nereus-interstep, nereus-nocal, "
                                                      "fixed-oracle, fixed-recipe, verl-like, openrlhf-like, "
                                                      "realhf-like, pat-like, rlhfuse-like, spec-like, "
                                                      "rollpacker-like, april-like, verl-async-like")
    s.add_argument("--policy-lag", type=int, default=None,
                   help="run.policy_lag: 0 strictly on-policy, 1 one step of lag allowed (default: the job's "
                        "run section, else the trace's, else 0)")
    s.add_argument("--seed", type=int, default=0, help="fixes hidden efficiencies, noise and length draws")
    s.add_argument("--steps", type=int, help="steps to run (default: the trace's)")
    s.add_argument("--out", help="write the run record (JSON) here, for `nereus report`")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_simulate)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="nereus", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
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
    _add_simulate_parser(sub)
    r = sub.add_parser("report", help="Markdown table, PNG plots and a Perfetto timeline of runs")
    r.add_argument("runs", nargs="+", help="run records: written by `nereus simulate --out`, or a run's "
                                           "run_record.json (its metrics.jsonl beside it adds learning curves)")
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
    for command in sub.choices.values():  # a subcommand may bring its own parser class: errors stay one line
        if not isinstance(command, OneLineParser):
            command.error = OneLineParser.error.__get__(command)  # type: ignore[method-assign]
    return parser


# One error line stays readable whatever the input (spec.errors caps its parts; Ray's messages are long)
MAX_ERROR_CHARS = 4000


def _one_line(text: str) -> str:
    """A message as one line of bounded length: a key or value from a file may hold newlines."""
    return cut(text, MAX_ERROR_CHARS)


def _stdout_gone() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again (Python docs,
    "Note on SIGPIPE", https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # a captured or replaced stdout has no file descriptor
        pass


# Internal-error tracebacks go to one cache folder (not a new /tmp file per failure), newest kept.
TRACEBACKS_KEPT = 20


def traceback_folder() -> Path:
    """``$NEREUS_CACHE_DIR/tracebacks``, else ``$XDG_CACHE_HOME/nereus/tracebacks`` (``~/.cache``): one folder,
    owner-only, pruned to the newest ``TRACEBACKS_KEPT`` files."""
    base = os.environ.get("NEREUS_CACHE_DIR") or str(Path(os.environ.get("XDG_CACHE_HOME") or
                                                          Path.home() / ".cache") / "nereus")
    return Path(base) / "tracebacks"


def _save_traceback(err: BaseException) -> Path:
    folder = traceback_folder()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, log = tempfile.mkstemp(prefix=time.strftime("traceback-%Y%m%d-%H%M%S-"), suffix=".log", dir=folder)
    with os.fdopen(fd, "w") as f:
        f.write(f"nereus {' '.join(sys.argv[1:])}\n")
        traceback.print_exception(err, file=f)
    old = sorted(folder.glob("traceback-*.log"), key=lambda p: p.stat().st_mtime)[:-TRACEBACKS_KEPT]
    for path in old:
        path.unlink(missing_ok=True)
    return Path(log)


def _internal_error(err: BaseException) -> int:
    """A bug, not bad input: one line naming the log file that holds the traceback."""
    head = _one_line(f"{type(err).__name__}: {err}")[:200]
    try:
        log = _save_traceback(err)
    except OSError as log_err:  # the cache folder itself is full or unwritable
        print(f"nereus: internal error ({head}); the traceback could not be saved ({log_err.strerror}); "
              "please report it", file=sys.stderr)
        return EXIT_INTERNAL
    print(f"nereus: internal error ({head}); traceback in {log}; please report it", file=sys.stderr)
    return EXIT_INTERNAL


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; every failure is one line on stderr and an exit code (see the EXIT_ constants)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help (0) or a usage error (2, one line)
        return done.code if isinstance(done.code, int) else EXIT_BAD_INPUT
    try:
        return args.func(args)
    except (SpecError, InfeasibleError) as err:
        print(f"nereus: error: {_one_line(str(err))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RuntimeFailure as err:  # the cluster, not the input: one line, checkpoints stay resumable
        print(f"nereus: error: {_one_line(str(err))}", file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:
        _stdout_gone()
        return EXIT_BROKEN_PIPE
    except OSError as err:
        if err.errno not in _WRITE_ERRNOS:
            return _internal_error(err)
        # the machine, not the code: a full disk, or a read-only or forbidden path met mid-command
        where = f"{err.filename}: " if err.filename else ""
        print(f"nereus: error: {_one_line(where)}{err.strerror}; free space or fix the path or its permissions",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("nereus: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:  # noqa: BLE001 - the last resort: bad input never gets here (tests/fuzz)
        return _internal_error(err)


if __name__ == "__main__":
    sys.exit(main())
