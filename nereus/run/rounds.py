"""The rounds of the levers that change which rows a step trains, on the runtime: tail batching's
(``run.tail``: over-launch, keep the first whole groups, defer the rest to long rounds) and partial
rollout's (``run.partial``: carried groups resumed, the first whole groups kept, the others' responses
carried to the next step). Each round is one generation call (``StepGeneration.one_call``), so the policy's
decision at its start (speculation, ``run.tail_decisions``) applies to it as to a plain step's generation."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from nereus.control.backend import GenerationPolicy
from nereus.rl.data import Prompt
from nereus.run.generated import Generated, decode_metrics
from nereus.run.partial import PartialRollouts, resumed_inputs, stitch
from nereus.run.rollout import pack, repeat_prompts
from nereus.run.tail import TailRounds
from nereus.spec.levers import GenerationLevers

if TYPE_CHECKING:  # the step's generation runs these rounds through its one call and its inputs
    from nereus.run.generation import StepGeneration


def tail_round(gen: StepGeneration, tail: TailRounds, step: int, fresh: list[Prompt], policy: GenerationPolicy | None,
               levers: GenerationLevers | None) -> Generated:
    """A tail-batching round: over-launch, keep the first whole groups, defer the rest (a long round: the
    deferred prompts, all kept)."""
    n = gen.alg.samples_per_prompt
    rnd = tail.plan(fresh, lambda k: gen.draws.spare(step, k), gen.replicas())
    rows = repeat_prompts(rnd.launched, n)
    prompts, params, fixed = gen.generation_inputs(step, rows)
    call = gen.one_call(step, prompts, replace(params, keep_groups=rnd.keep_per_replica, group_size=n), policy, levers)
    parts, entries = call.parts, call.entries
    out = [row for part in parts for row in part.rows]
    kept = [i for i, r in enumerate(out) if r is not None]
    if not rnd.long:
        tail.settle(rnd.launched, [out[g * n] is not None for g in range(len(rnd.launched))])
    rows, prompts, out = [rows[i] for i in kept], [prompts[i] for i in kept], [out[i] for i in kept]
    roll = pack(prompts, [r for r, _ in out], [lp for _, lp in out], gen.eos, fixed)
    metrics = {**decode_metrics(parts), "tail/long_round": float(rnd.long),
               "tail/launched_groups": float(len(rnd.launched)), "tail/kept_groups": float(len(kept) // n),
               "tail/deferred_groups": float(len(tail.deferred)), "rollout/policy_lag_mean": 0.0,
               "rollout/policy_lag_max": 0.0}
    return Generated(roll, rows, entries, metrics)


def partial_round(gen: StepGeneration, partial: PartialRollouts, step: int, fresh: list[Prompt],
                  policy: GenerationPolicy | None, levers: GenerationLevers | None) -> Generated:
    """A partial-rollout round: carried groups resumed, the first whole groups kept, the others' partial
    responses carried to the next step; every token tagged with its policy version."""
    n, dp = gen.alg.samples_per_prompt, gen.replicas()
    rnd = partial.plan(fresh, lambda k: gen.draws.spare(step, k), dp)
    rows = repeat_prompts(rnd.launched, n)
    prompts, params, fixed = gen.generation_inputs(step, rows)
    ids, counts, done = resumed_inputs(rnd, prompts, n)
    params = replace(params, keep_groups=rnd.keep_per_replica, must_groups=rnd.must_per_replica, group_size=n,
                     carry_partial=True, resumed=counts, resumed_done=done)
    call = gen.one_call(step, ids, params, policy, levers)
    parts, entries = call.parts, call.entries
    out = [row for part in parts for row in part.rows]
    partial.settle(rnd, out, n, dp, step)
    kept = [i for i, r in enumerate(out) if isinstance(r, tuple)]
    whole = [stitch(rnd, out[i], i, n, step) for i in kept]
    lags = [step - v for _, _, versions in whole for v in versions]
    roll = pack([prompts[i] for i in kept], [t for t, _, _ in whole], [lp for _, lp, _ in whole],
                gen.eos, fixed)
    metrics = {**decode_metrics(parts), "partial/launched_groups": float(len(rnd.launched)),
               "partial/kept_groups": float(len(kept) // n),
               "partial/carried_groups": float(sum(map(len, partial.carried))),
               "partial/resumed_tokens": float(sum(counts[i] for i in kept)),
               "rollout/policy_lag_mean": sum(lags) / max(1, len(lags)),
               "rollout/policy_lag_max": float(max(lags, default=0))}
    return Generated(roll, [rows[i] for i in kept], entries, metrics)
