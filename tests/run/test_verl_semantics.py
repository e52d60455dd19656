"""Nereus's RL math on small hand-checkable inputs against values derived by hand from verl's formulas.

Sources (verl, https://github.com/volcengine/verl):
- verl/trainer/ppo/core_algos.py: ``compute_policy_loss_vanilla`` (dual-clip: for A < 0 the clipped loss is
  capped at −A·clip_ratio_c; ``pg_clipfrac_lower`` counts where the cap bites), ``agg_loss`` (the four
  ``loss_agg_mode`` formulas, normalised over the whole mini-batch), ``compute_value_loss`` (0.5 ·
  agg_loss of the clipped squared error), ``compute_grpo_outcome_advantage`` (groups by the per-sample
  ``index``/uid; a group of one has mean 0 and std 1, then (score − mean)/(std + 1e-6)), ``kl_penalty``
  (kl/k1, abs, mse/k2, low_var_kl/k3 with log r clamped to ±20 and the result to ±10; full unimplemented);
- verl/utils/torch_functional.py ``entropy_from_logits``: logsumexp(z) − Σ softmax(z)·z per position;
- verl/trainer/config/ppo_trainer.yaml: the defaults (clip_ratio 0.2, clip_ratio_c 3.0, token-mean,
  kl_loss_type low_var_kl, kl_penalty kl, norm_adv_by_std_in_grpo true, entropy_coeff 0).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from nereus.rl import losses
from nereus.rl.core import (
    agg_loss,
    agg_weights,
    clipped_policy_loss,
    entropy_from_logits,
    grpo_advantages,
    kl_estimate,
    masked_mean,
)
from nereus.run.rollout import draw_uids, mini_batches, repeat_prompts
from nereus.runtime.parallel.batch import TrainBatch
from nereus.spec.errors import SpecError
from nereus.spec.job import job_from_dict
from nereus.spec.run import RunSpec

T = torch.tensor


# ----- dual-clip PPO -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("ratio", "adv", "loss", "clipfrac", "lower"), [
    # r = 4, A = −1: max(−A·r, −A·clip(r)) = max(4, 1.2) = 4; capped at −A·c = 3 -> 3, the dual clip bites
    (4.0, -1.0, 3.0, 0.0, 1.0),
    # r = 2, A = −1: max(2, 1.2) = 2 < 3 -> 2
    (2.0, -1.0, 2.0, 0.0, 0.0),
    # r = 0.5, A = −1: max(0.5, 0.8) = 0.8 (first clip), below the cap
    (0.5, -1.0, 0.8, 1.0, 0.0),
    # r = 4, A = +1: max(−4, −1.2) = −1.2; no cap for positive advantages
    (4.0, 1.0, -1.2, 1.0, 0.0),
])
def test_dual_clip_as_verl(ratio, adv, loss, clipfrac, lower):
    out, frac, low = clipped_policy_loss(T([math.log(ratio)]), T([0.0]), T([adv]), 0.2, 0.2, 3.0)
    assert float(out) == pytest.approx(loss, abs=1e-6)
    assert (float(frac), float(low)) == (clipfrac, lower)


def test_dual_clip_off_and_bad_bound():
    out, _, low = clipped_policy_loss(T([math.log(4.0)]), T([0.0]), T([-1.0]), 0.2, None, None)
    assert float(out) == pytest.approx(4.0) and float(low) == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        clipped_policy_loss(T([0.0]), T([0.0]), T([1.0]), 0.2, None, 1.0)


def test_clip_ratio_low_and_high_separately():
    # r = 0.5 with A = −1 and clip_ratio_low 0.4: clip(r) = 0.6 -> max(0.5, 0.6) = 0.6
    out, _, _ = clipped_policy_loss(T([math.log(0.5)]), T([0.0]), T([-1.0]), 0.4, 0.28)
    assert float(out) == pytest.approx(0.6, abs=1e-6)


# ----- loss aggregation --------------------------------------------------------------------------------
LOSS = T([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]])
MASK = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


@pytest.mark.parametrize(("mode", "horizon", "expected"), [
    ("token-mean", None, (1 + 2 + 3 + 4 + 5) / 5),  # Σ mask·ℓ / Σ mask = 15 / 5
    ("seq-mean-token-sum", None, (3 + 12) / 2),  # sequence sums 3 and 12, mean over sequences
    ("seq-mean-token-mean", None, (1.5 + 4.0) / 2),  # sequence means 1.5 and 4
    ("seq-mean-token-sum-norm", None, (3 / 3 + 12 / 3) / 2),  # sums over the response width R = 3
    ("seq-mean-token-sum-norm", 6, (3 / 6 + 12 / 6) / 2),  # over a given maximum response length
    ("token-sum", None, 1 + 2 + 3 + 4 + 5),  # Σ mask·ℓ, no normaliser
])
def test_each_aggregation_mode(mode, horizon, expected):
    assert float(agg_loss(LOSS, MASK, mode, horizon)) == pytest.approx(expected, abs=1e-6)
    # the per-row weights give the same number from any split into equal micro-batches (one row each here)
    w = agg_weights(MASK, mode, horizon)
    per_micro = [float((LOSS[i] * w[i]).sum()) / 1 for i in range(2)]
    assert sum(per_micro) / 2 == pytest.approx(expected, abs=1e-6)


def test_unknown_aggregation_mode():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(LOSS, MASK, "token-max")


def _actor_batch(mode: str) -> dict:
    # two responses of 2 and 3 tokens; the model's log-probs are the batch's own frame (index = arange)
    logp = T([[math.log(0.5), math.log(0.5), 0.0], [math.log(0.25), 0.0, math.log(0.5)]])
    batch = TrainBatch(torch.zeros(2, 4, dtype=torch.long), torch.arange(3).repeat(2, 1), MASK,
                       old_logp=torch.full((2, 3), math.log(0.5)), advantages=T([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]))
    (mb,) = mini_batches(batch, 1, torch.Generator().manual_seed(0), mode)
    return {"logp": logp, "mb": mb}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_actor_loss_aggregates_as_verl(mode):
    b = _actor_batch(mode)
    mb = b["mb"]
    out = losses.actor_loss(b["logp"], mb, 0.2, 0.2, 0.0, "k3", 3.0)
    pg, _, _ = clipped_policy_loss(b["logp"].gather(1, mb.index), mb.old_logp, mb.advantages, 0.2, 0.2, 3.0)
    assert float(out.value) == pytest.approx(float(agg_loss(pg, mb.mask, mode)), abs=1e-6)
    assert out.stats.pg_loss == pytest.approx(float(agg_loss(pg, mb.mask, mode)), abs=1e-6)
    # verl's ppo_kl: masked mean of old − new log-probs
    expected = float(((mb.old_logp - b["logp"].gather(1, mb.index)) * mb.mask).sum() / mb.mask.sum())
    assert out.stats.ppo_kl == pytest.approx(expected, abs=1e-6)


def test_critic_loss_is_half_the_aggregated_clipped_error():
    # V_old 1, V 2, R 3, c .5 on every token: max((2−3)², (1.5−3)²) = 2.25 per token; seq-mean-token-sum:
    # sums 2·2.25 and 3·2.25, mean 5.625, times 0.5 = 2.8125
    batch = TrainBatch(torch.zeros(2, 4, dtype=torch.long), torch.arange(3).repeat(2, 1), MASK,
                       old_values=torch.ones(2, 3), returns=torch.full((2, 3), 3.0))
    (mb,) = mini_batches(batch, 1, torch.Generator().manual_seed(0), "seq-mean-token-sum")
    out = losses.critic_loss(torch.full((2, 3), 2.0), mb, 0.5)
    assert float(out.value) == pytest.approx(2.8125, abs=1e-6)


# ----- GRPO groups -------------------------------------------------------------------------------------
def test_grpo_groups_by_draw_uid_not_by_prompt():
    # prompt A drawn twice and B once, two responses each: rows A A B B A A, uids 0 0 1 1 2 2
    rows = repeat_prompts(["A", "B", "A"], 2)
    uids = draw_uids(len(rows), 2)
    assert rows == ["A", "A", "B", "B", "A", "A"] and uids.tolist() == [0, 0, 1, 1, 2, 2]
    scores, mask = T([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), torch.ones(6, 1)
    # uid 0: (1, 0): mean .5, unbiased std √.5 -> ±.5/√.5 = ±0.7071; uids 1 and 2 equal scores -> 0
    adv = grpo_advantages(scores, uids, mask)[:, 0]
    torch.testing.assert_close(adv, T([0.707106, -0.707106, 0.0, 0.0, 0.0, 0.0]), atol=1e-5, rtol=0)
    # grouping by prompt text would merge A's four responses (1, 0, 0, 0): mean .25, std .5 -> 1.5, −.5, ...
    by_text = grpo_advantages(scores, T([0, 0, 1, 1, 0, 0]), mask)[:, 0]
    assert float(by_text[0]) == pytest.approx(1.5, abs=1e-5) and not torch.allclose(adv, by_text)


def test_grpo_group_of_one_as_verl():
    # verl: a group of one has mean 0 and std 1 -> score / (1 + 1e-6); without std normalisation, the score
    adv = grpo_advantages(T([2.0, 1.0, 3.0]), T([0, 1, 1]), torch.ones(3, 2))
    assert float(adv[0, 0]) == pytest.approx(2.0 / (1 + 1e-6), abs=3e-7) and float(adv[0, 0]) < 2.0  # fp32
    assert float(grpo_advantages(T([2.0]), T([0]), torch.ones(1, 1), std_normalise=False)) == 2.0


# ----- KL spellings ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "expected"), [
    # π = .25, π_ref = .5: log r = −ln 2, r = .5
    ("kl", -math.log(2)), ("k1", -math.log(2)), ("abs", math.log(2)),
    ("mse", 0.5 * math.log(2) ** 2), ("k2", 0.5 * math.log(2) ** 2),
    ("low_var_kl", 2 - 1 - math.log(2)), ("k3", 2 - 1 - math.log(2)),  # 1/r − 1 + log r
])
def test_kl_spellings(kind, expected):
    assert float(kl_estimate(T([math.log(0.25)]), T([math.log(0.5)]), kind)) == pytest.approx(expected, abs=1e-6)


def test_low_var_kl_clamps_as_verl():
    # log r = 30 -> clamped to 20: e^−20 − 1 + 20 ≈ 19 -> clamped to 10; log r = −30 -> e^20 − 21 -> 10
    out = kl_estimate(T([30.0, -30.0]), T([0.0, 0.0]), "low_var_kl")
    assert out.tolist() == [10.0, 10.0]


def _spec(algorithm: dict | None = None, run: dict | None = None, name: str = "grpo") -> dict:
    models = ("actor", "reference") if name == "grpo" else ("actor", "critic", "reference")
    return {"models": {m: {"preset": "qwen2.5-0.5b"} for m in models},
            "algorithm": {"name": name, **(algorithm or {})},
            "workload": {"prompts_per_step": 4, "prompt_length": 8, "response_length": {"mean": 3, "max": 4}},
            "cluster": {"gpu": "H100", "nodes": 1, "gpus_per_node": 4}, "run": run or {}}


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3"])
def test_spec_accepts_verl_kl_spellings(kind):
    run = job_from_dict(_spec(run={"kl_loss_type": kind, "kl_penalty": kind})).run
    assert (run.kl_loss_type, run.kl_penalty) == (kind, kind)


def test_spec_refuses_full_kl_naming_the_key():
    with pytest.raises(SpecError, match=r"run\.kl_loss_type.*full-vocabulary KL is not implemented"):
        job_from_dict(_spec(run={"kl_loss_type": "full"}))


# ----- entropy -----------------------------------------------------------------------------------------
def test_entropy_token_averaged_with_the_mask():
    # position entropies: uniform over 4 -> ln 4; (.25, .75) -> −(.25 ln .25 + .75 ln .75); the third is masked
    logits = T([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9], [5.0, 0.0, 0.0, 0.0]]])
    h = entropy_from_logits(logits)
    two = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert float(agg_loss(h, T([[1.0, 1.0, 0.0]]), "token-mean")) == pytest.approx((math.log(4) + two) / 2, abs=1e-6)


# ----- spec: verl's knobs and defaults -----------------------------------------------------------------
def test_defaults_are_verls():
    run = job_from_dict(_spec()).run
    assert (run.clip_ratio, run.clip_ratio_c, run.loss_agg_mode, run.norm_adv_by_std_in_grpo, run.entropy_coeff) \
        == (0.2, 3.0, "token-mean", True, 0.0)
    assert RunSpec().clip_ratio_low is None and RunSpec().clip_ratio_high is None  # both default to clip_ratio


@pytest.mark.parametrize(("algorithm", "run", "match"), [
    ({"samples_per_prompt": 1}, {}, r"algorithm\.samples_per_prompt.*at least 2"),
    ({}, {"clip_ratio_c": 1.0}, r"run\.clip_ratio_c.*must exceed 1"),
    ({}, {"loss_agg_mode": "token-max"}, r"run\.loss_agg_mode.*choose one of"),
    ({}, {"entropy_coeff": -0.001}, r"run\.entropy_coeff.*out of range"),
    ({}, {"logger": ["console", "neptune"]}, r"run\.logger\[1\].*not a logger"),
])
def test_spec_refuses_bad_knobs_naming_the_key(algorithm, run, match):
    with pytest.raises(SpecError, match=match):
        job_from_dict(_spec(algorithm, run))


def test_spec_reads_verl_knobs():
    run = job_from_dict(_spec(run={"clip_ratio_low": 0.1, "clip_ratio_high": 0.28, "clip_ratio_c": 2.5,
                                   "loss_agg_mode": "seq-mean-token-sum-norm", "norm_adv_by_std_in_grpo": False,
                                   "logger": ["console", "tensorboard"]})).run
    assert (run.clip_ratio_low, run.clip_ratio_high, run.clip_ratio_c) == (0.1, 0.28, 2.5)
    assert run.loss_agg_mode == "seq-mean-token-sum-norm" and run.norm_adv_by_std_in_grpo is False
    assert run.logger == ("console", "tensorboard")


@pytest.mark.distributed
def test_runtime_entropy_is_the_full_vocabulary_entropy_under_tensor_parallelism(ray_runtime, tmp_path):
    """The inference pass's entropy (vocabulary shards, three all-reduces) equals entropy_from_logits of
    the single-process model's full logits, its log-probs equal the plain ``logprobs`` op, and its Σ_v π(v)²
    (the optimal token baseline's) equals the full softmax's."""
    from nereus.runtime.model.decoder import build_model
    from nereus.runtime.model.hf import save_checkpoint
    from nereus.spec.layout import Layout
    from tests.runtime.common import MQA, batch, reference

    save_checkpoint(tmp_path, MQA, build_model(MQA, seed=1).state_dict())
    ray_runtime.load("ent", MQA, Layout(tp=2, pp=2, dp=1, recompute="none", sequence_parallel=False),
                     checkpoint=tmp_path)
    try:
        tokens = batch(MQA).tokens
        logp, h = ray_runtime.logprobs_and_entropy("ent", tokens)
        ref = reference(MQA)["fwd"]
        torch.testing.assert_close(h, entropy_from_logits(ref["logits"][:, :-1]), rtol=1e-4, atol=2e-5)
        torch.testing.assert_close(logp, ref["logprobs"], rtol=1e-4, atol=2e-5)
        # the optimal token baseline's Σ_v π(v)², from the same pass's vocabulary shards
        logp2, h2, sum_pi_squared = ray_runtime.logprobs_entropy_and_sum_pi_squared("ent", tokens)
        pi = torch.softmax(ref["logits"][:, :-1].float(), -1)
        torch.testing.assert_close(sum_pi_squared, (pi * pi).sum(-1), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close((logp2, h2), (logp, h))
    finally:
        ray_runtime.release("ent")


def test_the_step_gives_a_prompt_drawn_twice_two_groups(tmp_path):
    """The driver's advantages on a GRPO step whose prompts are A, B, A (two responses each): A's two
    draws are normalised separately, as verl's per-draw uids do."""
    from nereus.rl.data import Prompt
    from nereus.run.inference import Inferred
    from nereus.run.rollout import pack
    from nereus.run.training import advantages
    from tests.run.jobs import tiny_job

    job = tiny_job("grpo", str(tmp_path))
    job = replace(job, algorithm=replace(job.algorithm, samples_per_prompt=2))
    a, b = Prompt((1, 2), "x", "s", 0), Prompt((3, 4), "y", "s", 1)
    rows = repeat_prompts([a, b, a], 2)
    roll = pack([list(p.ids) for p in rows], [[5, 6]] * 6, None, eos=7)
    inf = Inferred(score=T([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), old_logp=torch.zeros(6, 2))
    adv = advantages(job, roll, rows, inf)["adv"][:, 0]
    # draw 0 of A: (1, 0) -> ±0.7071; B and the second draw of A: equal scores -> 0
    torch.testing.assert_close(adv, T([0.707106, -0.707106, 0.0, 0.0, 0.0, 0.0]), atol=1e-5, rtol=0)


def test_entropy_bonus_in_the_actor_loss():
    # verl: policy_loss = pg_loss − entropy_coeff · agg(entropy); with entropy 2 on every token and
    # coefficient 0.1 the loss is 0.2 below the plain one, and the loss asks the engine for the entropy
    b = _actor_batch("token-mean")
    mb = replace(b["mb"], entropy=torch.full((2, 3), 2.0))
    plain = losses.policy_loss(clip_low=0.2, clip_high=0.2, kl_loss_coef=0.0, kl_loss_type="k3")
    bonus = losses.policy_loss(clip_low=0.2, clip_high=0.2, kl_loss_coef=0.0, kl_loss_type="k3", entropy_coeff=0.1)
    assert not plain.needs_entropy and bonus.needs_entropy
    assert float(bonus(b["logp"], mb).value) == pytest.approx(float(plain(b["logp"], mb).value) - 0.2, abs=1e-6)


class _EntropyLoss:
    """A loss on the log-probs and the engine-supplied entropy (module level: forked ranks run it)."""

    needs_entropy = True

    def __call__(self, out: torch.Tensor, mb: TrainBatch) -> torch.Tensor:
        return -0.1 * out.mean() - masked_mean(mb.entropy, torch.ones_like(mb.entropy))


def _entropy_gradient_body(rank: int, world: int) -> None:
    from nereus.runtime.comm.groups import ParallelGroups
    from nereus.runtime.model.decoder import build_model
    from nereus.runtime.model.hf import slice_boxes
    from nereus.runtime.parallel.sharded import ShardedModel, shard_boxes, tied_head
    from nereus.spec.layout import Layout
    from tests.runtime.common import MQA, batch

    model = build_model(MQA, seed=1)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tokens = batch(MQA).tokens
    logits = model(tokens)[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    (-0.1 * logp.mean() - entropy_from_logits(logits).mean()).backward()
    layout = Layout(tp=2, pp=1, dp=1, micro_batch_size=len(tokens), recompute="none", sequence_parallel=False)
    groups = ParallelGroups(layout, tied_embeddings=tied_head(MQA))
    boxes = shard_boxes(MQA, groups)
    sm = ShardedModel(MQA, groups, slice_boxes(state, boxes))
    sm.backward(TrainBatch(tokens), _EntropyLoss())
    grads = dict(model.named_parameters())
    for name, p in sm.model.named_parameters():
        src = "model.embed_tokens.weight" if name == "tied_head" else name
        want = grads[src].grad[tuple(slice(lo, hi) for lo, hi in boxes[name])]
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
    groups.destroy()


@pytest.mark.distributed
def test_entropy_gradient_under_tensor_parallelism_matches_one_process():
    """The training pass's vocabulary-parallel entropy (TP=2) gives every shard the gradient a single
    process computes for the same loss: the entropy bonus trains as verl's does."""
    from nereus.runtime.cluster.launch import run_world

    run_world(_entropy_gradient_body, 2, timeout_s=60)
