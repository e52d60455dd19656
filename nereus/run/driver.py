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
from functools import partial

import torch

from nereus.rl.core import AdvantageInputs, advantage_estimator
from nereus.rl.data import Prompt
from nereus.rl.rewards import RewardRouter
from nereus.rl.tokenizer import Tokenizer
from nereus.run import remote
from nereus.run.report import step_metrics
from nereus.run.rollout import Rollout, draw_uids, mini_batches, pack, repeat_prompts
from nereus.run.setup import Placed
from nereus.runtime.generate import SamplingParams
from nereus.spec.job import JobSpec


class Stepper:
    """Runs steps of ``job`` on runtime ``rt`` whose models are loaded under ``placed``."""

    def __init__(self, job: JobSpec, rt: object, placed: list[Placed], tok: Tokenizer,
                 train: list[Prompt], reward: RewardRouter | None = None) -> None:
        self.job, self.rt, self.tok, self.train = job, rt, tok, train
        self.reward = reward or RewardRouter(job.run.rule_reward, job.run.reward_function)
        self.run, self.alg = job.run, job.algorithm
        self.key = {(p.model, p.stage): p.key for p in placed}
        self.placed = placed
        self.timing: dict[str, float] = {}
        self.grad_norms: dict[str, float] = {}  # model → mean global gradient norm of the last step

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
            order = torch.randperm(len(self.train), generator=torch.Generator().manual_seed(self.run.seed + epoch))
            out.append(self.train[int(order[pos])])
        return out

    # ----- stages -------------------------------------------------------------------------------------
    def generate(self, step: int, prompts: list[Prompt]) -> tuple[Rollout, list[Prompt]]:
        n = self.alg.samples_per_prompt
        rows = repeat_prompts(prompts, n)
        limit = self.run.max_response_length(step, self.job.workload.response.max)
        params = SamplingParams(max_new_tokens=limit, temperature=self.run.temperature, top_p=self.run.top_p,
                                eos_token_id=self.tok.eos_token_id, pad_token_id=self.tok.pad_token_id,
                                seed=self.run.seed * 100_003 + step)
        with self.timer("gen"):
            out = self.rt.generate_with_logprobs(self.key["actor", "generation"], [list(p.ids) for p in rows],
                                                 params)
        return pack([list(p.ids) for p in rows], [r for r, _ in out], [lp for _, lp in out],
                    self.tok.eos_token_id), rows

    def infer(self, roll: Rollout, rows: list[Prompt]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        with self.timer("old_log_prob"):
            # one pass gives the old log-probs and the rollout policy's full-vocabulary entropy (actor/entropy)
            logp, entropy = self.rt.logprobs_and_entropy(self.key["actor", "inference"], roll.tokens)
            out["old_logp"], out["entropy"] = roll.response_frame(logp), roll.response_frame(entropy)
        if self.has("reference"):
            with self.timer("ref"):
                out["ref_logp"] = roll.response_frame(self.rt.logprobs(self.key["reference", "inference"],
                                                                       roll.tokens))
        if self.has("critic"):
            with self.timer("values"):
                out["values"] = roll.response_frame(self.rt.values(self.key["critic", "inference"], roll.tokens))
        with self.timer("reward"):
            out.update(self.score(roll, rows))
        return out

    def score(self, roll: Rollout, rows: list[Prompt]) -> dict[str, torch.Tensor]:
        """Rule-based reward on the decoded response (``rl.rewards.RewardRouter``: by ``data_source``, a
        named rule, or the user's function) plus ``reward_model_coef`` × the reward model's score at the
        last token (verl's reward manager adds them the same way)."""
        out = {}
        responses = roll.tokens.tolist()
        rule = torch.zeros(len(rows))
        if self.run.rule_reward != "none":
            for i, p in enumerate(rows):
                start, n = int(roll.prompt_len[i]), int(roll.response_len[i])
                eos = self.tok.eos_token_id
                text = self.tok.decode([t for t in responses[i][start: start + n] if t != eos])
                rule[i] = self.reward.score(p.data_source, text, p.ground_truth, bool(roll.finished[i]), p.extra_info)
            out["rule"] = rule
        total = rule.clone()
        if self.has("reward"):
            rm = self.rt.values(self.key["reward", "inference"], roll.tokens)
            out["rm"] = rm[torch.arange(len(rows)), roll.last]
            total = total + self.run.reward_model_coef * out["rm"]
        out["score"] = total
        return out

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

    def update(self, model: str, batch: dict[str, torch.Tensor], loss_fn: object, lr: float,
               step: int) -> list[dict[str, float]]:
        """``epochs`` × ``mini_batches`` optimizer steps on ``model``'s training layout."""
        key = self.key[model, "training"]
        gen = torch.Generator().manual_seed(self.run.seed * 7_919 + step)
        horizon = self.run.max_response_length(step, self.job.workload.response.max)
        parts = [mb for _ in range(self.alg.epochs)
                 for mb in mini_batches(batch, self.alg.mini_batches, gen, self.run.loss_agg_mode, horizon)]
        steps = [self.rt.train_step(key, mb, loss_fn, lr, self.run.grad_clip or None) for mb in parts]
        replicas = range(len(steps[0].replicas))  # replica-major, as the statistics have always been summed
        if self.run.grad_clip:  # norms are measured while clipping: verl's actor/grad_norm, critic/grad_norm
            norms = [st.replicas[d].grad_norm for d in replicas for st in steps]
            self.grad_norms[model] = sum(norms) / len(norms)
        return [m for d in replicas for st in steps for m in st.replicas[d].metrics]

    def sync(self) -> None:
        """Each trained model's new weights from its training layout to its other layouts, by the live
        transition executor (``Runtime.sync_weights``): shards that coincide on a worker are shared, the
        rest move point to point between workers."""
        with self.timer("update_weights"):  # verl's name for the trainer -> rollout weight update
            for model in ("actor", "critic"):
                if self.has(model):
                    self.rt.sync_weights(model, self.job)

    # ----- one step -----------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        self.timing, self.grad_norms = {}, {}
        t0 = time.perf_counter()
        rows_p = self.prompts(step)
        roll, rows = self.generate(step, rows_p)
        inf = self.infer(roll, rows)
        adv = self.advantages(roll, rows, inf)
        r, mask = self.run, roll.mask
        stats: dict[str, list[dict[str, float]]] = {}
        if self.has("critic"):
            with self.timer("update_critic"):
                batch = {"tokens": roll.tokens, "index": roll.index, "mask": mask, "old_values": inf["values"],
                         "returns": adv["returns"]}
                stats["critic"] = self.update("critic", batch, partial(remote.critic_loss, clip=r.value_clip),
                                              r.critic_lr, step)
        with self.timer("update_actor"):
            batch = {"tokens": roll.tokens, "index": roll.index, "mask": mask, "old_logp": inf["old_logp"],
                     "adv": adv["adv"]}
            kl_coef = r.kl_loss_coef if r.use_kl_loss and "ref_logp" in inf else 0.0
            if kl_coef:
                batch["ref_logp"] = inf["ref_logp"]
            # verl: clip_ratio_low and clip_ratio_high each default to clip_ratio
            low = r.clip_ratio if r.clip_ratio_low is None else r.clip_ratio_low
            high = r.clip_ratio if r.clip_ratio_high is None else r.clip_ratio_high
            loss = remote.policy_loss(clip_low=low, clip_high=high, kl_loss_coef=kl_coef, kl_loss_type=r.kl_loss_type,
                                      clip_ratio_c=r.clip_ratio_c, entropy_coeff=r.entropy_coeff)
            stats["actor"] = self.update("actor", batch, loss, r.actor_lr, step)
        self.sync()
        self.timing["timing_s/step"] = time.perf_counter() - t0
        return self.metrics(step, roll, inf, adv, stats)

    def metrics(self, step: int, roll: Rollout, inf: dict, adv: dict, stats: dict) -> dict[str, float]:
        """verl's metric names (``critic/score/mean``, ``actor/pg_loss``, ``response_length/mean``...)."""
        return step_metrics(self, step, roll, inf, adv, stats)
