"""DAPO's dynamic sampling loop (run.dynamic_sampling) around a fake generation and scorer, without Ray:
further batches until the step's groups are kept, the first kept groups trained and repacked, the metrics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nereus.rl.dapo import GenerationBatchesExhausted
from nereus.rl.data import Prompt
from nereus.run.dynamic_sampling import DynamicSampling
from nereus.run.generated import Generated
from nereus.run.rollout import pack, repeat_prompts
from nereus.run.step_clock import StepClock
from nereus.spec.run_dapo import FilterGroupsSpec

EOS = 2


class FakeGeneration:
    """Batch b answers prompt i with a response of length 1 + (answer row's index) whose first token says
    whether it is right: ``solved[b][i]`` lists, per prompt, which of its siblings are right."""

    def __init__(self, solved: list[list[list[bool]]], per_step: int, group: int, limit: int | None) -> None:
        self.solved, self.eos, self.clock = solved, EOS, StepClock()
        self.job = SimpleNamespace(run=SimpleNamespace(filter_groups=FilterGroupsSpec(True, "acc", limit or 0)),
                                   algorithm=SimpleNamespace(samples_per_prompt=group),
                                   workload=SimpleNamespace(prompts_per_step=per_step))
        self.draws = SimpleNamespace(prompts=lambda step: self.batch(0), further=lambda step, b: self.batch(b))
        self.seen: list[int] = []

    def batch(self, b: int) -> list[Prompt]:
        return [Prompt((10 + b, 20 + i), "", "t", 100 * b + i) for i in range(len(self.solved[b]))]

    def generate(self, step, prompts, policy, levers, stages, gen_batch=0) -> Generated:
        self.seen.append(gen_batch)
        rows = repeat_prompts(prompts, self.job.algorithm.samples_per_prompt)
        right = [ok for per_prompt in self.solved[gen_batch] for ok in per_prompt]
        responses = [[1 if ok else 0, EOS] for ok in right]
        roll = pack([list(p.ids) for p in rows], responses, [[-0.5, -0.25]] * len(rows), EOS)
        return Generated(roll, rows, metrics={"rollout/decode_iterations": 2.0})

    def generation_inputs(self, step, rows, gen_batch=0):
        return [list(p.ids) for p in rows], None, None


class FakeInference:
    def filter_scores(self, roll, rows):
        rule = roll.tokens[torch.arange(len(rows)), roll.prompt_len].float()  # the first response token
        return rule, rule


def test_further_batches_until_the_groups_are_kept_then_the_first_kept_are_trained():
    t, f = True, False
    solved = [[[t, t], [t, f], [f, f]],    # batch 0 keeps prompt 1
              [[f, f], [t, t], [f, f]],    # batch 1 keeps none
              [[f, t], [t, f], [t, t]]]    # batch 2 keeps prompts 0 and 1: one too many, trimmed
    gen = FakeGeneration(solved, per_step=3, group=2, limit=None)
    out = DynamicSampling(gen, FakeInference()).generate(step=5)
    assert gen.seen == [0, 1, 2]
    assert [p.index for p in out.rows] == [1, 1, 200, 200, 201, 201]
    assert out.rollout.tokens[:, :2].tolist() == [[10, 21]] * 2 + [[12, 20]] * 2 + [[12, 21]] * 2
    assert out.rollout.tokens[:, 2].tolist() == [1, 0, 0, 1, 1, 0]  # each row's own response
    assert out.rollout.gen_logp[0].tolist() == [-0.5, -0.25]
    m = out.metrics
    assert m["train/num_gen_batches"] == 3 and m["train/filter_groups_keep_rate"] == pytest.approx(3 / 9)
    assert m["rollout/decode_iterations"] == 6.0  # the decode counters of every batch


def test_the_limit_stops_the_run_with_the_key():
    solved = [[[True, True]]] * 3
    gen = FakeGeneration(solved, per_step=1, group=2, limit=2)
    with pytest.raises(GenerationBatchesExhausted, match=r"2 generation batches kept 0 of the 1 groups"):
        DynamicSampling(gen, FakeInference()).generate(step=0)
    assert gen.seen == [0, 1]
