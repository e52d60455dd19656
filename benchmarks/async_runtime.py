"""The asynchronous mode on the Ray workers, measured: the same GRPO job on the long-tail
`repeat` task (examples/grpo_longtail_async.yaml: generation alone on worker 0, the actor's and the
reference's inference and the actor's training on worker 1), same seed and warm-start, once per mode:

- ``static``: today's step, generation, then inference, then training, then the weight sync;
- ``async``: ``run.async`` — generation of step k+1 runs on worker 0 while worker 1 does step k's
  inference and training; rollouts are one policy version stale, corrected by decoupled PPO with truncated
  importance weights (``rollout_is: token``, threshold 2).

For each mode it prints the mean step time (first step left out), generation time, each worker's idle
fraction, the step time against static, the mean staleness, the mean importance weight, and the held-out
accuracy after the warm-start, every ``--eval-every`` steps and after the last step (greedy, exact match;
evaluation runs between steps and is not in the step time). The machine is shared and its
load drifts, so the modes run in ``--rounds`` rounds (order rotated); step figures are means over all
rounds, "vs static" the median over rounds of the within-round ratio. Accuracy is the first round's (the
runs are seeded; a later round differing is reported).

    python benchmarks/async_runtime.py [--steps 20] [--rounds 2] [--warmstart 300] [--eval-every 10]
                                       [--modes static,async,async-nocorr,async-mask]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import yaml

from nereus.rl.longtail import task_rows, write_task
from nereus.run.job import RLJob
from nereus.runtime.cluster.workers import Runtime
from nereus.spec.job import job_from_dict

ROOT = Path(__file__).resolve().parent.parent
# mode -> run.async (enabled, rollout_is, rollout_is_mode); the first two are the default comparison
VARIANTS = {"static": (False, "token", "truncate"), "async": (True, "token", "truncate"),
            "async-nocorr": (True, "none", "truncate"), "async-mask": (True, "token", "mask")}
MODES = ("static", "async")


def job_for(tmp: Path, mode: str, rnd: int, args: argparse.Namespace) -> object:
    spec = yaml.safe_load((ROOT / "examples" / "grpo_longtail_async.yaml").read_text())
    spec["run"].update(steps=args.steps, eval_every=args.eval_every,
                       warmstart={"actor_steps": args.warmstart, "batch": 64, "lr": 0.003},
                       data={"train": str(tmp / "repeat_train.parquet"), "val": str(tmp / "repeat_val.parquet")},
                       checkpoint={"dir": str(tmp / f"{mode}-{rnd}"), "every": 0})  # only at the end
    enabled, level, how = VARIANTS[mode]
    spec["run"]["async"].update(enabled=enabled, rollout_is=level, rollout_is_mode=how)
    return job_from_dict(spec)


def run_mode(rt: Runtime, tmp: Path, mode: str, rnd: int, args: argparse.Namespace) -> tuple[list[dict], dict]:
    rl = RLJob(job_for(tmp, mode, rnd, args), runtime=rt, out_dir=tmp / f"{mode}-{rnd}", quiet=True)
    try:
        summary = rl.execute()
    finally:
        rl.release()
    return [json.loads(line) for line in (rl.dir / "metrics.jsonl").read_text().splitlines()], summary


def mean(rounds: list[list[dict]], key: str) -> float:
    return statistics.mean(r.get(key, 0.0) for rows in rounds for r in rows[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmstart", type=int, default=300, help="supervised warm-start steps of the actor")
    p.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations (not timed)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {list(VARIANTS)}; "
                   "'async-nocorr': no importance weights, 'async-mask': weights above the threshold masked")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in VARIANTS]
    if bad or not modes:
        p.error(f"--modes: unknown {bad}; choose from {list(VARIANTS)}")
    runs: dict[str, list[list[dict]]] = {m: [] for m in modes}
    acc: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        write_task(tmp, *task_rows(2000, 200, seed=0))
        rt = Runtime(2, temp_dir=ROOT / ".tmp" / "ray", timeout_s=300)
        try:
            for rnd in range(args.rounds):
                for mode in (modes if rnd % 2 == 0 else modes[::-1]):
                    rows, summary = run_mode(rt, tmp, mode, rnd, args)
                    runs[mode].append(rows)
                    acc[mode].append((summary["warmstart_accuracy"], summary["final_accuracy"]))
        finally:
            rt.shutdown()
    print(f"GRPO long-tail, 2 workers (generation on 0; inference and training on 1), {args.rounds} rounds x "
          f"{args.steps} RL steps after {args.warmstart} warm-start steps (means over steps 2..{args.steps})")
    base_mode = "static" if "static" in runs else modes[0]
    print(f"step time against {base_mode}")
    print(f"{'mode':<13}{'step s':>8}{'vs base':>10}{'gen s':>8}{'idle w0':>8}{'idle w1':>8}{'staleness':>10}"
          f"{'IS mean':>8}{'acc warm-start':>15}{'acc final':>10}")
    for mode in modes:
        rows, base = runs[mode], runs[base_mode]
        ratio = statistics.median(mean([a], "timing_s/step") / mean([b], "timing_s/step")
                                  for a, b in zip(rows, base, strict=True))
        warm, final = acc[mode][0]
        note = "" if len(set(acc[mode])) == 1 else f"  (rounds differ: {acc[mode]})"
        print(f"{mode:<13}{mean(rows, 'timing_s/step'):8.3f}{ratio:9.2f}x{mean(rows, 'timing_s/gen'):8.3f}"
              f"{mean(rows, 'perf/idle_fraction/worker_0'):8.2f}{mean(rows, 'perf/idle_fraction/worker_1'):8.2f}"
              f"{mean(rows, 'async/staleness/mean'):10.2f}{mean(rows, 'rollout_corr/rollout_is_mean') or 1.0:8.3f}"
              f"{100 * warm:14.1f}%{100 * final:9.1f}%{note}")
    print("held-out accuracy by step (first round): " + "; ".join(
        f"{mode} " + ", ".join(f"{int(r['step'])}: {100 * r['val/accuracy']:.1f}%" for r in runs[mode][0]
                               if "val/accuracy" in r) for mode in modes))


if __name__ == "__main__":
    main()
