"""Static vs intra-step adaptation vs asynchronous RL on the long-tail task, measured:
one GRPO job on the `repeat` task (response lengths ~10x from median to maximum, docs/generation.md), the
same seed, data and warm-started actor, on two local Ray workers, in each mode, in one run:

- ``static``: today's default step — fixed-batch generation, each model-stage's call answered before the
  next is issued;
- ``overlap``: intra-step overlap without the engine — ``run.overlap`` with ``run.rollout.pad_to_max``
  (inference starts on a finished generation replica's rows; stages on disjoint workers run at once);
- ``intra``: intra-step adaptation — the continuous-batching engine (``run.rollout.slots``) + ``run.overlap``
  + ``pad_to_max`` early inference;
- ``intra+midstep``: ``intra`` + mid-step moves of unfinished sequences between the generation replicas
  (``run.rollout.midstep``);
- ``async``: ``run.async`` — generation of step k+1 overlaps training of step k on disjoint workers;
- ``vllm``: static with ``run.rollout.engine: vllm`` (one vLLM engine per generation replica; skipped
  where vLLM is not installed);
- each tail lever alone on the fixed batch (``runtime.engines.native.fixed_decode``): ``speculative`` (n-gram
  drafts, 4 per row), ``tail`` (tail batching, over-launch 1.5, policy lag 0) and ``partial`` (partial
  rollout, over-launch 1.5, ``run.policy_lag: 1``);
- ``levers`` (speculation + partial rollout) and ``tail+spec`` (speculation + tail batching), hand-picked;
- ``nereus``: the controller's choice (``run.rollout.levers: auto``: the lever rule on the calibrated cost
  model, docs/adaptation.md);
- ``concurrent``: ``run.overlap`` alone (the actor's and the reference's inference, on different workers, at
  once; results identical), and ``nereus+concurrent``: the controller's choice on top of it;
- ``adapt``: ``run.adapt`` — the controller plans every layout (parallelism, placement, micro-batch size) on
  the cost model, calibrates it and may change it between steps, no levers; ``nereus+adapt``: the
  controller's whole choice, layouts and levers (``run.adapt`` + ``run.rollout.levers: auto`` +
  ``run.overlap``). Both price on this machine's measured profile (``examples/cpu-local.yaml`` with the
  per-micro-batch and shared-core priors of ``examples/ppo_tiny.yaml``) instead of the example's inline
  figures;
- ``engine-logp``: static trained on the log-probs the engine recorded while sampling
  (``algorithm.recompute_old_log_prob: false``: no ``old_log_prob`` pass), and ``nereus+adapt+logp``:
  ``nereus+adapt`` with it (``examples/grpo_longtail_nereus.yaml``).

Every mode uses the same model (head size 32, which vLLM's CPU attention needs) and warm-start.

A mode whose key the job spec does not accept yet is skipped with the spec's own error as the reason.
The layouts are ``overlap_runtime.LAYOUTS`` (generation DP2 on both workers, the actor's inference on
worker 0 and the reference's on worker 1, training DP2); the asynchronous mode puts generation and training
on disjoint workers (``ASYNC_LAYOUTS``). The supervised warm-start runs once (``WarmStartOnce``); every mode
starts from a copy of its checkpoints.

Per mode: mean step time (wall time between the ends of consecutive steps; the first ``--skip`` steps left
out as warm-up), the job's own ``timing_s/step`` and ``timing_s/gen``, each worker's idle fraction
(``perf/idle_fraction/worker_<i>``), the held-out accuracy after the last step (the mean of ``--val-samples``
sampled answers per prompt, or greedy; the job's eval on the
val parquet) and the mean of the evaluations in the run's second half (with ``--eval-every``), and the share of
trained prompt groups with a learning signal (``batch/solve_partial``). The modes run in ``--rounds``
rounds, each round every mode once in a rotated order, so the drifting load of a shared machine hits all
alike; "vs static" is the median over rounds of the ratio within a round. ``--out`` gets
``long_tail_runtime.json`` (every number) and ``long_tail_runtime.png``.

    python benchmarks/long_tail_runtime.py [--steps 50] [--warmstart 300] [--rounds 2] [--out DIR]
                                           [--modes static,overlap,intra,intra+midstep,async] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import yaml
from overlap_runtime import LAYOUTS, ROOT, rotated, run_job  # benchmarks/ is this script's folder

import nereus.run.job as job_module
from nereus.rl.longtail import task_rows, write_task
from nereus.run.job import RLJob
from nereus.spec.errors import SpecError
from nereus.spec.job import JobSpec, job_from_dict

# Continuous-batching slots per generation replica: 16 of a replica's 64 sequences at a time, as in
# overlap_runtime.py's engine run (docs/generation.md).
SLOTS = 16
# Target: at most 0.67x static's mean step time, held-out accuracy within 2 points.
GOAL_RATIO, GOAL_POINTS = 0.67, 2.0
# The asynchronous mode's keys and layouts: generation on worker 0, the actor's inference and training on
# worker 1 (disjoint, so step k+1's generation runs while step k trains).
ASYNC_KEY: dict = {"enabled": True}
ASYNC_LAYOUTS = {"actor/generation": {"layout": "dp=1", "ranks": [0]},
                 "actor/inference": {"layout": "dp=1,micro_batch_size=32", "ranks": [1]},
                 "reference/inference": {"layout": "dp=1,micro_batch_size=32", "ranks": [1]},
                 "actor/training": {"layout": "dp=1,micro_batch_size=8", "ranks": [1]}}
MIDSTEP_KEY: dict = {"enabled": True}
SPEC_KEY: dict = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
OVER_LAUNCH = 1.5
# Held-out answers sampled at the rollouts' own temperature: the task's held-out set holds one prompt per
# count (rl.longtail.held_out), a third of its rows the count-1 prompt, so a greedy accuracy moves by a
# count's whole share (up to 33 points) when one argmax flips, and two runs of one job differ by 5-10 points
# from step to step; the mean of n samples per row moves with the policy's success rate.
VAL_TEMPERATURE = 1.0


def static(spec: dict) -> dict:
    """Today's default step: fixed-batch generation, stages one after another."""
    return spec


def overlap(spec: dict) -> dict:
    spec["run"].update(overlap=True, rollout={"slots": 0, "pad_to_max": True})
    return spec


def intra(spec: dict) -> dict:
    spec["run"].update(overlap=True, rollout={"slots": SLOTS, "pad_to_max": True})
    return spec


def intra_midstep(spec: dict) -> dict:
    intra(spec)["run"]["rollout"]["midstep"] = copy.deepcopy(MIDSTEP_KEY)
    return spec


def asynchronous(spec: dict) -> dict:
    spec["run"].update({"async": copy.deepcopy(ASYNC_KEY), "layouts": copy.deepcopy(ASYNC_LAYOUTS)})
    return spec


def vllm(spec: dict) -> dict:
    spec["run"]["rollout"] = {"engine": "vllm", "cpu_kv_cache_gib": 0.125, "slots": 64}
    return spec


def fixed(spec: dict, **rollout: object) -> dict:
    """The default fixed batch with ``rollout``'s levers (``runtime.engines.native.fixed_decode``)."""
    spec["run"]["rollout"] = copy.deepcopy(rollout)
    return spec


def speculative(spec: dict) -> dict:
    return fixed(spec, speculative=SPEC_KEY)


def tail(spec: dict) -> dict:
    return fixed(spec, tail_batching={"over_launch": OVER_LAUNCH})


def partial(spec: dict) -> dict:
    spec["run"]["policy_lag"] = 1
    return fixed(spec, partial_rollout={"over_launch": OVER_LAUNCH})


def levers(spec: dict) -> dict:
    spec["run"]["policy_lag"] = 1
    return fixed(spec, speculative=SPEC_KEY, partial_rollout={"over_launch": OVER_LAUNCH})


def tail_spec(spec: dict) -> dict:
    return fixed(spec, speculative=SPEC_KEY, tail_batching={"over_launch": OVER_LAUNCH})


def concurrent(spec: dict) -> dict:
    """Model-stages on disjoint workers at once (``run.overlap``), the fixed batch as in ``static``."""
    spec["run"]["overlap"] = True
    return spec


def chosen_concurrent(spec: dict) -> dict:
    return chosen(concurrent(spec))


def adapted(spec: dict) -> dict:
    """``run.adapt``: the controller plans every layout on the calibrated cost model (no hand-picked ones)
    and may change them between steps; no levers."""
    spec["run"].pop("layouts")
    spec["run"]["adapt"] = {}
    # what the planner prices on: this machine as `nereus profile` measured it, with the per-micro-batch and
    # shared-core priors, as examples/ppo_tiny.yaml has them (the example spec's inline figures have no latencies)
    tiny = yaml.safe_load((ROOT / "examples" / "ppo_tiny.yaml").read_text())["cluster"]
    spec["cluster"] = {"profile": str(ROOT / "examples" / tiny["profile"]), "priors": dict(tiny["priors"])}
    return spec


def chosen_adapted(spec: dict) -> dict:
    """The controller's whole choice: layouts (``run.adapt``) and levers (``run.rollout.levers: auto``), with
    ``run.overlap``."""
    return chosen(concurrent(adapted(spec)))


def engine_logp(spec: dict) -> dict:
    """The old log-probs from the engine (``algorithm.recompute_old_log_prob: false``): the log-probs the
    native engine recorded while sampling, the actor's inference stage not run."""
    spec["algorithm"]["recompute_old_log_prob"] = False
    if "layouts" in spec["run"]:
        spec["run"]["layouts"].pop("actor/inference", None)
    return spec


def chosen_adapted_logp(spec: dict) -> dict:
    """``nereus+adapt`` with the engine's old log-probs (a job setting, not a controller decision)."""
    return engine_logp(chosen_adapted(spec))


def chosen(spec: dict) -> dict:
    """The controller's choice: ``run.rollout.levers: auto`` (speculation and tail batching priced by the
    cost model on the job's cpu-local profile, step by step)."""
    return fixed(spec, levers="auto")


# the modes' own per-step metrics worth a mean in the figures (mid-step moves; the async mode's staleness;
# the tail levers' rounds and policy lag)
EXTRA = ("midstep/moves", "midstep/moved_sequences", "midstep/move_s", "midstep/predicted_gain_s",
         "midstep/measured_gain_s", "async/staleness/mean", "rollout_corr/rollout_is_mean", "perf/throughput",
         "tail/long_round", "tail/deferred_groups", "partial/carried_groups", "partial/resumed_tokens",
         "rollout/policy_lag_mean", "rollout/policy_lag_max", "batch/solve_partial")
MODES: dict[str, Callable[[dict], dict]] = {"static": static, "overlap": overlap, "intra": intra,
                                             "intra+midstep": intra_midstep, "async": asynchronous, "vllm": vllm,
                                             "speculative": speculative, "tail": tail, "partial": partial,
                                             "levers": levers, "tail+spec": tail_spec, "nereus": chosen,
                                             "concurrent": concurrent, "nereus+concurrent": chosen_concurrent,
                                             "adapt": adapted, "nereus+adapt": chosen_adapted,
                                             "engine-logp": engine_logp, "nereus+adapt+logp": chosen_adapted_logp}


def base_spec(data: Path, args: argparse.Namespace) -> dict:
    """The one job every mode derives from: examples/grpo_longtail_tiny.yaml on two workers, evaluated at
    the end (and every ``--eval-every`` steps), checkpointed only at the end."""
    spec = yaml.safe_load((ROOT / "examples" / "grpo_longtail_tiny.yaml").read_text())
    for model in spec["models"].values():  # head size 32: vLLM's CPU attention has no kernel for 16
        model.update(heads=2, kv_heads=2)
    spec["run"].update(steps=args.steps, workers=2, eval_every=args.eval_every or args.steps,
                       layouts=copy.deepcopy(LAYOUTS),
                       warmstart={"actor_steps": args.warmstart, "batch": 64, "lr": 0.003},
                       data={"train": str(data / "repeat_train.parquet"), "val": str(data / "repeat_val.parquet")},
                       checkpoint={"dir": str(data / "unused"), "every": 10**6})
    if args.val_samples:  # the mean of n sampled answers (verl's mean@n): see VAL_TEMPERATURE
        spec["run"]["rollout"] = {"val_kwargs": {"n": args.val_samples, "do_sample": True,
                                                 "temperature": VAL_TEMPERATURE}}
    return spec


def mode_jobs(base: dict, names: list[str]) -> tuple[dict[str, JobSpec], dict[str, str]]:
    """Each mode's job, and for each mode the spec refuses (a key not there yet) the spec's error."""
    jobs, skipped = {}, {}
    val = base["run"].get("rollout", {}).get("val_kwargs")  # every mode evaluates alike
    for name in names:
        spec = MODES[name](copy.deepcopy(base))
        if val is not None:
            spec["run"]["rollout"] = {**spec["run"].get("rollout", {}), "val_kwargs": copy.deepcopy(val)}
        try:
            jobs[name] = job_from_dict(spec)
        except SpecError as err:
            skipped[name] = str(err)
    return jobs, skipped


class WarmStartOnce:
    """Stands in for ``initial_checkpoints`` in ``nereus.run.job``: the first job with given warm-start
    settings runs it into a cache folder, every job gets a copy of those checkpoints. The warm-start is a
    function of seed, data, model configs and settings (one thread, seeded model and batches), so the
    copy is what the job would have computed — the modes start from the very same actor."""

    def __init__(self, root: Path, real: Callable) -> None:
        self.root, self.real = root, real
        self.done: dict[str, tuple[Path, dict]] = {}
        self.seconds = 0.0

    def __call__(self, root: Path, cfgs: dict, data: list, tok: object, warm: object, seed: int,
                 max_new: int = 16) -> dict:
        key = repr((sorted(cfgs), [cfgs[k] for k in sorted(cfgs)], warm, seed, len(data), max_new))
        if key not in self.done:
            t0 = time.perf_counter()
            folder = self.root / f"warmstart_{len(self.done)}"
            self.done[key] = folder, self.real(folder, cfgs, data, tok, warm, seed, max_new)
            self.seconds += time.perf_counter() - t0
        folder, losses = self.done[key]
        for model in cfgs:
            shutil.copytree(folder / model, Path(root) / model, dirs_exist_ok=True)
        return dict(losses)


class TimedJob(RLJob):
    """An RL job that stamps when each step's observer call starts and ends (so evaluation and
    checkpointing between steps stay out of the step's wall time) and prints progress."""

    label = ""
    report_every = 10

    def step_done(self, o: object) -> None:
        start = time.perf_counter()
        super().step_done(o)
        self.stamps.append((start, time.perf_counter()))
        done = len(self.stamps)
        wall = wall_times(self.stamps)[-self.report_every:]
        if done % self.report_every == 0 and done < self.run.steps and wall:
            print(f"  {self.label}: step {done}/{self.run.steps}, {statistics.mean(wall):.2f} s/step lately",
                  file=sys.stderr, flush=True)

    def execute(self, resume: bool = False) -> dict:
        self.stamps: list[tuple[float, float]] = []
        return super().execute(resume)


def wall_times(stamps: list[tuple[float, float]]) -> list[float]:
    """Wall seconds of steps 2.. : from the end of the previous step's observer call to the start of this
    one's (step 1 has no previous end: its time holds the run's start)."""
    return [b[0] - a[1] for a, b in zip(stamps, stamps[1:], strict=False)]


def run_mode(rt: object, job: JobSpec, out: Path, label: str, report_every: int) -> dict:
    """One mode once: its metric lines, wall time per step, accuracies."""
    t0 = time.perf_counter()
    rl = TimedJob(job, runtime=rt, out_dir=out, quiet=True)
    rl.label, rl.report_every = label, report_every
    rows, summary = run_job(rl)
    return {"metrics": rows, "wall_s": [rows[0]["timing_s/step"]] + wall_times(rl.stamps),
            "warmstart_accuracy": summary["warmstart_accuracy"], "final_accuracy": summary["final_accuracy"],
            "accuracy_curve": [[0, summary["warmstart_accuracy"]]] + [[r["step"], r["val/accuracy"]] for r in rows
                                                                      if "val/accuracy" in r],
            "init_actor_sha256": hashlib.sha256((out / "init/actor/model.safetensors").read_bytes()).hexdigest(),
            "seconds": time.perf_counter() - t0}


def mean_after(values: list[float], skip: int) -> float:
    return statistics.mean(values[skip:] or values)


def mode_figures(rounds: list[dict], skip: int) -> dict:
    """A mode's means over its rounds (steps ``skip``+1.. of each)."""
    def metric(key: str) -> float:
        return statistics.mean(mean_after([r.get(key, 0.0) for r in rnd["metrics"]], skip) for rnd in rounds)

    workers = sorted({k for rnd in rounds for r in rnd["metrics"] for k in r if k.startswith("perf/idle_fraction/")})
    return {"step_s": statistics.mean(mean_after(rnd["wall_s"], skip) for rnd in rounds),
            "timing_step_s": metric("timing_s/step"), "gen_s": metric("timing_s/gen"),
            "idle": {k.rsplit("/", 1)[1]: metric(k) for k in workers},
            "response_mean": metric("response_length/mean"), "response_max": metric("response_length/max"),
            "warmstart_accuracy": statistics.mean(r["warmstart_accuracy"] for r in rounds),
            "final_accuracy": statistics.mean(r["final_accuracy"] for r in rounds),
            "final_accuracy_per_round": [r["final_accuracy"] for r in rounds],
            "late_accuracy": statistics.mean(late_accuracy(r["accuracy_curve"]) for r in rounds),
            "extra": {k: metric(k) for k in EXTRA if any(k in r for rnd in rounds for r in rnd["metrics"])}}


def late_accuracy(curve: list[list[float]]) -> float:
    """The mean held-out accuracy of the evaluations in the run's second half (``--eval-every``; the last
    alone without it): one evaluation of 200 prompts moves by several points from one to the next on the
    plateau, so the goal's single final figure is a draw; this mean is the steadier figure."""
    last = curve[-1][0]
    return statistics.mean(a for step, a in curve if step > last / 2)


def ratio(runs: dict, mode: str, base: str, skip: int) -> float:
    """``mode``'s mean step time over ``base``'s: the median over rounds of the ratio within a round."""
    return statistics.median(mean_after(a["wall_s"], skip) / mean_after(b["wall_s"], skip)
                             for a, b in zip(runs[mode], runs[base], strict=True))


def against_static(figures: dict, runs: dict, skip: int) -> None:
    """Step time against static's (and mid-step moves' against the engine alone), accuracy delta in points,
    and whether the goal holds; added to each mode's figures in place."""
    if "intra+midstep" in figures and "intra" in figures:
        figures["intra+midstep"]["vs_intra"] = ratio(runs, "intra+midstep", "intra", skip)
    if "static" not in figures:
        return
    for mode, f in figures.items():
        f["vs_static"] = ratio(runs, mode, "static", skip)
        f["accuracy_delta_points"] = 100 * (f["final_accuracy"] - figures["static"]["final_accuracy"])
        f["late_accuracy_delta_points"] = 100 * (f["late_accuracy"] - figures["static"]["late_accuracy"])
        f["goal_met"] = (mode != "static" and f["vs_static"] <= GOAL_RATIO
                         and f["accuracy_delta_points"] >= -GOAL_POINTS)


def table(figures: dict, skipped: dict, failed: dict, args: argparse.Namespace) -> str:
    """The printed table and the verdict on the goal."""
    idle_keys = sorted({k for f in figures.values() for k in f["idle"]})
    head = (f"{'mode':<18}{'step s':>8}{'vs static':>10}{'job step s':>11}{'gen s':>8}"
            + "".join(f"{'idle ' + k.replace('worker_', 'w'):>8}" for k in idle_keys)
            + f"{'resp mean/max':>15}{'signal':>8}{'held-out acc':>14}{'Δ pts':>7}")
    lines = [f"GRPO long-tail `repeat`, 2 workers, seed {args.seed}, {args.warmstart} warm-start steps, "
             f"{args.rounds} round(s) x {args.steps} RL steps; means over steps {args.skip + 1}..{args.steps} "
             f"(first {args.skip} left out: warm-up); held-out accuracy {val_text(args)} on {args.val_size} prompts "
             f"after step {args.steps}, mean over rounds; signal: the share of trained prompt groups whose "
             "siblings neither all solved nor all failed (batch/solve_partial: the only ones with a GRPO "
             "advantage); 2nd half: the mean held-out accuracy of the evaluations after the run's middle "
             "(--eval-every)", head]
    for mode, f in figures.items():
        ratio = f"{f['vs_static']:9.2f}x" if "vs_static" in f else f"{'—':>10}"
        delta = f"{f['accuracy_delta_points']:+7.1f}" if "accuracy_delta_points" in f else f"{'—':>7}"
        late = f"{f['late_accuracy_delta_points']:+7.1f}" if "late_accuracy_delta_points" in f else f"{'—':>7}"
        lines.append(f"{mode:<18}{f['step_s']:8.3f}{ratio}{f['timing_step_s']:11.3f}{f['gen_s']:8.3f}"
                     + "".join(f"{f['idle'].get(k, 0.0):8.2f}" for k in idle_keys)
                     + f"{f['response_mean']:8.1f}/{f['response_max']:<6.1f}"
                     + f"{100 * f['extra'].get('batch/solve_partial', 0.0):7.0f}%"
                     + f"{100 * f['warmstart_accuracy']:6.1f}->{100 * f['final_accuracy']:5.1f}%{delta}"
                     + f"{100 * f['late_accuracy']:8.1f}%{late}")
    for mode, why in {**skipped, **failed}.items():
        why = why.split("; allowed keys")[0]  # the spec's list of keys says nothing here
        lines.append(f"{mode:<18}{'skipped' if mode in skipped else 'FAILED'}: {why}")
    lines.append(f"goal: >= {100 * (1 - GOAL_RATIO):.0f}% lower mean step time than static, held-out "
                 f"accuracy at most {GOAL_POINTS:g} points below static's")
    for mode, f in figures.items():
        if mode != "static" and "vs_static" in f:
            lines.append(f"  {mode}: step time {100 * (f['vs_static'] - 1):+.0f}% vs static, accuracy "
                         f"{f['accuracy_delta_points']:+.1f} points -> goal {'MET' if f['goal_met'] else 'not met'}")
    extra = figures.get("intra+midstep", {})
    if "vs_intra" in extra:
        lines.append(f"  intra+midstep against intra (the moves alone): step time "
                     f"{100 * (extra['vs_intra'] - 1):+.0f}%; {extra['extra'].get('midstep/moves', 0):.1f} moves, "
                     f"{extra['extra'].get('midstep/moved_sequences', 0):.1f} sequences moved per step")
    return "\n".join(lines)


def plot(path: Path, runs: dict, figures: dict, skip: int) -> None:
    """Step time per step (mean over rounds) and held-out accuracy per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, rounds in runs.items():
        per_step = [statistics.mean(vals) for vals in zip(*(r["wall_s"] for r in rounds), strict=True)]
        left.plot(range(1, len(per_step) + 1), per_step, label=f"{mode} ({figures[mode]['step_s']:.2f} s)")
        curve = rounds[0]["accuracy_curve"]
        right.plot([s for s, _ in curve], [100 * a for _, a in curve], marker="o", label=mode)
    left.axvspan(0.5, skip + 0.5, color="0.9", label="left out (warm-up)")
    left.set(xlabel="RL step", ylabel="wall s per step (mean over rounds)", title="step time")
    right.set(xlabel="RL step", ylabel="held-out accuracy % (round 1)", title="held-out accuracy",
              ylim=(0, 100))
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, help="RL steps per mode (default 50; --quick 3)")
    p.add_argument("--warmstart", type=int, help="supervised warm-start steps of the actor (300; --quick 10)")
    p.add_argument("--rounds", type=int, help="rounds, each mode once per round (2; --quick 1)")
    p.add_argument("--skip", type=int, help="first steps left out of the means (2; --quick 1)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--out", default=str(ROOT / ".tmp" / "long_tail_runtime"), help="folder for the JSON and PNG")
    p.add_argument("--eval-every", type=int, default=0, help="also evaluate every N steps (0: only at the end)")
    p.add_argument("--train-size", type=int, help="training prompts (4000; --quick 256)")
    p.add_argument("--val-size", type=int, help="held-out prompts (200; --quick 16)")
    p.add_argument("--val-samples", type=int, default=8,
                   help="answers sampled per held-out prompt, the accuracy their mean (0: one greedy answer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a tiny run (smoke test; its figures mean nothing)")
    args = p.parse_args(argv)
    sizes = (3, 10, 1, 1, 256, 16) if args.quick else (50, 300, 2, 2, 4000, 200)
    for name, value in zip(("steps", "warmstart", "rounds", "skip", "train_size", "val_size"), sizes, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        p.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    if args.skip >= args.steps:
        p.error(f"--skip {args.skip} leaves no step of --steps {args.steps}")
    return args


def val_text(args: argparse.Namespace) -> str:
    if not args.val_samples:
        return "greedy"
    return f"mean@{args.val_samples} (sampled at temperature {VAL_TEMPERATURE:g})"


def run_all(args: argparse.Namespace, tmp: Path) -> tuple[dict, dict, dict, WarmStartOnce]:
    """Every available mode ``--rounds`` times on one runtime; returns runs, skipped and failed modes and
    the warm-start cache (how many warm-starts ran, their seconds)."""
    from nereus.runtime.cluster.workers import Runtime

    write_task(tmp, *task_rows(args.train_size, args.val_size, seed=args.seed))
    base = base_spec(tmp, args)
    base["run"]["seed"] = args.seed
    jobs, skipped = mode_jobs(base, args.modes)
    for mode, why in skipped.items():
        print(f"skipping {mode}: {why}", file=sys.stderr, flush=True)
    runs: dict[str, list[dict]] = {m: [] for m in jobs}
    failed: dict[str, str] = {}
    once = WarmStartOnce(tmp, job_module.initial_checkpoints)
    rt = Runtime(2, temp_dir=ROOT / ".tmp" / "ray", timeout_s=300)
    try:
        with mock.patch.object(job_module, "initial_checkpoints", once):
            for rnd in range(args.rounds):
                for mode in rotated([m for m in jobs if m not in failed], rnd):
                    label = f"round {rnd + 1}/{args.rounds} {mode}"
                    print(f"{label}: {args.steps} steps ...", file=sys.stderr, flush=True)
                    try:
                        r = run_mode(rt, jobs[mode], tmp / f"{mode}-{rnd}", label, max(1, args.steps // 5))
                    except Exception as err:  # noqa: BLE001 - a broken mode is reported, the others still run
                        failed[mode] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
                        runs.pop(mode, None)
                        traceback.print_exc()
                        print(f"{label}: FAILED: {failed[mode]}", file=sys.stderr, flush=True)
                        continue
                    runs[mode].append(r)
                    print(f"{label}: {r['seconds']:.0f} s, {mean_after(r['wall_s'], args.skip):.3f} s/step, "
                          f"held-out {100 * r['warmstart_accuracy']:.1f}% -> {100 * r['final_accuracy']:.1f}%",
                          file=sys.stderr, flush=True)
    finally:
        rt.shutdown()
    return runs, skipped, failed, once


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (ROOT / ".tmp").mkdir(exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=ROOT / ".tmp", prefix="long_tail_runtime_") as d:
        runs, skipped, failed, once = run_all(args, Path(d))
    figures = {mode: mode_figures(rounds, args.skip) for mode, rounds in runs.items()}
    against_static(figures, runs, args.skip)
    text = table(figures, skipped, failed, args)
    print(text, flush=True)
    config = {k: v for k, v in vars(args).items()}
    (out / "long_tail_runtime.json").write_text(json.dumps(
        {"config": config, "warmstarts": len(once.done), "warmstart_s": once.seconds,
         "total_s": time.perf_counter() - t0, "figures": figures, "skipped": skipped, "failed": failed,
         "runs": runs, "table": text}, indent=1))
    if runs:
        plot(out / "long_tail_runtime.png", runs, figures, args.skip)
    print(f"wrote {out / 'long_tail_runtime.json'} and {out / 'long_tail_runtime.png'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
