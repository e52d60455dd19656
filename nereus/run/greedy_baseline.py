"""ReMax's baseline (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method
for Aligning Large Language Models", arXiv:2310.10505; ``algorithm.adv_estimator: remax``): the reward of the
greedy response to each drawn prompt, from a generation pass of its own with the step's weights, scored as
the step's responses are (verl generates it with ``do_sample=False`` before computing advantages).
"""

from __future__ import annotations

import math
from dataclasses import replace

from nereus.rl.data import Prompt
from nereus.run.generation import StepGeneration
from nereus.run.inference import Inferred, StepInference
from nereus.spec.algorithms import NEEDS_GREEDY_BASELINE
from nereus.spec.job import JobSpec


def with_greedy_baseline(job: JobSpec, step: int, rows: list[Prompt], inf: Inferred, gen: StepGeneration,
                         infer: StepInference) -> Inferred:
    """``inf`` with ``baseline_score`` [B] when the estimator needs it (else ``inf`` as it is): each row's
    drawn prompt (``rows``: each draw's ``samples_per_prompt`` responses in a row) answered once greedily and
    scored. The prompts are padded with copies of the first to split over the generation replicas and the
    reward model's (the step's own batch splits over both, so the padded batch stays within it)."""
    if job.algorithm.adv_estimator not in NEEDS_GREEDY_BASELINE:
        return inf
    n = job.algorithm.samples_per_prompt
    drawn = rows[::n]
    split = gen.replicas()
    if infer.has("reward"):
        split = math.lcm(split, gen.rt.specs[gen.keys["reward", "inference"]].layout.dp)
    padded = drawn + drawn[:1] * ((-len(drawn)) % split)
    scores = infer.scores(gen.greedy(step, padded), padded)[: len(drawn)]
    return replace(inf, baseline_score=scores.repeat_interleave(n))
