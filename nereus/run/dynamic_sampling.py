"""DAPO's dynamic sampling in the RL step (``run.filter_groups``; Yu et al. 2025, arXiv:2503.14476, Sec.
3.2): generate a batch of ``prompts_per_step`` prompts, score it, drop the groups whose responses all score
alike (``rl.dapo.kept_groups``), and generate further batches (``PromptDraws.further``) until the step's
groups are full; the first ``prompts_per_step`` kept groups are trained, as verl's DAPO trainer trims its
batch. The decisions are ``rl.dapo``'s pure functions; this is the loop around the step's generation.
"""

from __future__ import annotations

from nereus.control.backend import GenerationPolicy
from nereus.rl.dapo import FilterTally, filter_metric, kept_groups, needs_another_batch, trained_rows
from nereus.run.generated import DECODE_METRICS, Generated
from nereus.run.generation import StepGeneration
from nereus.run.inference import StepInference
from nereus.run.rollout import Rollout, pack
from nereus.spec.generation import GenerationEntry
from nereus.spec.levers import GenerationLevers


class DynamicSampling:
    """The step's generation under ``run.filter_groups``: batches from ``generation``, scored by
    ``inference``'s rule reward (with the overlong penalty) before any model-stage's inference runs."""

    def __init__(self, generation: StepGeneration, inference: StepInference) -> None:
        self.generation, self.inference = generation, inference
        job = generation.job
        self.spec = job.run.filter_groups
        self.group_size, self.needed = job.algorithm.samples_per_prompt, job.workload.prompts_per_step

    def prompts(self, step: int, batch: int) -> list:
        """Generation batch ``batch``'s prompts: the step's own draws first, then further ones."""
        draws = self.generation.draws
        return draws.prompts(step) if batch == 0 else draws.further(step, batch)

    def generate(self, step: int, policy: GenerationPolicy | None = None,
                 levers: GenerationLevers | None = None) -> Generated:
        """Step ``step``'s rollout of ``prompts_per_step`` kept groups, with the generation's metrics, verl's
        ``train/num_gen_batches`` and the keep-rate (``FilterTally.metrics``). No inference starts early
        (``run.overlap``): which rows are trained is known only once the batches are scored."""
        tally, batches, keeps = FilterTally(), [], []
        while True:
            gen = self.generation.generate(step, self.prompts(step, tally.batches), policy, levers, (),
                                           gen_batch=tally.batches)
            with self.generation.clock.timer("reward"):
                score, rule = self.inference.filter_scores(gen.rollout, gen.rows)
            keep = kept_groups(filter_metric(self.spec.metric, score, rule), self.group_size)
            batches.append(gen)
            keeps.append(keep)
            tally = tally.add(keep)
            if not needs_another_batch(tally, self.needed, self.spec.limit):
                break
        picked = trained_rows(keeps, self.group_size, self.needed)
        rows = [batches[b].rows[i] for b, i in picked]
        entries: tuple[GenerationEntry, ...] = tuple(e for g in batches for e in g.entries)
        return Generated(self.repacked(step, batches, picked), rows, entries,
                         merged_metrics([g.metrics for g in batches]) | tally.metrics())

    def repacked(self, step: int, batches: list[Generated], picked: list[tuple[int, int]]) -> Rollout:
        """The picked rows of the batches' rollouts packed into one (``run.rollout.pad_to_max``'s fixed width
        where the job pads)."""
        prompts, responses, logps = [], [], []
        for b, i in picked:
            p, r, lp = row_of(batches[b].rollout, i)
            prompts.append(p)
            responses.append(r)
            logps.append(lp)
        fixed = self.generation.generation_inputs(step, [batches[b].rows[i] for b, i in picked])[2]
        return pack(prompts, responses, logps, self.generation.eos, fixed)


def row_of(roll: Rollout, i: int) -> tuple[list[int], list[int], list[float]]:
    """Row ``i`` of a packed rollout as (prompt ids, response ids, the response's sampled log-probs)."""
    p, n = int(roll.prompt_len[i]), int(roll.response_len[i])
    tokens = roll.tokens[i].tolist()
    return tokens[:p], tokens[p:p + n], roll.gen_logp[i, :n].tolist()


def merged_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The generation metrics of a step's batches: the decode counters summed, the others the last batch's."""
    out: dict[str, float] = {}
    for m in parts:
        out.update(m)
    out.update({k: float(sum(m.get(k, 0.0) for m in parts)) for k in DECODE_METRICS if any(k in m for m in parts)})
    return out
