"""The `nereus run` subcommand (registered by nereus/cli.py)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nereus.run.job import RLJob
    from nereus.spec.job import JobSpec

# nereus.cli's exit code for bad input (its EXIT_BAD_INPUT), returned by --cfg job when it found a problem
EXIT_BAD_INPUT = 2


def cmd_cfg_job(args: argparse.Namespace) -> int:
    """``--cfg job``: print the job the overrides make (YAML, each verl key's fate as comments) and every
    problem, one line each on stderr; start nothing (``spec.cfg_job``)."""
    from nereus.spec.cfg_job import resolve_job

    report = resolve_job(args.job, args.overrides)
    print(report.text(), end="")
    for problem in report.problems:
        print(f"nereus: error: {problem}", file=sys.stderr)
    return EXIT_BAD_INPUT if report.problems else 0


def cmd_run(args: argparse.Namespace) -> int:
    from nereus.spec.data_files import check_data_files
    from nereus.spec.effective import header_line
    from nereus.spec.errors import SpecError
    from nereus.spec.job import load_effective

    if args.cfg == "job":
        return cmd_cfg_job(args)
    job, config = load_effective(args.job, args.overrides)  # key.path=value overrides, validated like the file
    if job.run is None:
        raise SpecError("run", f"{args.job} has no `run:` section; see docs/rl.md and examples/ppo_tiny.yaml")
    try:  # every refusal until the job is accepted names the key as the user typed it (spec.typed_keys)
        check_data_files(job.run)  # by name, before anything heavy is imported (spec.data_files)
        _check_run_args(args, Path(args.out or job.run.checkpoint_dir))
        _check_verl_gpus(args, job.run.workers, config.typed.typed)
        rl = _accept(args, job)
    except SpecError as err:
        raise config.typed.rename(err) from None
    workers = f"{rl.run.workers} local workers"
    if rl.run.adapt is not None:
        workers = (f"{rl.run.adapt.workers_at(0, rl.run.workers)} local workers (up to {rl.run.max_workers}), "
                   "layouts chosen and changed by the controller")
    print(f"nereus run: {job.name} ({job.algorithm.name}, {job.run.steps} steps) on {workers}; output in {rl.dir}",
          file=sys.stderr)
    # the job as it runs, overrides applied: one line here, the whole tree beside metrics.jsonl (spec.effective)
    print(f"  {header_line(job)}; config {config.save(rl.dir, rl.job)}", file=sys.stderr)
    for p in rl.placed:
        print(f"  {p.model + '/' + p.stage:<22} {p.layout.short():<22} workers {list(p.ranks)}", file=sys.stderr)
    from nereus.runtime.hosts.raylocal import exit_on_signals

    # SIGTERM, SIGINT, SIGHUP: workers released, Ray shut down and reaped, exit 128 + signal (docs/reliability.md)
    signalled = exit_on_signals()
    try:
        summary = rl.execute(resume=args.resume)
    except SystemExit:
        if signalled() is None:
            raise
        print(f"nereus: stopped by {signal.Signals(signalled()).name}; the last checkpoint resumes (--resume)",
              file=sys.stderr)
        raise SystemExit(128 + signalled()) from None
    finally:
        rl.release()
    if args.json:
        print(json.dumps(summary, indent=1))
    return 0


def _accept(args: argparse.Namespace, job: JobSpec) -> RLJob:
    """The job's runtime side set up and checked (models, data, layouts, the user's code), before the
    header: nothing has run yet."""
    from nereus.spec.errors import SpecError

    try:
        from nereus.rl.data import DataError
        from nereus.run.job import RLJob
    except ImportError as err:
        raise SpecError("run", f"needs the runtime's dependencies ({err.name} is missing); "
                               "install them with: pip install -e '.[runtime]'") from None
    if args.address:  # before any work: a bounded probe, not minutes of Ray's retries (runtime.hosts.address)
        from nereus.runtime.hosts.address import check_address

        args.address = check_address(args.address)
    try:
        rl = RLJob(job, out_dir=args.out, workers=args.workers, address=args.address)
    except DataError as err:
        raise SpecError("run.data", str(err)) from None
    from nereus.run.user_check import check_user_code

    check_user_code(job.run)  # imported and checked in a child process, before the header (run.user_check)
    return rl


def _check_verl_gpus(args: argparse.Namespace, workers: int, typed: tuple[str, ...]) -> None:
    """``--workers`` and verl's ``trainer.nnodes`` x ``trainer.n_gpus_per_node`` (``run.workers``) must agree:
    neither silently wins over the other."""
    from nereus.spec.errors import SpecError

    given = [k for k in ("trainer.nnodes", "trainer.n_gpus_per_node") if k in typed]
    if given and args.workers is not None and args.workers != workers:
        raise SpecError("--workers", f"{args.workers} differs from the {workers} GPUs of {' x '.join(given)}: give "
                                     "one of the two")


def _check_run_args(args: argparse.Namespace, out: Path) -> None:
    """Refuse bad flags before anything is created: an explicit --workers 0 is an error, not the default,
    and --resume from a folder that does not exist must not create it."""
    from nereus.spec.errors import SpecError
    from nereus.spec.run import MAX_WORKERS

    if args.workers is not None and not 1 <= args.workers <= MAX_WORKERS:
        raise SpecError("--workers", f"must be between 1 and {MAX_WORKERS}, got {args.workers}")
    if out.exists() and not out.is_dir():
        raise SpecError("--out", f"{out} is a file; give the run's output folder")
    if args.resume and not out.is_dir():
        raise SpecError("--out", f"{out} does not exist: nothing to resume from; check the path "
                                 "(--out or run.checkpoint.dir)")
    try:  # the spec is valid: make the folder the run writes first (data/, init/) and prove it takes a file
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise SpecError("--out", f"cannot write into {out}: {err.strerror or err}; give a writable folder") from None


def cmd_scale(args: argparse.Namespace) -> int:
    """Ask a running adaptive job to grow or shrink: it reads the request at its next step boundary."""
    from nereus.run.records import write_scale_request
    from nereus.spec.errors import SpecError
    from nereus.spec.run import MAX_WORKERS

    if not 1 <= args.workers <= MAX_WORKERS:
        raise SpecError("workers", f"must be between 1 and {MAX_WORKERS}, got {args.workers}")
    # a run writes its warm start (init/) and metrics.jsonl first: a folder with neither is not a run's
    if not args.dir.is_dir() or not ((args.dir / "init").is_dir() or (args.dir / "metrics.jsonl").is_file()):
        raise SpecError("--dir", f"{args.dir} is not a run's output folder (it has no init/ or metrics.jsonl); "
                                 "give the folder of the running job (run.checkpoint.dir or --out)")
    _check_capacity(args.dir, args.workers)
    write_scale_request(args.dir, args.workers)  # atomic: the job never reads half a file
    print(f"asked the job in {args.dir} to run on {args.workers} workers (applied at its next step boundary)")
    return 0


def _check_capacity(run_dir: Path, workers: int) -> None:
    """Refuse at once a size the run's own local Ray cannot place (its CPUs, from ray_session.json:
    `scale 6` on a 4-CPU Ray would otherwise leave the run waiting). The run refuses it too, and keeps going."""
    from nereus.run.records import read_session_record
    from nereus.spec.errors import SpecError

    # strict: a FIFO, a directory or garbage is refused by name
    record = read_session_record(run_dir, ("num_cpus",),
                                 "remove it if no run uses that folder (the next run writes a new one)")
    if record is None:
        return  # joined a cluster: the run itself refuses what it cannot place
    cpus = record["num_cpus"]
    if workers > cpus:
        raise SpecError("workers", f"the run in {run_dir} started a local Ray with {cpus} CPUs, one per worker: "
                                   f"at most {cpus} workers fit, asked for {workers} (a larger run.max_workers "
                                   "gives the next run room)")


def cmd_cleanup(args: argparse.Namespace) -> int:
    """Kill what a killed driver left of its local Ray (``raylocal.cleanup_run``): the run's in ``--dir``,
    else of every driver that is gone."""
    from nereus.run.records import read_session_record
    from nereus.runtime.hosts.raylocal import SESSION, cleanup_run
    from nereus.spec.errors import SpecError

    record = None
    if args.dir is not None:
        record = read_session_record(args.dir, ("owner",), "run `nereus cleanup` without --dir (it needs no record)")
        if record is None:
            raise SpecError("--dir", f"{args.dir / SESSION} does not exist: the run in {args.dir} did not start a "
                                     "local Ray (run `nereus cleanup` without --dir to clean every dead driver's)")
    what, killed = cleanup_run(record)
    print(f"nereus cleanup: {what}: killed {len(killed)} process(es)" + (f" {killed}" if killed else ""))
    return 0


class _RunParser(argparse.ArgumentParser):
    """``nereus run``'s parser: overrides may also follow the flags (argparse stops filling a positional
    list at the first flag, so ``JOB --workers 2 run.steps=3`` would leave ``run.steps=3`` unparsed)."""

    def parse_known_args(self, args: list[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        ns, extra = super().parse_known_args(args, namespace)
        late = [a for a in extra if not a.startswith("-") and ("=" in a or a.startswith("~"))]
        ns.overrides = [*(getattr(ns, "overrides", None) or []), *late]
        return ns, [a for a in extra if a not in late]


def add_parser(sub: argparse._SubParsersAction) -> None:
    default_class, sub._parser_class = sub._parser_class, _RunParser
    try:
        r = sub.add_parser("run", help="run an RL job (PPO/GRPO) on local workers: metrics, checkpoints, --resume")
    finally:
        sub._parser_class = default_class
    r.add_argument("job", help="job spec (YAML) with a `run:` section")
    r.add_argument("overrides", nargs="*", metavar="key.path=value",
                   help="override keys of the job file before validation, e.g. run.clip_ratio=0.3 "
                        "algorithm.samples_per_prompt=4 (verl's keys too: docs/rl.md); ~key.path removes one")
    r.add_argument("--workers", type=int, help="local worker processes (default: run.workers, 4)")
    r.add_argument("--out", type=Path, help="output folder (default: run.checkpoint.dir)")
    r.add_argument("--address", help="join the Ray cluster at this address (what `ray start --head` printed) "
                                     "instead of starting a local Ray; see docs/reliability.md#several-nodes")
    r.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the output folder")
    r.add_argument("--json", action="store_true", help="print the summary as JSON")
    r.add_argument("--cfg", choices=["job"], help="job: print the job as the overrides make it, with what Nereus "
                                                  "does with each verl key, and every problem; start nothing")
    r.set_defaults(func=cmd_run)
    c = sub.add_parser("scale", help="grow or shrink a running adaptive job (run.adapt) to N workers")
    c.add_argument("workers", type=int, help="the number of workers the job should run on")
    c.add_argument("--dir", type=Path, required=True, help="the running job's output folder")
    c.set_defaults(func=cmd_scale)
    k = sub.add_parser("cleanup", help="kill the Ray processes a killed `nereus run` driver left behind")
    k.add_argument("--dir", type=Path, help="the run's output folder (default: every driver that is gone)")
    k.set_defaults(func=cmd_cleanup)
