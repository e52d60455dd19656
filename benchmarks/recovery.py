"""Recovery from a lost worker versus checkpoint-restart, for the same RL job, measured in one run.

The job is ``examples/ppo_tiny_fixed.yaml`` (PPO, four models, every model-stage under a fixed layout on 4
Ray workers, the actor's training at DP = 2), shortened for a benchmark. Twice, from the same warm start,
worker 1 is SIGKILLed in the middle of step ``--lose-at`` (after its backward pass in the step's first
optimizer update):

* ``nereus``: host-memory snapshots every step (``run.checkpoint.snapshot_every: 1``); the job detects the
  loss, re-plans onto the three survivors, restores the step's starting state from live replicas and the
  snapshot, and redoes the step (``RLJob.recover``);
* ``restart`` (what verl and OpenRLHF do): disk checkpoints every ``--checkpoint-every`` steps and no
  snapshots; the job dies, then a new runtime of 4 workers starts, loads the latest checkpoint
  (``nereus run --resume``'s path) and replays the steps from it up to and including the lost one.

A third run, ``lost node``, is the ``nereus`` run on a Ray cluster of a head and two worker nodes of two
CPUs each on this machine (``nodes.start_local_cluster``, in a child process: one driver, one cluster),
workers 0-1 on one node and 2-3 on the other (the reward model's TP group on ranks [2, 3] instead of
[1, 2], so that it stays inside a node); in step ``--lose-at`` the second node is killed — its raylet,
object store and both workers — and the job recovers on the two survivors, reading the lost node's
snapshot images from their copies on the head node.

All pay the lost work of the failed step. Printed: each part, the totals, their ratio, and the ratio
without the replay (a failure just after a checkpoint), plus the snapshots' cost per step. On a real
cluster a restart also waits for the scheduler, containers and inference engines (minutes: see
``nereus.control.loop.Recovery.restart_s``); here it only pays what this machine measures.

    .venv/bin/python benchmarks/recovery.py [--steps 6] [--lose-at 3] [--checkpoint-every 2] [--json PATH]
                                            [--no-lost-node]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nereus.run.driver import RLStep  # noqa: E402
from nereus.run.job import RLJob  # noqa: E402
from nereus.run.training import StepTraining  # noqa: E402
from nereus.runtime.comm.faults import FaultPlan  # noqa: E402
from nereus.runtime.recovery.failover import WorkerLostError  # noqa: E402
from nereus.spec.errors import SpecError  # noqa: E402
from nereus.spec.job import job_from_dict  # noqa: E402

LOST_WORKER = 1


def make_job(out: Path, steps: int, snapshot_every: int, checkpoint_every: int, small: bool, two_nodes: bool = False,
             own_keys: bool = False):
    """``own_keys``: the actor's inference on workers 2-3, so that no two model-stages share a runtime key (as
    under the controller) and a plan transition can move any of them (``benchmarks/chaos.py``)."""
    spec = yaml.safe_load((ROOT / "examples" / "ppo_tiny_fixed.yaml").read_text())
    spec["name"] = "recovery-bench"
    spec["cluster"]["profile"] = str(ROOT / "examples" / spec["cluster"]["profile"])  # relative to the example
    spec["run"].update(steps=steps, eval_every=10**6, data={"train_size": 400, "val_size": 8, "max_digits": 4},
                       warmstart={"actor_steps": 20 if small else 60, "reward_steps": 20 if small else 60,
                                  "batch": 32, "lr": 0.003},
                       checkpoint={"dir": str(out), "every": checkpoint_every, "snapshot_every": snapshot_every})
    if own_keys:
        spec["run"]["layouts"]["actor/inference"]["ranks"] = [2, 3]
    if two_nodes:  # two nodes of two workers: every TP group inside one of them
        spec["run"]["layouts"]["reward/inference"]["ranks"] = [2, 3]
        spec["cluster"].update(nodes=2, gpus_per_node=2)
    return job_from_dict(spec)


class LoseWorker:
    """Hands the runtime a fault plan killing a worker at ``train_step`` before the first optimizer update
    of one step."""

    def __init__(self, step: int) -> None:
        self.step, self.fired = step, False
        self.real = StepTraining.update

    def __enter__(self) -> LoseWorker:
        bench = self

        def update(training, model, batch, loss_fn, lr, step):
            if step == bench.step and not bench.fired:
                bench.fired = True
                bench.t_kill_armed = time.perf_counter()
                training.calls.rt.inject(FaultPlan.kill(LOST_WORKER, "train_step"))
            return bench.real(training, model, batch, loss_fn, lr, step)

        StepTraining.update = update
        return self

    def __exit__(self, *exc) -> None:
        StepTraining.update = self.real


def run_nereus(args, out: Path) -> dict:
    job = make_job(out, args.steps, 1, 0, args.small)
    rl = RLJob(job, quiet=True)
    with LoseWorker(args.lose_at):
        summary = rl.execute()
    rl.rt.shutdown()
    return summarize(args, out, summary)  # steps before the loss: from the second (the first warms up)


def summarize(args, out: Path, summary: dict) -> dict:
    """The recovery's parts and the steps around it, from the run's summary and metrics."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    [rec] = summary["recoveries"]
    redo = rows[args.lose_at]["timing_s/step"]
    steps = [r["timing_s/step"] for i, r in enumerate(rows) if i != args.lose_at]
    return {"lost_work_s": rec["lost_work_s"], "world_s": rec["world"], "restore_s": rec["restore"],
            "recover_s": rec["wall_s"], "redo_s": redo, "total_s": rec["lost_work_s"] + rec["wall_s"] + redo,
            "step_s": statistics.median(steps), "snapshot_s": statistics.median(r["nereus/snapshot_s"] for r in rows),
            "steps_before_loss_s": [r["timing_s/step"] for r in rows[1:args.lose_at]],
            "steps_after_s": [r["timing_s/step"] for r in rows[args.lose_at + 1:]],
            "live_state": rec["live_state"], "snapshot_only": rec["snapshot_only"], "workers_after": rec["workers"],
            "lost": rec["lost"], "lost_nodes": len(rec.get("lost_nodes", [])),
            "images_from_copies": rec.get("images_from_copies", 0)}


@contextlib.contextmanager
def losing_a_node(lose_at: int):
    """A runtime of 4 workers on a local Ray cluster of a head and two worker nodes of two CPUs each
    (workers 0-1 on one, 2-3 on the other), whose second node is removed — raylet, object store, workers 2
    and 3 — in the first optimizer update of step ``lose_at``. For a child process: one driver, one cluster."""
    import ray

    from nereus.runtime.cluster.workers import Runtime
    from nereus.runtime.hosts.nodes import start_local_cluster

    # objects above 1 KiB in the object store, so no snapshot image of the tiny models sits in the driver
    cluster, _ = start_local_cluster(2, 2, system_config={"max_direct_call_object_size": 1024})
    real, fired = StepTraining.update, []
    try:
        rt = Runtime(4, address=cluster.address)
        second = next(n for n in cluster.worker_nodes if n.node_id == rt.homes[2])

        def update(training, model, batch, loss_fn, lr, step):
            if step == lose_at and not fired:
                fired.append(model)
                cluster.remove_node(second, allow_graceful=False)
            return real(training, model, batch, loss_fn, lr, step)

        StepTraining.update = update
        yield rt
        rt.shutdown()
    finally:
        StepTraining.update = real
        ray.shutdown()
        cluster.shutdown()


def run_lost_node(args, out: Path) -> dict:
    """The ``nereus`` run on a local cluster of two worker nodes, the second lost in step ``--lose-at``
    (run in a child process of this script: ``--lost-node-child``)."""
    with losing_a_node(args.lose_at) as rt:
        rl = RLJob(make_job(out, args.steps, 1, 0, args.small, two_nodes=True), runtime=rt, quiet=True)
        summary = rl.execute()
    return summarize(args, out, summary)


def lost_node_child(args, out: Path) -> dict:
    """``run_lost_node`` in a fresh interpreter (this process already drives the local Ray instance)."""
    result = out / "lost_node.json"
    cmd = [sys.executable, __file__, "--lost-node-child", str(out), "--steps", str(args.steps),
           "--lose-at", str(args.lose_at)] + (["--small"] if args.small else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"the lost-node run failed:\n{proc.stderr[-4000:]}")
    return json.loads(result.read_text())


def run_restart(args, out: Path) -> dict:
    import ray

    from nereus.runtime.cluster.workers import Runtime

    job = make_job(out, args.steps, 0, args.checkpoint_every, args.small)
    rl = RLJob(job, quiet=True)
    t_step = None
    times: list[float] = []
    real_step = RLStep.run_step  # what the runtime backend calls for each step

    def timed_step(rl_step, step, policy=None, levers=None):
        out = real_step(rl_step, step, policy, levers)
        times.append(out.metrics["timing_s/step"])
        return out

    RLStep.run_step = timed_step
    with LoseWorker(args.lose_at) as lose:
        try:
            rl.execute()
            raise RuntimeError("the worker loss did not happen")
        except SpecError as err:  # no snapshots: the job stops, naming --resume
            cause = err.__cause__  # the worker loss, possibly wrapped by the control loop (WorkersLost)
            while cause is not None and not isinstance(cause, WorkerLostError):
                cause = cause.__cause__
            if cause is None:
                raise
        t_step = lose.t_kill_armed
    RLStep.run_step = real_step
    lost_work = time.perf_counter() - t_step  # the failed step until the job gave up
    t0 = time.perf_counter()
    for w in rl.rt.workers:  # the whole job goes down
        ray.kill(w)
    rt = Runtime(4, max_workers=4)
    t_world = time.perf_counter()
    job2 = replace(job, run=replace(job.run, steps=args.lose_at + 1))
    rl2 = RLJob(job2, runtime=rt, out_dir=out, quiet=True)
    resumed_at = rl2._restore()
    t_loaded = time.perf_counter()
    for step in range(resumed_at, args.lose_at + 1):
        rl2.backend.rl_step.step(step)  # the RL step lives in the run's runtime backend
    t1 = time.perf_counter()
    rt.shutdown()
    return {"lost_work_s": lost_work, "relaunch_s": t_world - t0, "load_s": t_loaded - t_world,
            "replay_steps": args.lose_at - resumed_at, "replay_and_redo_s": t1 - t_loaded,
            "total_s": lost_work + (t1 - t0), "checkpoint_step": resumed_at,
            "steps_before_loss_s": times[1:args.lose_at]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--lose-at", type=int, default=3, help="0-based step in which worker 1 is killed")
    ap.add_argument("--checkpoint-every", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="a smaller job, for smoke tests")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-lost-node", action="store_true", help="skip the run on two nodes that loses one")
    ap.add_argument("--lost-node-child", type=Path, help=argparse.SUPPRESS)  # internal: the child process
    args = ap.parse_args()
    if args.lost_node_child:
        out = args.lost_node_child
        (out / "lost_node.json").write_text(json.dumps(run_lost_node(args, out / "run")))
        return 0
    if not 0 < args.lose_at < args.steps:
        ap.error("--lose-at must be within the run (after its first step)")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    tmp = Path(tempfile.mkdtemp(prefix="nereus-recovery-", dir=ROOT / ".tmp" if (ROOT / ".tmp").exists() else None))
    try:
        print(f"job: examples/ppo_tiny_fixed.yaml, {args.steps} steps, worker {LOST_WORKER} of 4 killed in step "
              f"{args.lose_at + 1}", flush=True)
        ner = run_nereus(args, tmp / "nereus")
        print(f"nereus : lost work {ner['lost_work_s']:.2f} s + recover {ner['recover_s']:.2f} s (re-form world "
              f"{ner['world_s']:.2f} s, restore {ner['restore_s']:.2f} s) + redo step {ner['redo_s']:.2f} s = "
              f"{ner['total_s']:.2f} s; live state {ner['live_state']}, from the snapshot {ner['snapshot_only']}, "
              f"{ner['workers_after']} workers after (later steps there: "
              f"{', '.join(f'{t:.2f}' for t in ner['steps_after_s']) or '-'} s)", flush=True)
        rst = run_restart(args, tmp / "restart")
        print(f"restart: lost work {rst['lost_work_s']:.2f} s + relaunch {rst['relaunch_s']:.2f} s + load checkpoint "
              f"(step {rst['checkpoint_step']}) {rst['load_s']:.2f} s + replay {rst['replay_steps']} step(s) and redo "
              f"{rst['replay_and_redo_s']:.2f} s = {rst['total_s']:.2f} s", flush=True)
        node = None if args.no_lost_node else lost_node_child(args, tmp)
        if node:
            print(f"lost node: lost work {node['lost_work_s']:.2f} s + recover {node['recover_s']:.2f} s (re-form "
                  f"world {node['world_s']:.2f} s, restore {node['restore_s']:.2f} s, "
                  f"{node['images_from_copies']} snapshot images from their copies) + redo step "
                  f"{node['redo_s']:.2f} s = {node['total_s']:.2f} s; workers "
                  f"{node['lost']} lost with their node, {node['workers_after']} workers after (later steps there: "
                  f"{', '.join(f'{t:.2f}' for t in node['steps_after_s']) or '-'} s)", flush=True)
        redo_one = rst["replay_and_redo_s"] / (rst["replay_steps"] + 1)  # the restarted job's step, same layouts
        no_replay = rst["lost_work_s"] + rst["relaunch_s"] + rst["load_s"] + redo_one
        print(f"ratio restart/nereus: {rst['total_s'] / ner['total_s']:.2f}x as measured; "
              f"{no_replay / ner['total_s']:.2f}x for a failure just after a checkpoint (no replay)")
        if node:
            print(f"ratio restart/lost node: {rst['total_s'] / node['total_s']:.2f}x as measured; recover: lost node "
                  f"{node['recover_s']:.2f} s vs lost worker {ner['recover_s']:.2f} s "
                  f"({node['recover_s'] / ner['recover_s']:.2f}x)")
        with_snap = statistics.median(ner["steps_before_loss_s"])
        without = statistics.median(rst["steps_before_loss_s"])
        print(f"snapshots: {ner['snapshot_s'] * 1e3:.1f} ms of driver time per step; median step before the loss "
              f"{with_snap:.3f} s with snapshots vs {without:.3f} s without (ratio {with_snap / without:.3f}, "
              f"same layouts, steps 2..{args.lose_at})")
        if args.json:
            args.json.write_text(json.dumps({"nereus": ner, "restart": rst, "no_replay_restart_s": no_replay,
                                             "lost_node": node}, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
