"""The PPO/GRPO step on the runtime, each model-stage under its own layout (verl's dataflow):

generation (actor) → inference (actor old log-probs, reference log-probs, critic values, reward-model
scores + rule-based reward) → advantages (GAE for PPO, group-normalised for GRPO) → training (critic:
clipped value loss; actor: clipped policy loss with a KL penalty in the reward or a KL loss), ``epochs``
× ``mini_batches`` optimizer updates → weight sync from each trained model's training layout to its other
layouts.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial

import torch

from nereus.control.backend import GenerationPolicy, RunToEnd
from nereus.cost.engine import EngineCalibration
from nereus.rl import losses
from nereus.rl.core import AdvantageInputs, advantage_estimator
from nereus.rl.data import Prompt
from nereus.rl.rewards import RewardRouter
from nereus.rl.tokenizer import Tokenizer
from nereus.run.asyncmode import AsyncRollouts
from nereus.run.generated import DECODE_METRICS, Generated, decode_metrics
from nereus.run.midstep import METRICS, EarlyRequest, EngineLoop
from nereus.run.overlap import Call, Calls, EarlyInference, InferenceStage, cat_parts
from nereus.run.partial import PartialRollouts
from nereus.run.report import step_metrics
from nereus.run.rollout import Rollout, draw_uids, mini_batches, pack, repeat_prompts
from nereus.run.rounds import partial_round, tail_round
from nereus.run.setup import MINI_BATCH_ORDER, PROMPT_ORDER, SAMPLING, SPARE_PROMPTS, Placed
from nereus.run.tail import TailRounds
from nereus.run.tail_decisions import ask_at_start
from nereus.runtime.cluster.calls import GenerateWithLogprobs, Logprobs, LogprobsAndEntropy, TrainStep, Values
from nereus.runtime.cluster.workers import Runtime
from nereus.runtime.engines.answers import DecodeStats, ReplicaRollout
from nereus.runtime.engines.protocol import EngineConfig, EnginesOpened
from nereus.runtime.engines.sampling import SamplingParams, derive_seed
from nereus.runtime.parallel.batch import TrainBatch
from nereus.runtime.parallel.sharded import LossFn, TrainStats
from nereus.spec.generation import GenerationEntry
from nereus.spec.job import JobSpec
from nereus.spec.levers import GenerationLevers

# model -> (batch, loss function, learning rate) of its update (``Stepper.training_jobs``)
TrainingJobs = dict[str, tuple[TrainBatch, LossFn, float]]


@dataclass(frozen=True)
class MicroStats:
    """One micro-batch's statistics of a model's update: the index of its optimizer step within the step,
    and what the loss function reported (``rl.losses.ActorLossStats``, ``CriticLossStats``)."""

    update: int
    loss: losses.ActorLossStats | losses.CriticLossStats


@dataclass(frozen=True)
class OneCall:
    """Generation in one call of every generation worker: the fixed batch, or the continuous-batching
    engine when ``params.slots`` > 0 (``run.rollout.slots``)."""

    params: SamplingParams


@dataclass(frozen=True)
class WithDecisionPoints:
    """The engine in chunks, the policy asked between them (``run.rollout.midstep``: ``run.midstep``)."""

    params: SamplingParams


@dataclass(frozen=True)
class StepRun:
    """One RL step's results for the backend: its metric line, the decisions the policy took inside its
    generation, and every trained response's length (a prompt's group consecutive; empty where the step
    does not say: asynchronous steps)."""

    metrics: dict[str, float]
    generation: tuple[GenerationEntry, ...] = ()
    response_lengths: tuple[float, ...] = ()


class Stepper:
    """Runs steps of ``job`` on runtime ``rt`` whose models are loaded under ``placed``."""

    def __init__(self, job: JobSpec, rt: Runtime, placed: list[Placed], tok: Tokenizer,
                 train: list[Prompt], reward: RewardRouter | None = None) -> None:
        self.job, self.rt, self.tok, self.train = job, rt, tok, train
        self.reward = reward or RewardRouter(job.run.rule_reward, job.run.reward_function)
        self.run, self.alg = job.run, job.algorithm
        self.key = {(p.model, p.stage): p.key for p in placed}
        self.placed = placed
        self.timing: dict[str, float] = {}
        self.grad_norms: dict[str, float] = {}  # model → mean global gradient norm of the last step
        self.calls = Calls(rt)  # the step's worker calls: futures and per-worker busy time
        self.early: EarlyInference | None = None  # this step's inference started during generation
        self.asynchronous = AsyncRollouts(self) if job.run.async_mode.on else None  # run.async (run.asyncmode)
        self.engine_prices = EngineCalibration()  # run.rollout.midstep: the engine's prices, measured over the run
        self.tail = TailRounds(job.run.rollout_tail) if job.run.rollout_tail else None  # run.rollout.tail_batching
        partial = job.run.rollout_partial  # run.rollout.partial_rollout
        self.partial = PartialRollouts(partial.over_launch) if partial else None

    def open_engine(self) -> EnginesOpened | None:
        """With an engine opened per replica (``EngineTraits.restarts_on_move``: vLLM, one per replica of the
        layout's TP size, loaded with its weights): the actor's generation key's engines (at the start, and
        again after a transition moved the key or a recovery re-formed the layout); the engines started and
        reused (None for an engine that generates from the workers' shards)."""
        traits = self.run.rollout_engine.traits
        if not traits.restarts_on_move:
            return None
        key = self.key["actor", "generation"]
        w = self.job.workload
        return self.rt.open_engine(key, EngineConfig(self.rt.specs[key].cfg, w.prompt_length + w.response.max,
                                                     max_num_seqs=traits.slots(self.run.rollout_slots),
                                                     dtype=self.rt.specs[key].dtype, seed=self.run.seed,
                                                     settings=self.run.rollout_engine,
                                                     tp=self.rt.specs[key].layout.tp))

    @contextmanager
    def timer(self, name: str):
        t0 = time.perf_counter()
        yield
        self.timing[f"timing_s/{name}"] = self.timing.get(f"timing_s/{name}", 0.0) + time.perf_counter() - t0

    def has(self, model: str) -> bool:
        return model in self.alg.models

    # ----- data ---------------------------------------------------------------------------------------
    def prompts(self, step: int) -> list[Prompt]:
        """The step's prompts: consecutive slices of a seeded permutation per epoch (so a resumed run
        draws the same prompts as an uninterrupted one)."""
        per = self.job.workload.prompts_per_step
        out = []
        for i in range(step * per, (step + 1) * per):
            epoch, pos = divmod(i, len(self.train))
            order = torch.randperm(len(self.train), generator=torch.Generator().manual_seed(
                derive_seed(self.run.seed, PROMPT_ORDER, epoch)))
            out.append(self.train[int(order[pos])])
        return out

    # ----- stages -------------------------------------------------------------------------------------
    def generation_inputs(self, step: int, rows: list[Prompt]) -> tuple[list[list[int]], SamplingParams,
                                                                      tuple[int, int] | None]:
        """Step ``step``'s generation: the rows' prompt ids, the sampling parameters, and the fixed
        (prompt, response) width of the packed rollout with ``run.rollout.pad_to_max`` (else None)."""
        limit = self.run.max_response_length(step, self.job.workload.response.max)
        params = SamplingParams(max_new_tokens=limit, temperature=self.run.temperature, top_p=self.run.top_p,
                                eos_token_id=self.tok.eos_token_id, pad_token_id=self.tok.pad_token_id,
                                seed=derive_seed(self.run.seed, SAMPLING, step), slots=self.run.rollout_slots,
                                stop_token_ids=self.tok.stop_token_ids,
                                speculation=self.run.rollout_engine.live_speculation)
        prompts = [list(p.ids) for p in rows]
        fixed = (max(len(p) for p in prompts), limit) if self.run.rollout_pad_to_max else None
        return prompts, params, fixed

    def generation_mode(self, step: int, params: SamplingParams) -> OneCall | WithDecisionPoints:
        """With ``run.rollout.midstep``: every ``every``-th step generates with decision points (on DP ≥ 2; an
        adaptive run may hold one replica for a while, then the step generates in one call), the steps
        between with the fixed batch. Otherwise one call as ``run.rollout.slots`` says."""
        spec = self.run.rollout_midstep
        if spec is None:
            return OneCall(params)
        if step % spec.every != 0:
            return OneCall(replace(params, slots=0))
        dp = self.rt.specs[self.key["actor", "generation"]].layout.dp
        return WithDecisionPoints(params) if dp >= 2 else OneCall(params)

    def early_request(self, prompts: list[list[int]], fixed: tuple[int, int] | None) -> EarlyRequest | None:
        """With ``run.overlap`` and ``pad_to_max``: inference starts on each generation replica's rows as it
        ends (``EarlyInference``)."""
        if not self.run.overlap or fixed is None:
            return None
        stages = tuple(self.inference_stages())
        eos = self.tok.stop_token_ids
        return EarlyRequest(stages, lambda a, b, out: pack(prompts[a:b], [r for r, _ in out], None, eos, fixed).tokens)

    def generate(self, step: int, prompts: list[Prompt], policy: GenerationPolicy | None = None,
                 levers: GenerationLevers | None = None) -> Generated:
        """Step ``step``'s rollout of ``prompts`` (each repeated ``samples_per_prompt`` times); ``policy`` is
        asked at the decision points of a generation that has them (none: it runs to its end), ``levers``
        are the plan's (``run.tail_decisions``): tail batching's rounds, and in the status the policy decides on."""
        if self.partial is not None:
            return partial_round(self, self.partial, step, prompts, policy, levers)
        tail = self.tail_rounds(levers)
        if tail is not None:
            return tail_round(self, tail, step, prompts, policy, levers)
        rows = repeat_prompts(prompts, self.alg.samples_per_prompt)
        prompts, params, fixed = self.generation_inputs(step, rows)
        eos, key = self.tok.stop_token_ids, self.key["actor", "generation"]
        mode, early = self.generation_mode(step, params), self.early_request(prompts, fixed)
        if isinstance(mode, WithDecisionPoints):
            loop = EngineLoop(self.calls, self.rt, key, mode.params, step, policy or RunToEnd(), self.engine_prices,
                              self.run.rollout_engine.traits)
            with self.timer("gen"):  # early inference on the final call (run.midstep)
                out = loop.run(prompts, early)
            self.early = loop.early
            roll = pack(prompts, [r for r, _ in out], [lp for _, lp in out], eos, fixed)
            return Generated(roll, rows, loop.entries(), loop.metrics())
        parts, entries = self.one_call(step, prompts, mode.params, policy, levers, early)
        out = [row for part in parts for row in part.rows]
        return Generated(pack(prompts, [r for r, _ in out], [lp for _, lp in out], eos, fixed), rows, entries,
                         decode_metrics(parts))

    def one_call(self, step: int, prompts: list[list[int]], params: SamplingParams, policy: GenerationPolicy | None,
                 levers: GenerationLevers | None, early: EarlyRequest | None = None,
                 ) -> tuple[list[ReplicaRollout], tuple[GenerationEntry, ...]]:
        """A generation in one call of every generation worker, timed as ``gen``: with the plan's levers the
        policy decides at its start (``run.tail_decisions.ask_at_start``); with ``early`` inference starts on each
        replica's rows as it finishes. The replicas' answers and the decision's run-record entries."""
        key = self.key["actor", "generation"]
        start = None
        if policy is not None and levers is not None:
            start = ask_at_start(policy, step, prompts, params, self.rt.specs[key].layout.dp, levers,
                                 self.run.rollout_engine.traits.drafts)
            params = start.params
        with self.timer("gen"):
            call = self.calls.submit("gen", "generate", key, GenerateWithLogprobs(prompts, params))
            self.early = None
            if early is not None:
                self.early = EarlyInference(self.calls, call, key, early.stages, len(prompts))
                parts = self.early.run(lambda a, b, part: early.pack(a, b, part.rows))
            else:
                parts = self.calls.wait([call])[0]
        return parts, start.entries(sum((p.stats for p in parts), DecodeStats())) if start else ()

    def tail_rounds(self, levers: GenerationLevers | None) -> TailRounds | None:
        """Tail batching's rounds: the job's (``run.rollout.tail_batching``), or those of the plan's lever,
        at its over-launch; after the lever is off, until the prompts it deferred have had their round."""
        lever = levers.tail_batching if levers is not None else None
        if lever is not None:
            self.tail = TailRounds(lever, self.tail.deferred if self.tail else [])
        elif self.tail is not None and self.run.rollout_tail is None:  # the plan turned the lever off
            self.tail = TailRounds(self.tail.spec, self.tail.deferred, draining=True) if self.tail.deferred else None
        return self.tail

    def spare_prompts(self, step: int, n: int) -> list[Prompt]:
        """``n`` draws beyond the step's own (tail batching's over-launch), from a permutation of their own."""
        order = torch.randperm(len(self.train), generator=torch.Generator().manual_seed(
            derive_seed(self.run.seed, SPARE_PROMPTS, step)))
        return [self.train[int(order[i % len(self.train)])] for i in range(n)]

    def inference_stages(self) -> list[InferenceStage]:
        """Each inference stage (timer, inference key, request), in the order they are issued. One pass
        of the actor gives the old log-probs and the rollout policy's full-vocabulary entropy; none with
        ``algorithm.recompute_old_log_prob: false`` (the engine's log-probs are used, ``infer``)."""
        out = [InferenceStage("old_log_prob", self.key["actor", "inference"], LogprobsAndEntropy)
               ] if self.alg.recompute_old_log_prob else []
        out += [InferenceStage("ref", self.key["reference", "inference"], Logprobs)] if self.has("reference") else []
        out += [InferenceStage("values", self.key["critic", "inference"], Values)] if self.has("critic") else []
        return out + ([InferenceStage("reward", self.key["reward", "inference"], Values)]
                      if self.has("reward") else [])

    def infer(self, roll: Rollout, rows: list[Prompt]) -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor | tuple] = {}
        if self.run.overlap:  # every stage issued at once; the rule reward is computed while they run
            calls = {}
            for s in self.inference_stages():
                calls[s.timer] = [c for _, c in self.early.rest(s, roll.tokens)] if self.early else [
                    self.calls.submit(s.timer, "infer", s.key, s.call(roll.tokens))]
            with self.timer("reward"):
                rule = self.rule_scores(roll, rows)
            answers = iter(self.calls.wait([c for cs in calls.values() for c in cs]))
            got = {t: cat_parts([part for _ in cs for part in next(answers)]) for t, cs in calls.items()}
            for t, cs in calls.items():
                self.timing[f"timing_s/{t}"] = self.timing.get(f"timing_s/{t}", 0.0) + sum(map(self.calls.seconds, cs))
        else:
            def run(s: InferenceStage) -> torch.Tensor | tuple[torch.Tensor, ...]:
                return cat_parts(self.calls.wait([self.calls.submit(s.timer, "infer", s.key, s.call(roll.tokens))])[0])

            stages = self.inference_stages()
            for s in stages:
                if s.timer != "reward":  # the reward model is timed with the rule reward below, as always
                    with self.timer(s.timer):
                        got[s.timer] = run(s)
            with self.timer("reward"):
                rule = self.rule_scores(roll, rows)
                got.update({s.timer: run(s) for s in stages if s.timer == "reward"})
        if "old_log_prob" in got:
            logp, entropy = got["old_log_prob"]
            out = {"old_logp": roll.response_frame(logp), "entropy": roll.response_frame(entropy)}
        else:  # the log-probs the engine recorded while sampling: the same weights, forward and logits
            out = {"old_logp": roll.gen_logp * roll.mask}
        if "ref" in got:
            out["ref_logp"] = roll.response_frame(got["ref"])
        if "values" in got:
            out["values"] = roll.response_frame(got["values"])
        out.update(self.score(roll, rule, got.get("reward")))
        return out

    def score(self, roll: Rollout, rule: torch.Tensor | None, rm: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The rule-based reward (``rule_scores``) plus ``reward_model_coef`` × the reward model's score
        ``rm`` [B, T] at the last token (verl's reward manager adds them the same way)."""
        out = {}
        total = torch.zeros(len(roll.tokens)) if rule is None else rule.clone()
        if rule is not None:
            out["rule"] = rule
        if rm is not None:
            out["rm"] = rm[torch.arange(len(roll.tokens)), roll.last]
            total = total + self.run.reward_model_coef * out["rm"]
        out["score"] = total
        return out

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

    def advantages(self, roll: Rollout, rows: list[Prompt], inf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r = self.run
        with self.timer("adv"):
            x = AdvantageInputs(
                scores=inf["score"], mask=roll.mask, groups=draw_uids(len(rows), self.alg.samples_per_prompt),
                old_logp=inf["old_logp"], values=inf.get("values"),
                # the KL is a reward penalty only when it is not a loss term
                ref_logp=None if r.use_kl_loss else inf.get("ref_logp"), kl_penalty=r.kl_penalty,
                kl_coef=r.kl_coef, gamma=r.gamma, lam=r.lam, norm_adv_by_std=r.norm_adv_by_std_in_grpo)
            return advantage_estimator(self.alg.adv_estimator)(x)

    def update(self, model: str, batch: TrainBatch, loss_fn: LossFn, lr: float, step: int) -> list[MicroStats]:
        """``epochs`` × ``mini_batches`` optimizer steps on ``model``'s training layout."""
        return self.update_stats(model, self.submit_update(model, batch, loss_fn, lr, step))

    def submit_update(self, model: str, batch: TrainBatch, loss_fn: LossFn, lr: float, step: int) -> list[Call]:
        """Issue ``model``'s optimizer steps; sequentially each is answered before the next is issued,
        with ``run.overlap`` all are issued at once (the worker runs them in order either way). ``lr`` is
        the base rate, scaled by the warm-up (``RunSpec.lr_at``)."""
        key = self.key[model, "training"]
        lr = self.run.lr_at(lr, step)
        gen = torch.Generator().manual_seed(derive_seed(self.run.seed, MINI_BATCH_ORDER, step))
        horizon = self.run.max_response_length(step, self.job.workload.response.max)
        parts = [mb for _ in range(self.alg.epochs)
                 for mb in mini_batches(batch, self.alg.mini_batches, gen, self.run.loss_agg_mode, horizon)]
        calls = []
        for mb in parts:
            calls.append(self.calls.submit(f"update_{model}", "train", key, TrainStep(
                mb, loss_fn, lr, self.run.grad_clip or None, self.run.weight_decay)))
            if not self.run.overlap:
                self.calls.wait(calls[-1:])
        return calls

    def update_stats(self, model: str, calls: list[Call]) -> list[MicroStats]:
        """The statistics of ``model``'s optimizer steps ``calls``, as ``update`` returns them: one record per
        micro-batch, each with ``update``, the index of its optimizer step in the step (the last mini-batch's
        are the last ones, ``report.step_metrics``)."""
        steps = [TrainStats(tuple(parts)) for parts in self.calls.wait(calls)]
        replicas = range(len(steps[0].replicas))  # replica-major, as the statistics have always been summed
        if self.run.grad_clip:  # norms are measured while clipping: verl's actor/grad_norm, critic/grad_norm
            norms = [st.replicas[d].grad_norm for d in replicas for st in steps]
            self.grad_norms[model] = sum(norms) / len(norms)
        return [MicroStats(i, m) for d in replicas for i, st in enumerate(steps) for m in st.replicas[d].metrics]

    def sync(self) -> None:
        """Each trained model's new weights from its training layout to its other layouts, by the live
        transition executor (``Runtime.sync_weights``): shards that coincide on a worker are shared, the
        rest move point to point between workers."""
        with self.timer("update_weights"):  # verl's name for the trainer -> rollout weight update
            for model in ("actor", "critic"):
                if self.has(model):
                    self.rt.sync_weights(model, self.job)
            if self.run.rollout_engine.traits.own_weights:  # then into the engines' own copy, in place
                self.timing["timing_s/update_weights_engine"] = self.rt.update_engine(self.key["actor", "generation"])

    # ----- one step -----------------------------------------------------------------------------------
    def training_jobs(self, roll: Rollout, inf: dict, adv: dict) -> TrainingJobs:
        """model -> (batch, loss function, learning rate) of its update, critic first."""
        r, mask = self.run, roll.mask
        out = {}
        if self.has("critic"):
            batch = TrainBatch(roll.tokens, roll.index, mask, old_values=inf["values"], returns=adv["returns"])
            out["critic"] = (batch, partial(losses.critic_loss, clip=r.value_clip), r.critic_lr)
        kl_coef = r.kl_loss_coef if r.use_kl_loss and "ref_logp" in inf else 0.0
        batch = TrainBatch(roll.tokens, roll.index, mask, old_logp=inf["old_logp"], advantages=adv["adv"],
                           ref_logp=inf["ref_logp"] if kl_coef else None)
        # verl: clip_ratio_low and clip_ratio_high each default to clip_ratio
        low = r.clip_ratio if r.clip_ratio_low is None else r.clip_ratio_low
        high = r.clip_ratio if r.clip_ratio_high is None else r.clip_ratio_high
        loss = losses.policy_loss(clip_low=low, clip_high=high, kl_loss_coef=kl_coef, kl_loss_type=r.kl_loss_type,
                                  clip_ratio_c=r.clip_ratio_c, entropy_coeff=r.entropy_coeff)
        out["actor"] = (batch, loss, r.actor_lr)
        return out

    def train_models(self, step: int, jobs: TrainingJobs) -> dict[str, list[dict[str, float]]]:
        """Both models' updates: one after the other, or (``run.overlap``) all their optimizer steps issued
        together, so a critic and an actor trained on disjoint workers train at the same time."""
        if not self.run.overlap:
            stats = {}
            for model, (batch, loss, lr) in jobs.items():
                with self.timer(f"update_{model}"):
                    stats[model] = self.update(model, batch, loss, lr, step)
            return stats
        issued = {model: self.submit_update(model, batch, loss, lr, step) for model, (batch, loss, lr) in jobs.items()}
        stats = {model: self.update_stats(model, calls) for model, calls in issued.items()}
        for model, calls in issued.items():
            self.timing[f"timing_s/update_{model}"] = sum(self.calls.seconds(c) for c in calls)
        return stats

    def step(self, step: int, policy: GenerationPolicy | None = None) -> dict[str, float]:
        """One RL step; its metric line."""
        return self.run_step(step, policy).metrics

    def run_step(self, step: int, policy: GenerationPolicy | None = None,
                 levers: GenerationLevers | None = None) -> StepRun:
        """One RL step under the plan's ``levers``: its metric line, the decisions ``policy`` took inside its
        generation, and its responses' lengths."""
        if self.asynchronous is not None and self.asynchronous.enabled:  # run.async: generation one step ahead
            return StepRun(self.asynchronous.step(step))
        self.timing, self.grad_norms = {}, {}
        self.calls.reset()
        t0 = time.perf_counter()
        gen = self.generate(step, self.prompts(step), policy, levers)
        roll, rows = gen.rollout, gen.rows
        inf = self.infer(roll, rows)
        adv = self.advantages(roll, rows, inf)
        stats = self.train_models(step, self.training_jobs(roll, inf, adv))
        self.sync()
        self.timing["timing_s/step"] = time.perf_counter() - t0
        m = self.metrics(step, roll, inf, adv, stats)
        zeros = dict.fromkeys(DECODE_METRICS + (METRICS if self.run.rollout_midstep is not None else ()), 0.0)
        m.update(zeros | gen.metrics)  # zeros for what a step generated otherwise does not measure
        m.update(self.calls.worker_metrics(len(self.rt.workers), self.timing["timing_s/step"],
                                           self.timing.get("timing_s/update_weights", 0.0)))
        if self.asynchronous is not None:  # run.async auto: decides from the synchronous steps' times
            self.asynchronous.observe(step, m)
        return StepRun(m, gen.entries, tuple(float(x) for x in roll.response_len.tolist()))

    def metrics(self, step: int, roll: Rollout, inf: dict, adv: dict, stats: dict) -> dict[str, float]:
        """verl's metric names (``critic/score/mean``, ``actor/pg_loss``, ``response_length/mean``...)."""
        return step_metrics(self, step, roll, inf, adv, stats)
