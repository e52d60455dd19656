"""The policy-loss registry (``nereus.rl.policy_losses`` through ``nereus.rl.core.policy_loss_fn``) against
plain references written here from each paper's formula (and verl's clamps, eps and defaults: verl
verl/trainer/ppo/core_algos.py), the aggregation modes, and the invariant the training path rests on: the
aggregate over a mini-batch equals the sum of its micro-batches' (or data-parallel replicas') parts
Σ w·ℓ / rows with the mini-batch's weights, for every loss and mode."""

from __future__ import annotations

import math

import pytest
import torch

from nereus.rl import losses
from nereus.rl.core import POLICY_LOSS_FNS, agg_loss, agg_weights, policy_loss_fn
from nereus.rl.policy_loss_types import PolicyLossOptions
from nereus.run.rollout import mini_batches
from nereus.runtime.parallel.batch import TrainBatch
from nereus.spec.algorithms import LOSS_AGG_MODES, POLICY_LOSSES

B, R = 8, 6
OPTIONS = {"dro": {"dro_beta": 0.3}, "bypass_mode": {"rollout_is": "token", "loss_type": "reinforce"}}
# clip_cov/kl_cov pick tokens by a covariance over the batch they are given (verl computes it per micro-batch)
BATCH_WIDE = ("clip_cov", "kl_cov")


def _inputs(seed: int = 0, empty_row: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, R + 1, (B,), generator=g)
    if empty_row:
        lengths[3] = 0  # a fully masked row (padded, packed or filtered batches have them)
    mask = (torch.arange(R) < lengths[:, None]).float()
    old = -torch.rand(B, R, generator=g) * 2
    logp = (old + 0.4 * torch.randn(B, R, generator=g)).clamp(max=-1e-3)
    adv = torch.randn(B, 1, generator=g).expand(B, R) * mask  # sequence-level advantages, as GRPO's
    return {"logp": logp.requires_grad_(), "old": old, "adv": adv.contiguous(), "mask": mask}


def _mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum())


# ----- references, one per formula --------------------------------------------------------------------------
def _ref_ppo(lp, old, a, low=0.2, high=0.2, c=3.0):
    r = math.exp(max(-20.0, min(20.0, lp - old)))
    loss = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
    return min(loss, -a * c) if a < 0 else loss


def _token_ref(fn, x):
    lp, old, a = x["logp"].detach(), x["old"], x["adv"]
    return torch.tensor([[fn(float(lp[i, t]), float(old[i, t]), float(a[i, t])) for t in range(R)] for i in range(B)])


def _ref_gspo(x, low=0.2, high=0.2):
    out = torch.zeros(B, R)
    for i in range(B):
        n = int(x["mask"][i].sum())
        if n == 0:
            continue
        s = math.exp(min(10.0, float((x["logp"][i, :n] - x["old"][i, :n]).sum()) / n))  # (π/π_old)^(1/|y|)
        a = float(x["adv"][i, 0])
        out[i, :n] = max(-a * s, -a * min(max(s, 1 - low), 1 + high))
    return out


def _ref_geo_mean(x, low=0.2, high=0.2):
    out = torch.zeros(B, R)
    for i in range(B):
        n = int(x["mask"][i].sum())
        if n == 0:
            continue
        a = float(x["adv"][i, 0])
        logs = [float(x["logp"][i, t] - x["old"][i, t]) for t in range(n)]
        sgn = (a > 0) - (a < 0)
        # clip log r to [−ε_low, ε_high] only on the pessimistic side of the advantage
        clipped = [sgn * min(sgn * v, sgn * min(max(v, -low), high)) for v in logs]
        out[i, :n] = -a * math.exp(sum(clipped) / n)
    return out


def _sapo(lp, old, a, tau_pos=1.0, tau_neg=1.05):
    tau = tau_pos if a > 0 else tau_neg
    r = math.exp(lp - old)
    return -a * 4.0 / tau / (1 + math.exp(-tau * (r - 1)))


def _cispo(lp, old, a, low=0.2, high=0.2):
    return -min(max(math.exp(lp - old), 1 - low), 1 + high) * a * lp


def _dppo_tv(lp, old, a, low=0.2, high=0.2, c=3.0):
    moved = math.exp(lp) - math.exp(old)
    inside = moved <= high if a > 0 else moved >= -low
    return -a * min(math.exp(lp - old), c) * lp * inside


def _dppo_kl(lp, old, a, low=0.2, high=0.2, c=3.0):
    p, q = math.exp(lp), math.exp(old)
    kl = q * (old - lp) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
    inside = (kl <= high or p <= q) if a > 0 else (kl <= low or p >= q)
    return -a * min(math.exp(lp - old), c) * lp * inside


REFERENCES = {
    "vanilla": lambda x: _token_ref(_ref_ppo, x),
    "gspo": _ref_gspo,
    "sapo": lambda x: _token_ref(_sapo, x),
    "gpg": lambda x: _token_ref(lambda lp, old, a: -a * lp, x),
    "geo_mean": _ref_geo_mean,
    "cispo": lambda x: _token_ref(_cispo, x),
    "dppo_tv": lambda x: _token_ref(_dppo_tv, x),
    "dppo_kl": lambda x: _token_ref(_dppo_kl, x),
    "dro": lambda x: _token_ref(lambda lp, old, a: -(lp * a - 0.5 * 0.3 * (lp - old) ** 2), x),
    # bypass, reinforce with token IS weights (TIS at 2): −sg[min(π/π_rollout, 2)]·A·log π
    "bypass_mode": lambda x: _token_ref(lambda lp, old, a: -min(math.exp(lp - old), 2.0) * a * lp, x),
}
FIXED_AGGREGATION = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}


def test_registry_holds_verls_names_and_refuses_others_with_the_list():
    assert tuple(POLICY_LOSS_FNS) == POLICY_LOSSES
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo2'; choose one of \['vanilla', 'gspo'"):
        policy_loss_fn("ppo2")
    with pytest.raises(ValueError, match="unknown policy-loss option"):
        policy_loss_fn("vanilla")(*_args(_inputs()), loss_agg_mode="token-mean", clip_ration=0.1)


def _args(x):
    return x["logp"], x["old"], x["adv"], x["mask"]


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_each_loss_matches_its_formula(name, mode):
    x = _inputs()
    loss, _ = policy_loss_fn(name)(*_args(x), loss_agg_mode=mode, **OPTIONS.get(name, {}))
    want = agg_loss(REFERENCES[name](x), x["mask"], FIXED_AGGREGATION.get(name, mode))
    assert float(loss) == pytest.approx(float(want), rel=1e-5, abs=1e-6)


def test_metrics_carry_verls_names_and_values():
    x = _inputs()
    lp, old, a, mask = x["logp"].detach(), x["old"], x["adv"], x["mask"]
    _, m = policy_loss_fn("vanilla")(*_args(x), loss_agg_mode="token-mean")
    r = torch.exp(lp - old)
    clip = ((-a * r.clamp(0.8, 1.2)) > (-a * r)).float()
    assert m["actor/pg_clipfrac"] == pytest.approx(_mean(clip, mask))
    assert m["actor/ppo_kl"] == pytest.approx(_mean(old - lp, mask))
    assert set(m) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    _, m = policy_loss_fn("kl_cov")(*_args(x), loss_agg_mode="token-mean")
    assert m == {"actor/ppo_kl": pytest.approx(_mean((lp - old).abs(), mask))}  # verl's: the mean |log r|
    assert policy_loss_fn("gpg")(*_args(x), loss_agg_mode="token-mean")[1] == {}
    _, m = policy_loss_fn("geo_mean")(*_args(x), loss_agg_mode="token-mean")
    out = ((lp - old) > 0.2) | ((lp - old) < -0.2)
    assert m["actor/pg_clipfrac"] == pytest.approx(_mean(out.float() * (a > 0), mask))
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(_mean(out.float() * (a < 0), mask))


def test_gspo_gradient_is_the_sequence_ratio_times_the_token_score():
    # GSPO-token (arXiv:2507.18071 §4.3): ∇ of s_i,t = s_i·∇log π_θ(y_i,t); unclipped where s_i is in the band
    x = _inputs(empty_row=False)
    x["old"] = x["logp"].detach() - 0.01  # every s_i ≈ e^0.01, inside the clip band
    loss, _ = policy_loss_fn("gspo")(*_args(x), loss_agg_mode="token-mean")
    loss.backward()
    n = x["mask"].sum(-1, keepdim=True)
    s = math.exp(0.01)
    want = -x["adv"] * s * x["mask"] / n / B  # seq-mean-token-mean of −A·s_i,t
    torch.testing.assert_close(x["logp"].grad, want, rtol=1e-5, atol=1e-7)


def test_clip_cov_removes_the_gradient_of_high_covariance_tokens():
    x = _inputs()
    torch.manual_seed(0)
    wide = {"clip_cov_ratio": 1.0, "clip_cov_lb": -1e9, "clip_cov_ub": 1e9}  # every token PPO keeps is eligible
    loss, m = policy_loss_fn("clip_cov")(*_args(x), loss_agg_mode="token-sum", **wide)
    r = torch.exp(x["logp"].detach() - x["old"])
    by_ppo = ((-x["adv"] * r.clamp(0.8, 1.2)) > (-x["adv"] * r)).float()  # only what PPO clipped is left
    assert float(loss) == pytest.approx(float((-x["adv"] * r.clamp(0.8, 1.2) * by_ppo * x["mask"]).sum()), rel=1e-5)
    assert m["actor/pg_clipfrac"] == pytest.approx(_mean(1 - by_ppo, x["mask"]))
    base, _ = policy_loss_fn("clip_cov")(*_args(x), loss_agg_mode="token-sum", clip_cov_lb=1e8)  # none eligible
    ppo = agg_loss(REFERENCES["vanilla"](x), x["mask"], "token-sum")
    assert float(base) == pytest.approx(float(ppo), rel=1e-5)  # no dual clip in Clip-Cov; none bites here


def test_kl_cov_penalises_the_top_covariance_tokens():
    x = _inputs()
    lp, old, a, mask = x["logp"].detach(), x["old"], x["adv"], x["mask"]
    loss, _ = policy_loss_fn("kl_cov")(*_args(x), loss_agg_mode="token-sum", kl_cov_ratio=0.25, ppo_kl_coef=2.0)
    sel = mask.bool()
    cov = (a[sel] - a[sel].mean()) * (lp[sel] - lp[sel].mean())
    top = torch.zeros_like(cov, dtype=torch.bool)
    top[torch.topk(cov, int(len(cov) * 0.25)).indices] = True
    per = -a[sel] * torch.exp(lp[sel] - old[sel]) + 2.0 * (lp[sel] - old[sel]).abs() * top
    assert float(loss) == pytest.approx(float(per.sum()), rel=1e-5)


def test_rollout_is_weights_scale_the_token_loss():
    x = _inputs()
    w = torch.rand(B, R, generator=torch.Generator().manual_seed(3)) + 0.5
    loss, _ = policy_loss_fn("vanilla")(*_args(x), loss_agg_mode="token-mean", rollout_is_weights=w)
    assert float(loss) == pytest.approx(float(agg_loss(REFERENCES["vanilla"](x) * w, x["mask"])), rel=1e-5)


def test_bypass_mode_rejects_sequences_past_the_threshold():
    x = _inputs()
    opts = {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.02}
    loss, m = policy_loss_fn("bypass_mode")(*_args(x), loss_agg_mode="seq-mean-token-sum", **opts)
    lr = x["logp"].detach() - x["old"]
    k3 = (torch.exp(lr) - 1 - lr) * x["mask"]
    keep = ((k3.sum(-1) / x["mask"].sum(-1).clamp(min=1)) <= 0.02).float()[:, None]
    want = agg_loss(REFERENCES["vanilla"](x) * keep, x["mask"], "seq-mean-token-sum")  # counts stay the batch's
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(_mean(1 - keep.expand(B, R), x["mask"]))
    with pytest.raises(ValueError, match="rollout_is_batch_normalize"):
        policy_loss_fn("bypass_mode")(*_args(x), loss_agg_mode="token-mean", rollout_is_batch_normalize=True)


def test_options_take_verls_nested_sections_and_defaults():
    o = PolicyLossOptions.of({"policy_loss": {"dro_beta": 0.5, "rollout_correction": {"rollout_is": "sequence"}}})
    assert (o.dro_beta, o.rollout_is, o.low, o.high, o.clip_ratio_c, o.tau_pos, o.tau_neg) == \
        (0.5, "sequence", 0.2, 0.2, 3.0, 1.0, 1.05)
    with pytest.raises(ValueError, match="dro_beta"):
        policy_loss_fn("dro")(*_args(_inputs()), loss_agg_mode="token-mean")


# ----- aggregation ------------------------------------------------------------------------------------------
def test_seq_means_leave_fully_masked_rows_out_and_token_sum_sums():
    loss = torch.tensor([[1.0, 2.0, 9.0], [5.0, 5.0, 5.0], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert float(agg_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx((3 + 12) / 2)
    assert float(agg_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx((1.5 + 4) / 2)
    assert float(agg_loss(loss, mask, "seq-mean-token-sum-norm", 6)) == pytest.approx((3 / 6 + 12 / 6) / 2)
    assert float(agg_loss(loss, mask, "token-sum")) == pytest.approx(15.0)
    assert float(agg_loss(loss, mask, "token-mean")) == pytest.approx(3.0)
    for mode in LOSS_AGG_MODES:  # nothing to learn from: 0, not NaN
        assert float(agg_loss(loss, torch.zeros_like(mask), mode)) == 0.0


@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", [n for n in POLICY_LOSSES if n not in BATCH_WIDE])
def test_mini_batch_aggregate_is_the_sum_of_its_micro_batch_parts(name, mode, parts):
    """What the engine computes per micro-batch or DP replica (Σ w·ℓ / rows, w the mini-batch's weights,
    then the mean over equal parts) equals the loss over the whole mini-batch, value and gradient: the
    sequence-level losses (GSPO, GMPO) compute each row within the row."""
    x = _inputs(seed=1)
    pl = policy_loss_fn(name)
    full, _ = pl(*_args(x), loss_agg_mode=mode, **OPTIONS.get(name, {}))
    (grad_full,) = torch.autograd.grad(full, x["logp"])
    w = agg_weights(x["mask"], pl.aggregation(mode))
    o = PolicyLossOptions.of(OPTIONS.get(name, {}))
    size, total = B // parts, 0.0
    for k in range(parts):
        rows = slice(k * size, (k + 1) * size)
        m = pl.matrix(x["logp"][rows], x["old"][rows], x["adv"][rows], x["mask"][rows], None, o)
        total = total + (m.loss * w[rows]).sum() / size / parts
    (grad_parts,) = torch.autograd.grad(total, x["logp"])
    assert float(total) == pytest.approx(float(full), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad_parts, grad_full, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "geo_mean", "cispo"])
def test_actor_loss_on_micro_batches_is_the_registry_loss(name):
    """The training path (``mini_batches`` then ``losses.actor_loss`` per micro-batch) adds up to the
    registry's loss over the mini-batch, with the job's mode token-mean and GSPO's own seq-mean-token-mean."""
    x = _inputs(seed=2)
    logp = x["logp"].detach()
    rows = torch.arange(B)[:, None].expand(B, R + 1)  # each row's id in its tokens: the shuffle's order
    batch = TrainBatch(rows, torch.arange(R).repeat(B, 1), x["mask"], old_logp=x["old"], advantages=x["adv"])
    fn = losses.policy_loss(clip_low=0.2, clip_high=0.28, kl_loss_coef=0.0, kl_loss_type="k3", loss_mode=name)
    (mb,) = mini_batches(batch, 1, torch.Generator().manual_seed(0), "token-mean", None, fn.pg_agg_mode)
    out = logp[mb.tokens[:, 0]]  # the model's log-probs of the shuffled rows
    parts = [fn(out[i:i + 2], mb.select(slice(i, i + 2))) for i in range(0, B, 2)]
    got = sum(float(p.value) for p in parts) / len(parts)
    want, metrics = policy_loss_fn(name)(out, mb.old_logp, mb.advantages, mb.mask, loss_agg_mode="token-mean",
                                         clip_ratio_high=0.28)
    assert got == pytest.approx(float(want), rel=1e-5, abs=1e-7)
    tokens = sum(p.stats.tokens for p in parts)
    clipfrac = sum(p.stats.pg_clipfrac * p.stats.tokens for p in parts) / tokens
    assert clipfrac == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-6)


def test_a_loss_s_own_metrics_reach_the_step_metrics():
    """``bypass_mode``'s ``rollout_corr/*`` ride in ``ActorLossStats.metrics`` and come out of the step's
    ``actor/*`` figures as token-weighted means over micro-batches (``run.report``)."""
    from nereus.run.report import actor_update_metrics
    from nereus.run.training import MicroStats, ModelUpdate
    from nereus.spec.job import job_from_dict

    x = _inputs(seed=4)
    batch = TrainBatch(torch.arange(B)[:, None].expand(B, R + 1), torch.arange(R).repeat(B, 1), x["mask"],
                       old_logp=x["old"], advantages=x["adv"])
    fn = losses.policy_loss(clip_low=0.2, clip_high=0.2, kl_loss_coef=0.0, kl_loss_type="k3", loss_mode="bypass_mode",
                            loss_options={"rollout_rs": "token_k2", "rollout_rs_threshold": 0.01})
    (mb,) = mini_batches(batch, 1, torch.Generator().manual_seed(0), "token-mean")
    out = x["logp"].detach()[mb.tokens[:, 0]]
    parts = [fn(out[i:i + 4], mb.select(slice(i, i + 4))).stats for i in range(0, B, 4)]
    spec = {"models": {"actor": {"preset": "qwen2.5-0.5b"}, "reference": {"preset": "qwen2.5-0.5b"}},
            "algorithm": {"name": "grpo"}, "cluster": {"gpu": "H100", "nodes": 1, "gpus_per_node": 4},
            "workload": {"prompts_per_step": 4, "prompt_length": 8, "response_length": {"mean": 3, "max": 4}},
            "run": {}}
    m = actor_update_metrics(job_from_dict(spec), 0, ModelUpdate([MicroStats(0, s) for s in parts]))
    _, whole = policy_loss_fn("bypass_mode")(out, mb.old_logp, mb.advantages, mb.mask, loss_agg_mode="token-mean",
                                             rollout_rs="token_k2", rollout_rs_threshold=0.01)
    name = "rollout_corr/rollout_rs_masked_fraction"
    assert 0 < m[name] < 1 and m[name] == pytest.approx(whole[name], abs=1e-6)
