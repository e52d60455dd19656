"""Failure injection for real: a worker SIGKILLed at each place an RL step can lose one, on local Ray workers,
and what the job paid for it — measured against an uninterrupted run of the same job in one invocation.

The job is ``examples/ppo_tiny_fixed.yaml`` shortened (PPO, four models, fixed layouts on 4 workers, host-memory
snapshots every step: ``run.checkpoint.snapshot_every: 1``). Each kind kills worker 1 once, in step
``--lose-at`` (0-based), at a fault point of the runtime (``runtime.comm.faults``):

* ``generation_mid_decode``: a rollout engine's replica after its first decode iteration (point ``generate``);
* ``trainer_mid_backward``: a training rank while autograd runs (point ``backward``: its peers wait in the
  gradient all-reduce);
* ``weight_sync``: a rank while the trained actor's weights move to its generation layout (``sync.transfer``);
* ``live_transition``: a rank while a live transition moves the reward model's inference from TP 2 to DP 2
  after step ``--lose-at − 1`` (``transition.transfer``; the next step's snapshot is taken before the move);
* ``node``: a whole local node (raylet, object store, workers 2 and 3) of a two-node Ray cluster on this machine,
  in the step's first optimizer update (``benchmarks/recovery.py``'s lost-node run, in a child process).

For each: whether the job recovered and finished every step, the recovery's seconds (re-form the world on the
survivors and restore the step's starting state), steps lost (steps run again: the step in flight at most),
samples lost (training samples of the run never trained on: a recovery redoes the lost step's prompts), and
whether the final actor and critic weights equal an uninterrupted run's from the same start. The recovered
run finishes on three workers (two after a lost node), so its sums run in another order: equal means within
float32 round-off (``--rtol``/``--atol``); the largest difference is printed.

    .venv/bin/python benchmarks/chaos.py [--kinds K,K..] [--steps 3] [--lose-at 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from recovery import losing_a_node, make_job  # noqa: E402  (this folder: benchmarks/recovery.py)

from nereus.control.backend import Decision  # noqa: E402
from nereus.run.driver import RLStep  # noqa: E402
from nereus.run.job import RLJob  # noqa: E402
from nereus.runtime.comm.faults import FaultPlan  # noqa: E402

LOST = 1  # the worker each in-process kind kills
POINTS = {"generation_mid_decode": "generate", "trainer_mid_backward": "backward", "weight_sync": "sync.transfer",
          "live_transition": "transition.transfer"}
KINDS = (*POINTS, "node")


class Counted:
    """Counts the RL steps the runtime backend starts (a redone step counts twice) and, for a kind killed
    inside a step, arms its fault as step ``lose_at`` starts."""

    def __init__(self, lose_at: int, point: str | None) -> None:
        self.lose_at, self.point, self.started, self.fired = lose_at, point, 0, False
        self.trained: dict[int, list[int]] = {}  # step -> the training prompts' rows, of its finished run
        self.real = RLStep.run_step

    def __enter__(self) -> Counted:
        bench = self

        def run_step(rl_step, step, policy=None, levers=None):
            bench.started += 1
            if bench.point is not None and step == bench.lose_at and not bench.fired:
                bench.fired = True
                rl_step.rt.inject(FaultPlan.kill(LOST, bench.point))
            out = bench.real(rl_step, step, policy, levers)
            bench.trained[step] = [p.index for p in rl_step.generation.prompts(step)]
            return out

        RLStep.run_step = run_step
        return self

    def __exit__(self, *exc) -> None:
        RLStep.run_step = self.real


class MoveRewardToDP2:
    """The held plan, moved once after step ``after``: the reward model's inference from one TP-2 replica to
    two TP-1 replicas on the same two workers (1 and 2), so each gathers the half of the weights it lacks (a
    move the controller could command). With ``kill``, worker ``LOST`` is armed to die in that move's
    transfers."""

    def __init__(self, held, after: int, kill: bool) -> None:
        self.held, self.name, self.after, self.kill, self.job = held, held.name, after, kill, None

    def __getattr__(self, name: str):
        return getattr(self.held, name)

    def after_step(self, metrics, cluster):
        decision = self.held.after_step(metrics, cluster)
        if metrics.step != self.after:
            return decision
        plan = self.held.plan
        moved = tuple(replace(p, layout=replace(p.layout, tp=1, dp=2)) if str(p.model_stage) == "reward/inference"
                      else p for p in plan.placements)
        self.held.plan = replace(plan, placements=moved)
        if self.kill:
            self.job.rt.inject(FaultPlan.kill(LOST, "transition.transfer"))
        return Decision(metrics.step, "transition", "reward inference at DP 2 (chaos)", plan=self.held.plan)


def run_job(args, out: Path, kind: str | None, baseline_of: str | None = None) -> dict:
    """One run of the job: the uninterrupted baseline of ``baseline_of``'s job when ``kind`` is None."""
    which = kind or baseline_of
    job = make_job(out, args.steps, 1, 0, small=True, two_nodes=which == "node", own_keys=which == "live_transition")
    rl = RLJob(job, quiet=True)
    if which == "live_transition":
        rl.policy = MoveRewardToDP2(rl.policy, args.lose_at - 1, kill=kind is not None)
        rl.policy.job = rl  # its runtime starts with the run
    point = POINTS.get(kind) if kind != "live_transition" else None
    try:
        with Counted(args.lose_at, point) as counted:
            summary = rl.execute()
    finally:
        rl.rt.shutdown()
    return {"summary": summary, "started": counted.started, "trained": counted.trained,
            "samples_per_prompt": job.algorithm.samples_per_prompt}


def final_weights(run_dir: Path, steps: int) -> dict:
    from safetensors.torch import load_file

    folder = run_dir / f"step_{steps}"
    return {m: load_file(str(folder / m / "model.safetensors")) for m in ("actor", "critic")}


def compare(got: dict, want: dict, rtol: float, atol: float) -> tuple[bool, float]:
    import torch

    worst, equal = 0.0, True
    for model, tensors in want.items():
        for name, w in tensors.items():
            g = got[model][name]
            worst = max(worst, float((g - w).abs().max()))
            equal = equal and bool(torch.allclose(g, w, rtol=rtol, atol=atol))
    return equal, worst


def samples_lost(got: dict[int, list[int]], want: dict[int, list[int]], per_prompt: int) -> int:
    """Training samples the uninterrupted run trained on and the recovered one did not (prompt rows per
    step, each ``per_prompt`` samples)."""
    lost = 0
    for step, rows in want.items():
        have = list(got.get(step, []))
        for r in rows:
            if r in have:
                have.remove(r)
            else:
                lost += per_prompt
    return lost


def measure(args, tmp: Path, kind: str, base: dict, base_dir: Path) -> dict:
    """One kind: the faulted run (the lost node's in a child process) against its uninterrupted baseline."""
    out = tmp / kind
    ran = node_child(args, out) if kind == "node" else run_job(args, out, kind)
    recs = ran["summary"]["recoveries"]
    rec = recs[0] if len(recs) == 1 else {"wall_s": float("nan"), "world": float("nan"), "restore": float("nan"),
                                          "lost": []}
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    finished = steps == list(range(1, args.steps + 1))
    equal, worst = compare(final_weights(out, args.steps), final_weights(base_dir, args.steps), args.rtol, args.atol)
    trained = {int(k): v for k, v in ran["trained"].items()}
    return {"recovered": bool(finished and rec["lost"]), "recover_s": rec["wall_s"], "world_s": rec["world"],
            "restore_s": rec["restore"],
            "steps_lost": ran["started"] - args.steps,
            "samples_lost": samples_lost(trained, base["trained"], base["samples_per_prompt"]),
            "weights_equal": equal, "max_abs_weight_diff": worst, "lost_workers": list(rec["lost"])}


def run_lost_node(args, out: Path) -> dict:
    """The job on a local Ray cluster of two worker nodes, the second lost in step ``--lose-at``'s first
    optimizer update (``recovery.losing_a_node``). Runs in a child process (``--node-child``)."""
    with losing_a_node(args.lose_at) as rt:
        job = make_job(out, args.steps, 1, 0, small=True, two_nodes=True)
        rl = RLJob(job, runtime=rt, quiet=True)
        with Counted(args.lose_at, None) as counted:
            summary = rl.execute()
    return {"summary": summary, "started": counted.started, "trained": counted.trained,
            "samples_per_prompt": job.algorithm.samples_per_prompt}


def node_child(args, out: Path) -> dict:
    """``run_lost_node`` in a fresh interpreter (this process already drives a local Ray instance)."""
    import subprocess

    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--node-child", str(out), "--steps", str(args.steps),
           "--lose-at", str(args.lose_at)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"the lost-node run failed:\n{proc.stderr[-4000:]}")
    return json.loads((out / "chaos_node.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lose-at", type=int, default=1, help="0-based step in which the worker (or node) is lost")
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--atol", type=float, default=1e-5)
    ap.add_argument("--json", action="store_true", help="end with one JSON line of every kind's figures")
    ap.add_argument("--node-child", type=Path, help=argparse.SUPPRESS)  # internal: the lost-node run's process
    args = ap.parse_args()
    if args.node_child:
        ran = run_lost_node(args, args.node_child)
        (args.node_child / "chaos_node.json").write_text(json.dumps(ran, default=str))
        return 0
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        ap.error(f"--kinds: unknown {unknown}; choose from {list(KINDS)}")
    if not 0 < args.lose_at < args.steps:
        ap.error("--lose-at must be within the run, after its first step")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    tmp = Path(tempfile.mkdtemp(prefix="nereus-chaos-"))
    results: dict[str, dict] = {}
    try:
        print(f"job: examples/ppo_tiny_fixed.yaml, {args.steps} steps, snapshots every step; each kind loses worker "
              f"{LOST} (or a node) in step {args.lose_at + 1}", flush=True)
        baselines: dict[str, tuple[dict, Path]] = {}
        for kind in kinds:
            which = kind if kind in ("live_transition", "node") else "fixed"
            if which not in baselines:
                t0 = time.perf_counter()
                base = run_job(args, tmp / f"baseline-{which}", None, baseline_of=kind)
                baselines[which] = (base, tmp / f"baseline-{which}")
                print(f"  baseline ({which}): {args.steps} steps uninterrupted in {time.perf_counter() - t0:.1f} s",
                      flush=True)
            results[kind] = measure(args, tmp, kind, *baselines[which])
            r = results[kind]
            print(f"{kind:>22}: recovered {r['recovered']}, recover {r['recover_s']:.2f} s (re-form world "
                  f"{r['world_s']:.2f} s, restore {r['restore_s']:.2f} s), steps lost "
                  f"{r['steps_lost']}, samples lost {r['samples_lost']}, weights equal {r['weights_equal']} "
                  f"(max |diff| {r['max_abs_weight_diff']:.1e}), workers lost {r['lost_workers']}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ok = all(r["recovered"] and r["steps_lost"] <= 1 and r["samples_lost"] == 0 for r in results.values())
    print(f"every kind recovered with at most one step lost and no sample lost: {ok}")
    if args.json:
        print(json.dumps({"kinds": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
