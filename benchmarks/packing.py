"""Padded vs packed sequences, measured and priced: the same long-tail GRPO step on real workers, side by
side in one run, against the cost model's estimate of the same job and plans.

The workload is a job, ``examples/grpo_packing_bench.yaml``: its model (actor and reference), prompt length,
batch (4 prompts × 8 samples) and response-length distribution (log-normal, mean 200, sigma 1.6, clipped at
1,024). The responses are that distribution's mid-quantiles, one per row, shuffled with a seed: exactly the
rows the cost model prices (``cost.stage_tokens.row_lengths``), padded to the longest (the cap, which the
expected longest of 32 reaches too, so both pad to the same width). One Ray runtime of two workers holds the
actor and the reference twice, under the job's ``run.layouts`` placed as a run places them
(``run.setup.placed_from_plan``): padded, and packed by the job's ``run.packing`` (each micro-batch holds at
most the tokens of the padded micro-batch it replaces). Each round runs, per mode, the part of a GRPO step
that packing changes, on the same rollout, each part timed on its own:

- ``old_log_prob``: the actor's log-probs and entropies (actor/inference, DP2);
- ``ref``: the reference's log-probs (reference/inference, DP2);
- ``update``: GRPO advantages from seeded scores, then ``mini_batches`` optimizer steps of the actor with
  verl's PPO loss and a k3 KL term, token-mean (actor/training, DP2).

Generation is the same in both modes (packing does not touch the decoding engine) and is not run. The
modes run in alternating order over ``--rounds`` rounds; times are medians.

Priced: before and after the timed rounds, ``nereus profile``'s measurement (``runtime.cluster.profile.
measure``, 2 workers, small sizes: seconds) gives this machine's cluster section; the job with it prices
both plans as ``nereus estimate`` does (the runtime's capability: padded rows where no token budget;
``cost.plan_cost.estimate_plan``), per model-stage. The table compares each part's measured median with
its prediction (profile before the rounds; after, in brackets). The bound is the one docs/adaptation.md
states for uncalibrated predictions on this runtime: off by 25–56% per model-stage on average.

The plans are written to ``examples/plans/grpo_packing_bench_{padded,packed}.json`` (``--plans``), so
the estimate can be reproduced without the benchmark (with the job's profile, ``examples/cpu-local.yaml``):

    nereus estimate examples/grpo_packing_bench.yaml --plan examples/plans/grpo_packing_bench_padded.json
    nereus estimate examples/grpo_packing_bench.yaml --plan examples/plans/grpo_packing_bench_packed.json

The final line is JSON: ``padded_s`` and ``packed_s`` (median step seconds), ``ratio`` (packed / padded),
``padding_fraction`` (padding tokens / all tokens of the padded batch), ``max_abs_logprob_diff`` (largest
difference of the actor's and reference's log-probs over response tokens, first round, before any update),
``max_abs_loss_diff`` (of the first optimizer steps' token-mean objectives), ``peak_mem_ratio`` (packed /
padded peak activation bytes over workers and operations, the runtime's memory meter); then the cost
model's ``predicted_padded_s``, ``predicted_packed_s``, ``predicted_ratio``, ``error_padded`` and
``error_packed`` (predicted / measured − 1 of the step; ``*_after``: with the profile measured after the
rounds), ``error_bound`` (the stated error) and ``parts``
(per mode and part: measured and predicted seconds).

    python benchmarks/packing.py [--job examples/grpo_packing_bench.yaml] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.cost.stage_tokens import row_lengths
from nereus.rl import losses
from nereus.rl.core import AdvantageInputs, advantage_estimator
from nereus.run.rollout import Rollout, draw_uids, mini_batches, pack
from nereus.run.setup import placed_from_plan
from nereus.runtime.capability import capability_for
from nereus.runtime.cluster.profile import Profile, ProfileSizes, measure
from nereus.runtime.model.decoder import ModelConfig, build_model
from nereus.runtime.parallel.batch import TrainBatch
from nereus.spec.cluster import read_cluster
from nereus.spec.fields import Fields
from nereus.spec.job import JobSpec, load_job
from nereus.spec.layout import Layout, ModelStage, Placement, Plan
from nereus.spec.packing import PackingSpec, replica_shares, token_budget_groups

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "examples" / "grpo_packing_bench.yaml"
PLANS = ROOT / "examples" / "plans"
EOS = 2  # the synthetic rollout's responses never contain it (tokens from 3 up)
LR = 1e-5
MODES = ("padded", "packed")
PARTS = {"old_log_prob": "actor/inference", "ref": "reference/inference", "update": "actor/training"}
# docs/adaptation.md, "Calibration on the runtime": "Uncalibrated, the same predictions are off by 25–56% per
# model-stage on average" (the CPU runtime, 2 workers); `nereus estimate` is uncalibrated.
ERROR_BOUND = 0.56
# `nereus profile`'s measurements at sizes that take seconds on 2 workers (matmul at the default sizes)
PROFILE_SIZES = ProfileSizes(stream_mib=32, stream_iters=2, small_iters=10, large_mib=8, large_iters=2, repeats=3)


def model_config(job: JobSpec) -> ModelConfig:
    return ModelConfig(job.models["actor"], eos_token_id=EOS)


def response_lengths(job: JobSpec, seed: int = 0) -> list[int]:
    """One response per row of a step: the job's response-length mid-quantiles as the cost model rounds them
    (``cost.stage_tokens.row_lengths``, less the prompt), in an order shuffled with ``seed``."""
    rows = row_lengths(job, job.sequences_per_step())
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    return [max(1, rows[i] - job.workload.prompt_length) for i in order]


def rollout(job: JobSpec, seed: int = 0) -> Rollout:
    """Random prompts and responses of ``response_lengths`` (no EOS inside), packed as a step packs them."""
    g = torch.Generator().manual_seed(seed + 1)
    vocab, prompt = job.models["actor"].vocab, job.workload.prompt_length
    lengths = response_lengths(job, seed)
    prompts = [torch.randint(3, vocab, (prompt,), generator=g).tolist() for _ in lengths]
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    return pack(prompts, responses, None, EOS)


def padding_fraction(roll: Rollout) -> float:
    return 1.0 - float(roll.lengths.sum()) / roll.tokens.numel()


def plan(job: JobSpec, mode: str) -> Plan:
    """The job's ``run.layouts`` on its ranks, as a run places them (``run.setup.placed_from_plan``: the
    runtime's options; packed: ``run.packing``'s token budgets; padded: no packing)."""
    written = Plan(tuple(Placement(ModelStage.parse(key), lay, tuple(job.run.ranks[key]))
                         for key, lay in job.run.layouts.items()), job.cluster.num_gpus)
    spec = job.run.packing if mode == "packed" else PackingSpec()
    placed = placed_from_plan(written, replace(job, run=replace(job.run, packing=spec)))
    return Plan(tuple(Placement(ModelStage(p.model, p.stage), p.layout, p.ranks) for p in placed), written.num_gpus)


def write_plans(job: JobSpec, folder: Path) -> dict[str, Path]:
    """Both modes' plans as ``nereus estimate --plan`` reads them."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for mode in MODES:
        out[mode] = folder / f"grpo_packing_bench_{mode}.json"
        out[mode].write_text(json.dumps(plan(job, mode).to_dict(), indent=1) + "\n")
    return out


def with_profile(job: JobSpec, profile: Profile) -> JobSpec:
    """``job`` on the measured machine: the cluster section ``nereus profile`` writes."""
    return replace(job, cluster=read_cluster(Fields(profile.cluster_section(), "cluster")))


def predict(job: JobSpec, p: Plan) -> dict[str, float]:
    """The cost model's seconds of each part of ``p`` and their sum (``total``), priced as ``nereus estimate``
    prices a job with a run section: the runtime's capability narrows the options (``nereus.cli``)."""
    job = replace(job, options=capability_for(job.run.overlap).planning_options(job.options))
    est = estimate_plan(Hardware(job.cluster), job, p)
    parts = {part: est.stage_times[key] for part, key in PARTS.items()}
    return {**parts, "total": sum(parts.values())}


def step(rt, mode: str, roll: Rollout, seed: int, job: JobSpec) -> dict:
    """The packable part of one GRPO step on ``mode``'s keys: each part's seconds, log-probs, objectives,
    peak activations."""
    alg, seconds = job.algorithm, {}
    t0 = time.perf_counter()
    logp, _ = rt.logprobs_and_entropy(f"{mode}/actor/inference", roll.tokens, roll.lengths)
    old = roll.response_frame(logp)
    t1 = time.perf_counter()
    ref_logp = roll.response_frame(rt.logprobs(f"{mode}/reference/inference", roll.tokens, roll.lengths))
    t2 = time.perf_counter()
    seconds["old_log_prob"], seconds["ref"] = t1 - t0, t2 - t1
    scores = torch.randint(0, 2, (len(roll.tokens),), generator=torch.Generator().manual_seed(seed)).float()
    adv = advantage_estimator("grpo")(AdvantageInputs(scores=scores, mask=roll.mask, groups=draw_uids(
        len(roll.tokens), alg.samples_per_prompt), old_logp=old))["adv"]
    batch = TrainBatch(roll.tokens, roll.index, roll.mask, old_logp=old, advantages=adv, ref_logp=ref_logp,
                       lengths=roll.lengths)
    loss = losses.policy_loss(clip_low=0.2, clip_high=0.2, kl_loss_coef=0.001, kl_loss_type="k3")
    objectives = []
    for mb in mini_batches(batch, alg.mini_batches, torch.Generator().manual_seed(seed), "token-mean"):
        stats = rt.train_step(f"{mode}/actor/training", mb, loss, lr=LR, max_grad_norm=1.0)
        objectives.append(objective(stats, mb, rt.specs[f"{mode}/actor/training"].layout))
    seconds["update"] = time.perf_counter() - t2
    peak = max(r.activations for key in PARTS.values() for r in rt.memory(f"{mode}/{key}") if r is not None)
    return {"seconds": seconds, "old": old, "ref": ref_logp, "objectives": objectives, "peak_activations": peak}


def objective(stats, mb: TrainBatch, layout: Layout) -> float:
    """The mini-batch's token-mean loss from its micro-batch losses: each counts by its share of the rows
    (padded: equal micro-batches; packed: the runtime's plan, ``parallel.packing``)."""
    if not layout.max_token_len:
        return statistics.fmean(stats.losses)
    lengths = mb.lengths.tolist()
    sizes = [len(g) for share in replica_shares(lengths, layout.dp)
             for g in token_budget_groups([lengths[i] for i in share], layout.max_token_len)]
    return sum(x * n for x, n in zip(stats.losses, sizes, strict=True)) / len(mb)


def load(rt, job: JobSpec, plans: dict[str, Plan]) -> None:
    """Both modes' inference and training keys, every model from the same seeded weights."""
    cfg = model_config(job)
    state = build_model(cfg, seed=7).state_dict()
    for mode, p in plans.items():
        for pl in p.placements:
            if pl.model_stage.stage != "generation":
                rt.load(f"{mode}/{pl.model_stage}", cfg, pl.layout, ranks=list(pl.gpus), state=state,
                        model=pl.model_stage.model, stage=pl.model_stage.stage)


def timed_rounds(job: JobSpec, plans: dict[str, Plan], roll: Rollout, rounds: int) -> dict[str, list[dict]]:
    from nereus.runtime.cluster.workers import Runtime

    rt = Runtime(job.cluster.num_gpus, temp_dir=ROOT / ".tmp" / "ray", timeout_s=600)
    try:
        load(rt, job, plans)
        got: dict[str, list[dict]] = {m: [] for m in MODES}
        for rnd in range(rounds):
            for mode in (MODES if rnd % 2 == 0 else MODES[::-1]):
                got[mode].append(step(rt, mode, roll, rnd, job))
    finally:
        rt.shutdown()
    return got


def parts_table(got: dict[str, list[dict]], before: dict[str, dict], after: dict[str, dict]) -> dict:
    """Per mode and part (and ``total``): the measured median, the predictions with the profile measured
    before and after the rounds, and their errors (predicted / measured − 1)."""
    out = {}
    for mode in MODES:
        measured = {part: statistics.median(r["seconds"][part] for r in got[mode]) for part in PARTS}
        measured["total"] = statistics.median(sum(r["seconds"].values()) for r in got[mode])
        out[mode] = {part: {"measured_s": m, "predicted_s": before[mode][part],
                            "predicted_after_s": after[mode][part], "error": before[mode][part] / m - 1,
                            "error_after": after[mode][part] / m - 1}
                     for part, m in measured.items()}
    return out


def run(job: JobSpec, rounds: int, plans_dir: Path | None) -> dict:
    roll = rollout(job)
    plans = {mode: plan(job, mode) for mode in MODES}
    if plans_dir is not None:
        write_plans(job, plans_dir)
    workers = job.cluster.num_gpus
    profiles = [measure(workers, job.cluster.gpu.memory_bytes / 1e9, PROFILE_SIZES)]
    got = timed_rounds(job, plans, roll, rounds)
    profiles.append(measure(workers, job.cluster.gpu.memory_bytes / 1e9, PROFILE_SIZES))
    before, after = ({m: predict(with_profile(job, prof), plans[m]) for m in MODES} for prof in profiles)
    parts = parts_table(got, before, after)
    pad, pk = got["padded"], got["packed"]
    return {
        "padded_s": parts["padded"]["total"]["measured_s"],
        "packed_s": parts["packed"]["total"]["measured_s"],
        "padding_fraction": padding_fraction(roll),
        "max_abs_logprob_diff": max(float((pk[0][k] - pad[0][k]).abs().max()) for k in ("old", "ref")),
        "max_abs_loss_diff": max(abs(a - b) for a, b in zip(pk[0]["objectives"], pad[0]["objectives"], strict=True)),
        "peak_mem_ratio": max(r["peak_activations"] for r in pk) / max(r["peak_activations"] for r in pad),
        "predicted_padded_s": before["padded"]["total"],
        "predicted_packed_s": before["packed"]["total"],
        "error_padded": parts["padded"]["total"]["error"],
        "error_packed": parts["packed"]["total"]["error"],
        "error_padded_after": parts["padded"]["total"]["error_after"],
        "error_packed_after": parts["packed"]["total"]["error_after"],
        "error_bound": ERROR_BOUND,
        "parts": parts,
        "profile_gflops": [p.matmul_flops_per_s / 1e9 for p in profiles],
        "profile_load": [p.load_average for p in profiles],
        "layouts": {m: {str(p.model_stage): p.layout.short() for p in plans[m].placements} for m in MODES},
    }


def report(out: dict) -> list[str]:
    """The measured-vs-predicted table and the summary lines."""
    lines = [f"{'stage':<13} {'mode':<7} {'measured s':>10} {'predicted s [after]':>21} {'error [after]':>18}"]
    for part in (*PARTS, "total"):
        for mode in MODES:
            r = out["parts"][mode][part]
            lines.append(f"{part:<13} {mode:<7} {r['measured_s']:10.3f} {r['predicted_s']:10.3f} "
                         f"[{r['predicted_after_s']:8.3f}] {r['error']:+8.1%} [{r['error_after']:+7.1%}]")
    before, after = out["profile_gflops"]
    lines += [f"{mode}: {out['layouts'][mode]}" for mode in MODES]
    lines.append(f"profile matmul {before:.3g} GFLOP/s per worker before the rounds, {after:.3g} after (load "
                 f"average {out['profile_load'][0]:.1f}, {out['profile_load'][1]:.1f}); "
                 f"stated error of uncalibrated predictions: up to {out['error_bound']:.0%} per model-stage")
    lines.append(f"packed/padded {out['ratio']:.3f} measured, {out['predicted_ratio']:.3f} predicted; padding "
                 f"{out['padding_fraction']:.1%} of the padded tokens; max |Δ log-prob| "
                 f"{out['max_abs_logprob_diff']:.2e}; peak activations x{out['peak_mem_ratio']:.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", type=Path, default=JOB, help="the workload (a GRPO job with run.layouts on 2 workers)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--plans", type=Path, default=PLANS, help="folder to write both modes' plan files to")
    p.add_argument("--json", action="store_true", help="only the final JSON line")
    args = p.parse_args(argv)
    job = load_job(args.job)
    out = run(job, args.rounds, args.plans)
    out["ratio"] = out["packed_s"] / out["padded_s"]
    out["predicted_ratio"] = out["predicted_packed_s"] / out["predicted_padded_s"]
    if not args.json:
        print("\n".join(report(out)), file=sys.stderr)
    keys = ("padded_s", "packed_s", "ratio", "padding_fraction", "max_abs_logprob_diff", "max_abs_loss_diff",
            "peak_mem_ratio", "predicted_padded_s", "predicted_packed_s", "predicted_ratio", "error_padded",
            "error_packed", "error_padded_after", "error_packed_after", "error_bound", "parts")
    print(json.dumps({k: out[k] for k in keys}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
