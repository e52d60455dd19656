"""Overlapped stages on the Ray workers, measured: the same GRPO job on the long-tail
`repeat` task, same seed, on two workers, once per mode, in one run:

- ``sequential``: today's step, each model-stage's call answered before the next is issued;
- ``overlap``: ``run.overlap`` — inference stages issued together, both models' optimizer steps issued
  together (stages on disjoint workers run at once);
- ``sequential+pad`` and ``overlap+early``: rollouts packed to the longest possible response
  (``run.rollout.pad_to_max``), and with overlap the actor's old log-probs start on the first finished
  generation replica's rows while the other replica still generates.

Layouts: generation DP2 on workers 0, 1; the actor's inference on worker 0 and the reference's on worker 1
(each DP1, so the two run side by side under overlap); training DP2. For each mode it prints the mean step
time (first step left out: warm-up), generation and inference stage times, each worker's idle fraction
(``perf/idle_fraction/worker_<i>``), the step time against its baseline, and whether every non-timing
metric equals the baseline's (overlap must change no number). The machine is shared and its load drifts, so
the modes run in ``--rounds`` rounds, each round every mode once (order rotated); a mode's figures are the
means over all its rounds, and "vs base" is the median over rounds of the ratio within a round.

    python benchmarks/overlap_runtime.py [--steps 6] [--rounds 3] [--warmstart 100] [--slots 0]
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
MODES = {"sequential": (False, False), "overlap": (True, False), "sequential+pad": (False, True),
         "overlap+early": (True, True)}
BASELINE = {"sequential": "sequential", "overlap": "sequential", "sequential+pad": "sequential+pad",
            "overlap+early": "sequential+pad"}
TIMING = ("timing_s/", "perf/", "nereus/snapshot_s")
LAYOUTS = {"actor/generation": {"layout": "dp=2", "ranks": [0, 1]},
           "actor/inference": {"layout": "dp=1,micro_batch_size=32", "ranks": [0]},
           "reference/inference": {"layout": "dp=1,micro_batch_size=32", "ranks": [1]},
           "actor/training": {"layout": "dp=2,micro_batch_size=8", "ranks": [0, 1]}}


def job_for(tmp: Path, mode: str, steps: int, warmstart: int, slots: int) -> object:
    spec = yaml.safe_load((ROOT / "examples" / "grpo_longtail_tiny.yaml").read_text())
    overlap, pad = MODES[mode]
    spec["run"].update(steps=steps, eval_every=10_000, layouts=LAYOUTS, overlap=overlap,
                       rollout={"slots": slots, "pad_to_max": pad},
                       warmstart={"actor_steps": warmstart, "batch": 64, "lr": 0.003},
                       data={"train": str(tmp / "repeat_train.parquet"), "val": str(tmp / "repeat_val.parquet")},
                       checkpoint={"dir": str(tmp / mode), "every": 10_000})
    return job_from_dict(spec)


def run_job(rl: RLJob) -> tuple[list[dict], dict]:
    """Run ``rl`` to its last step on the runtime it was given (its keys released after); returns every
    step's metric line (``metrics.jsonl``) and the job's summary (warm-start and final accuracy)."""
    try:
        summary = rl.execute()
    finally:
        rl.release()
    return [json.loads(line) for line in (rl.dir / "metrics.jsonl").read_text().splitlines()], summary


def rotated(names: list[str], rnd: int) -> list[str]:
    """The modes' order in round ``rnd``: rotated by one each round, so no mode always runs first (the load
    of a shared machine drifts; each mode meets each position)."""
    k = rnd % len(names) if names else 0
    return names[k:] + names[:k]


def run_mode(rt: Runtime, tmp: Path, mode: str, args: argparse.Namespace, rnd: int) -> list[dict]:
    out = tmp / f"{mode}-{rnd}"
    return run_job(RLJob(job_for(tmp, mode, args.steps, args.warmstart, args.slots), runtime=rt, out_dir=out,
                         quiet=True))[0]


def mean(rounds: list[list[dict]], key: str) -> float:
    return statistics.mean(r.get(key, 0.0) for rows in rounds for r in rows[1:])


def same_numbers(a: list[dict], b: list[dict]) -> bool:
    return all(ra.get(k) == rb.get(k) for ra, rb in zip(a, b, strict=True) for k in ra if not k.startswith(TIMING))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmstart", type=int, default=100, help="supervised warm-start steps of the actor")
    p.add_argument("--slots", type=int, default=0, help="run.rollout.slots (0: the fixed-batch generation)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        write_task(tmp, *task_rows(2000, 64, seed=0))
        rt = Runtime(2, temp_dir=ROOT / ".tmp" / "ray", timeout_s=300)
        runs: dict[str, list[list[dict]]] = {mode: [] for mode in MODES}
        try:
            for rnd in range(args.rounds):
                for mode in rotated(list(MODES), rnd):
                    runs[mode].append(run_mode(rt, tmp, mode, args, rnd))
        finally:
            rt.shutdown()
    print(f"GRPO long-tail, 2 workers, {args.rounds} rounds x {args.steps} steps (means over steps 2..{args.steps}),"
          f" slots={args.slots}")
    print(f"{'mode':<16}{'step s':>8}{'vs base':>9}{'gen s':>8}{'old_lp s':>9}{'ref s':>7}{'train s':>8}"
          f"{'idle w0':>8}{'idle w1':>8}{'resp mean/max':>15}  same numbers as base")
    for mode, rows in runs.items():
        base = runs[BASELINE[mode]]
        step = mean(rows, "timing_s/step")
        ratio = statistics.median(mean([a], "timing_s/step") / mean([b], "timing_s/step")
                                  for a, b in zip(rows, base, strict=True))
        same = all(same_numbers(a, b) for a, b in zip(rows, base, strict=True))
        print(f"{mode:<16}{step:8.3f}{ratio:8.2f}x{mean(rows, 'timing_s/gen'):8.3f}"
              f"{mean(rows, 'timing_s/old_log_prob'):9.3f}{mean(rows, 'timing_s/ref'):7.3f}"
              f"{mean(rows, 'timing_s/update_actor'):8.3f}{mean(rows, 'perf/idle_fraction/worker_0'):8.2f}"
              f"{mean(rows, 'perf/idle_fraction/worker_1'):8.2f}"
              f"{mean(rows, 'response_length/mean'):8.1f}/{mean(rows, 'response_length/max'):<6.1f}"
              f"  {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
