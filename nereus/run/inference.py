"""The RL step's inference: the actor's old log-probs and entropy, the reference's log-probs, the critic's
values and the reward model's scores on the step's rollout, plus the rule-based reward, as one typed
``Inferred`` that advantages, training and the metric line read.

Sequentially each stage is issued and answered in turn (the reward model with the rule reward, timed as
``reward``); with ``run.overlap`` every stage is issued at once and the rule reward is computed while they
run, and a stage that already started on finished generation replicas' rows (``EarlyInference``) is only
issued on the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nereus.rl.dapo import overlong_penalty
from nereus.rl.data import Prompt
from nereus.rl.rewards import RewardRouter
from nereus.rl.tokenizer import Tokenizer
from nereus.run.overlap import Calls, EarlyInference, InferenceStage, cat_parts
from nereus.run.rollout import Rollout
from nereus.run.stage_keys import StageKeys
from nereus.run.step_clock import StepClock
from nereus.runtime.cluster.calls import Logprobs, LogprobsAndEntropy, LogprobsEntropyAndSumPiSquared, Values
from nereus.spec.algorithms import NEEDS_SUM_PI_SQUARED
from nereus.spec.job import JobSpec
from nereus.spec.run_moe import router_replay_on

# a stage's answer, by its timer name: log-probs, values or scores [B, T(−1)]; the actor's (log-probs, entropy)
Answers = dict[str, torch.Tensor | tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class Inferred:
    """The step's inference in verl's response frame [B, R] (scores per row [B]); None where the step has
    no such stage."""

    old_logp: torch.Tensor  # π_old's log-probs: the actor's inference pass, or the engine's while sampling
    score: torch.Tensor  # [B]: the rule reward plus reward_model_coef × the reward model's score
    entropy: torch.Tensor | None = None  # the actor's full-vocabulary entropy (with its inference pass)
    ref_logp: torch.Tensor | None = None  # the reference's log-probs
    values: torch.Tensor | None = None  # the critic's values
    rule: torch.Tensor | None = None  # [B]: the rule-based reward (None with run.rule_reward: none)
    rm: torch.Tensor | None = None  # [B]: the reward model's score at the last token
    # [B]: the score of the greedy response to each row's prompt (ReMax's baseline: run.greedy_baseline)
    baseline_score: torch.Tensor | None = None
    # Σ_v π_old(v)² at each response token, from the actor's inference pass (the optimal token baseline)
    sum_pi_squared: torch.Tensor | None = None


class StepInference:
    """The inference of ``job``'s steps on the layouts ``keys`` names, issued through ``calls`` and timed on
    ``clock``; ``tok`` decodes responses for the rule reward ``reward``."""

    def __init__(self, job: JobSpec, keys: StageKeys, calls: Calls, clock: StepClock, tok: Tokenizer,
                 reward: RewardRouter) -> None:
        self.run, self.alg = job.run, job.algorithm
        # router replay: the actor's old log-probs replay the experts generation routed to (spec.run_moe)
        self.replays = router_replay_on(job.run.router_replay, job.models["actor"].moe is not None)
        self.keys, self.calls, self.clock, self.tok, self.reward = keys, calls, clock, tok, reward
        self.max_response = job.workload.response.max

    def has(self, model: str) -> bool:
        return model in self.alg.models

    def stages(self) -> list[InferenceStage]:
        """Each inference stage (timer, inference key, request), in the order they are issued. One pass
        of the actor gives the old log-probs and the rollout policy's full-vocabulary entropy; none with
        ``algorithm.recompute_old_log_prob: false`` (the engine's log-probs are used, ``infer``). An
        estimator that reads Σ_v π(v)² (the optimal token baseline) has the same pass give it too."""
        actor = LogprobsEntropyAndSumPiSquared if self.alg.adv_estimator in NEEDS_SUM_PI_SQUARED else LogprobsAndEntropy
        out = [InferenceStage("old_log_prob", self.keys["actor", "inference"], actor, self.replays)
               ] if self.alg.recompute_old_log_prob else []
        out += [InferenceStage("ref", self.keys["reference", "inference"], Logprobs)] if self.has("reference") else []
        out += [InferenceStage("values", self.keys["critic", "inference"], Values)] if self.has("critic") else []
        return out + ([InferenceStage("reward", self.keys["reward", "inference"], Values)]
                      if self.has("reward") else [])

    def infer(self, roll: Rollout, rows: list[Prompt], early: EarlyInference | None = None) -> Inferred:
        """Every stage on ``roll`` (whose rows answer ``rows``); ``early``: the stages' calls already issued
        on finished generation replicas' rows (``run.overlap``)."""
        got, rule = self.overlapped(roll, rows, early) if self.run.overlap else self.sequential(roll, rows)
        sum_pi_squared = None
        if "old_log_prob" in got:
            logp, entropy, *more = got["old_log_prob"]
            old, entropy = roll.response_frame(logp), roll.response_frame(entropy)
            sum_pi_squared = roll.response_frame(more[0]) if more else None
        else:  # the log-probs the engine recorded while sampling: the same weights, forward and logits
            old, entropy = roll.gen_logp * roll.mask, None
        rm = got.get("reward")
        rm = None if rm is None else rm[torch.arange(len(roll.tokens)), roll.last]
        return Inferred(old, self.score(roll, rule, rm), entropy,
                        ref_logp=roll.response_frame(got["ref"]) if "ref" in got else None,
                        values=roll.response_frame(got["values"]) if "values" in got else None, rule=rule, rm=rm,
                        sum_pi_squared=sum_pi_squared)

    def sequential(self, roll: Rollout, rows: list[Prompt]) -> tuple[Answers, torch.Tensor | None]:
        """Each stage issued once the one before answered; the stages' answers and the rule reward."""
        def run(s: InferenceStage) -> torch.Tensor | tuple[torch.Tensor, ...]:
            call = self.calls.submit(s.timer, "infer", s.key, s.request(roll.tokens, roll.lengths, roll.routes))
            return cat_parts(self.calls.wait([call])[0])

        got: Answers = {}
        stages = self.stages()
        for s in stages:
            if s.timer != "reward":  # the reward model is timed with the rule reward below, as always
                with self.clock.timer(s.timer):
                    got[s.timer] = run(s)
        with self.clock.timer("reward"):
            rule = self.rule_scores(roll, rows)
            got.update({s.timer: run(s) for s in stages if s.timer == "reward"})
        return got, rule

    def overlapped(self, roll: Rollout, rows: list[Prompt],
                   early: EarlyInference | None) -> tuple[Answers, torch.Tensor | None]:
        """Every stage issued at once (on the rows no early call took); the rule reward is computed while
        they run. Each stage is timed by its calls' own durations."""
        calls = {}
        for s in self.stages():
            calls[s.timer] = [c for _, c in early.rest(s, roll.tokens, roll.lengths, roll.routes)] if early else [
                self.calls.submit(s.timer, "infer", s.key, s.request(roll.tokens, roll.lengths, roll.routes))]
        with self.clock.timer("reward"):
            rule = self.rule_scores(roll, rows)
        answers = iter(self.calls.wait([c for cs in calls.values() for c in cs]))
        got: Answers = {t: cat_parts([part for _ in cs for part in next(answers)]) for t, cs in calls.items()}
        for t, cs in calls.items():
            self.clock.add(t, sum(map(self.calls.seconds, cs)))
        return got, rule

    def score(self, roll: Rollout, rule: torch.Tensor | None, rm: torch.Tensor | None) -> torch.Tensor:
        """The rule-based reward (``rule_scores``) plus ``reward_model_coef`` × the reward model's score ``rm``
        at the last token (verl's reward manager adds them the same way), plus the overlong penalty
        (``run.overlong_buffer``: ``rl.dapo.overlong_penalty``, DAPO eq. 13, as verl's DAPO reward manager)."""
        total = torch.zeros(len(roll.tokens)) if rule is None else rule.clone()
        if rm is not None:
            total = total + self.run.reward_model_coef * rm
        ob = self.run.overlong_buffer
        if ob.enable:  # L_max: the job's maximum response length (verl's data.max_response_length)
            total = total + overlong_penalty(roll.response_len, self.max_response, ob.len, ob.penalty_factor)
        return total

    def scores(self, roll: Rollout, rows: list[Prompt]) -> torch.Tensor:
        """The scores of responses outside the step's rollout (ReMax's greedy responses) as ``score`` gives
        the step's own: the rule reward and, with a reward model, its score from a pass of its own (timed
        with the rule reward as ``reward``)."""
        with self.clock.timer("reward"):
            rule, rm = self.rule_scores(roll, rows), None
            if self.has("reward"):
                call = self.calls.submit("reward", "infer", self.keys["reward", "inference"],
                                         Values(roll.tokens, roll.lengths))
                rm = cat_parts(self.calls.wait([call])[0])[torch.arange(len(roll.tokens)), roll.last]
        return self.score(roll, rule, rm)

    def filter_scores(self, roll: Rollout, rows: list[Prompt]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The scores dynamic sampling filters on, before inference (``run.dynamic_sampling``): the score
        without a reward model (``run.filter_groups`` refuses score metrics with one) and the rule reward."""
        rule = self.rule_scores(roll, rows)
        return self.score(roll, rule, None), rule

    def rule_scores(self, roll: Rollout, rows: list[Prompt]) -> torch.Tensor | None:
        """Rule-based reward on the decoded response (``rl.rewards.RewardRouter``: by ``data_source``, a
        named rule, or the user's function); None when ``rule_reward`` is none."""
        responses = roll.tokens.tolist()
        rule = torch.zeros(len(rows))
        if self.run.rule_reward != "none":
            for i, p in enumerate(rows):
                start, n = int(roll.prompt_len[i]), int(roll.response_len[i])
                stops = self.tok.stop_token_ids
                text = self.tok.decode([t for t in responses[i][start: start + n] if t not in stops])
                rule[i] = self.reward.score(p.data_source, text, p.ground_truth, bool(roll.finished[i]), p.extra_info)
            return rule
        return None
