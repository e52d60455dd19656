"""Every advantage estimator against a plain reference written from its paper's formula: loops over rows,
groups and tokens in float64, on random batches with groups of several sizes (one of them alone), groups
that are not contiguous, and padded responses."""

from __future__ import annotations

import math
import random

import pytest
import torch

from nereus.rl.core import ADVANTAGE_ESTIMATOR_FNS, AdvantageInputs, advantage_estimator
from nereus.rl.token_baseline import optimal_token_baseline_estimator
from nereus.spec import SpecError, job_from_dict
from nereus.spec.algorithms import ADVANTAGE_ESTIMATORS, NEEDS_GROUPS

WIDTH = 7
SIZES = (4, 3, 1, 2, 5)  # responses per group; the third group has one response


def _batch(seed: int, sizes: tuple[int, ...] = SIZES, kl: bool = False, holes: bool = False,
           **kw) -> AdvantageInputs:
    """Random scores, lengths 1..WIDTH (so most rows are padded), groups shuffled across rows."""
    gen = torch.Generator().manual_seed(seed)
    groups = torch.tensor([g for g, n in enumerate(sizes) for _ in range(n)])[torch.randperm(sum(sizes), generator=gen)]
    rows = len(groups)
    lengths = torch.randint(1, WIDTH + 1, (rows,), generator=gen)
    mask = (torch.arange(WIDTH)[None, :] < lengths[:, None]).float()
    if holes:  # multi-turn: a tool's output inside the response is not the policy's
        mask[:, 2] = 0.0
    old_logp = -torch.rand(rows, WIDTH, generator=gen) * 3
    extra = {"ref_logp": old_logp + 0.3 * torch.randn(rows, WIDTH, generator=gen), "kl_coef": 0.05} if kl else {}
    base = {"scores": torch.randn(rows, generator=gen), "mask": mask, "groups": groups, "old_logp": old_logp,
            "values": torch.randn(rows, WIDTH, generator=gen), "gamma": 0.9, "lam": 0.95,
            "baseline_scores": torch.randn(rows, generator=gen),
            "sum_pi_squared": torch.rand(rows, WIDTH, generator=gen) * 0.5 + 0.2}
    return AdvantageInputs(**{**base, **extra, **kw})


# ----- plain references ----------------------------------------------------------------------------------

def _positions(x: AdvantageInputs, i: int) -> list[int]:
    return [t for t in range(x.mask.shape[1]) if x.mask[i, t] > 0]


def _token_rewards(x: AdvantageInputs) -> list[list[float]]:
    """r_t: the score on the response's last token; minus kl_coef·(log π − log π_ref) on each token (k1)."""
    out = []
    for i in range(len(x.scores)):
        row = [0.0] * x.mask.shape[1]
        pos = _positions(x, i)
        if pos:  # an empty response has no token to carry its score
            row[pos[-1]] = float(x.scores[i])
        if x.ref_logp is not None and x.kl_coef:
            for t in pos:
                row[t] -= x.kl_coef * float(x.old_logp[i, t] - x.ref_logp[i, t])
        out.append(row)
    return out


def _scores(x: AdvantageInputs) -> list[float]:
    return [sum(r) for r in _token_rewards(x)]


def _members(x: AdvantageInputs) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, g in enumerate(x.groups.tolist()):
        out.setdefault(g, []).append(i)
    return out


def _mean(v: list[float]) -> float:
    return sum(v) / len(v)


def _std(v: list[float]) -> float:  # unbiased
    m = _mean(v)
    return math.sqrt(sum((a - m) ** 2 for a in v) / (len(v) - 1))


def _broadcast(x: AdvantageInputs, per_row: list[float]) -> torch.Tensor:
    return torch.tensor([[per_row[i] * float(x.mask[i, t]) for t in range(x.mask.shape[1])]
                         for i in range(len(per_row))], dtype=torch.float64)


def _whiten(x: AdvantageInputs, values: torch.Tensor) -> torch.Tensor:
    """(v − mean) / sqrt(unbiased var + 1e-8) over every response token of the batch; padding 0."""
    real = [float(values[i, t]) for i in range(len(values)) for t in _positions(x, i)]
    m, var = _mean(real), _std(real) ** 2
    return (values - m) / math.sqrt(var + 1e-8) * x.mask.double()


def _check(out: dict[str, torch.Tensor], adv: torch.Tensor, returns: torch.Tensor | None = None) -> None:
    torch.testing.assert_close(out["adv"].double(), adv, atol=2e-5, rtol=1e-5)
    if returns is not None:
        torch.testing.assert_close(out["returns"].double(), returns, atol=2e-5, rtol=1e-5)


# ----- the registry ---------------------------------------------------------------------------------------

def test_the_registry_holds_every_verl_estimator_under_its_name():
    assert tuple(ADVANTAGE_ESTIMATOR_FNS) == ADVANTAGE_ESTIMATORS
    assert set(ADVANTAGE_ESTIMATORS) == {
        "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "gpg",
        "grpo_passk", "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline", "grpo_vectorized",
        "rloo_vectorized"}


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS)
def test_every_estimator_keeps_padding_at_zero(name):
    x = _batch(0, sizes=(4, 3, 2, 5) if name == "grpo_passk" else SIZES, kl=True)
    out = advantage_estimator(name)(x)
    assert out["adv"].shape == out["returns"].shape == x.mask.shape
    assert torch.all(out["adv"][x.mask == 0] == 0)
    assert torch.isfinite(out["adv"]).all()


# ----- group-normalised outcome estimators ----------------------------------------------------------------

@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("kl", [False, True])
def test_grpo(norm, kl):
    # Shao et al. 2024: (s − mean_g) / (std_g + 1e-6); a group of one has mean 0 and std 1
    x = _batch(1, kl=kl, norm_adv_by_std=norm)
    s, per = _scores(x), [0.0] * len(x.scores)
    for rows in _members(x).values():
        v = [s[i] for i in rows]
        mean, std = (0.0, 1.0) if len(v) == 1 else (_mean(v), _std(v))
        for i in rows:
            per[i] = (s[i] - mean) / (std + 1e-6) if norm else s[i] - mean
    for name in ("grpo", "grpo_vectorized"):
        _check(advantage_estimator(name)(x), _broadcast(x, per))


def test_grpo_vectorized_gives_zero_to_a_group_of_equal_scores():
    x = _batch(2, sizes=(3, 2))
    x = AdvantageInputs(**{**x.__dict__, "scores": torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1])})
    for name in ("grpo", "grpo_vectorized"):
        assert advantage_estimator(name)(x)["adv"].abs().max() < 1e-4


@pytest.mark.parametrize("kl", [False, True])
def test_rloo(kl):
    # Ahmadian et al. 2024: s_i minus the mean of the other responses to the same prompt
    x = _batch(3, kl=kl)
    s, per, per_vec = _scores(x), [0.0] * len(x.scores), [0.0] * len(x.scores)
    for rows in _members(x).values():
        for i in rows:
            others = [s[j] for j in rows if j != i]
            per[i] = s[i] - _mean(others) if others else s[i]  # verl's rloo keeps a lone score
            per_vec[i] = s[i] - _mean(others) if others else 0.0  # verl's rloo_vectorized zeroes it
    _check(advantage_estimator("rloo")(x), _broadcast(x, per))
    _check(advantage_estimator("rloo_vectorized")(x), _broadcast(x, per_vec))


def test_opo_baseline_is_the_length_weighted_group_mean():
    x = _batch(4)
    s, per = _scores(x), [0.0] * len(x.scores)
    for rows in _members(x).values():
        lengths = [len(_positions(x, i)) for i in rows]
        b = sum(n * s[i] for n, i in zip(lengths, rows, strict=True)) / sum(lengths) if len(rows) > 1 else 0.0
        for i in rows:
            per[i] = s[i] - b
    _check(advantage_estimator("opo")(x), _broadcast(x, per))


def test_gpg_scales_the_centred_score_by_the_batch_over_the_non_zero_scores():
    x = _batch(5)
    x = AdvantageInputs(**{**x.__dict__, "scores": x.scores * (torch.arange(len(x.scores)) % 3 != 0)})
    s = _scores(x)
    alpha = len(s) / sum(1 for v in s if v != 0)
    per = [0.0] * len(s)
    for rows in _members(x).values():
        mean = _mean([s[i] for i in rows]) if len(rows) > 1 else 0.0
        for i in rows:
            per[i] = alpha * (s[i] - mean)
    _check(advantage_estimator("gpg")(x), _broadcast(x, per))


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_credits_only_the_best_response_with_its_margin(norm):
    x = _batch(6, sizes=(4, 3, 2, 5), norm_adv_by_std=norm)
    s, per = _scores(x), [0.0] * len(x.scores)
    for rows in _members(x).values():
        ranked = sorted(rows, key=lambda i: s[i], reverse=True)
        margin = s[ranked[0]] - s[ranked[1]]
        per[ranked[0]] = margin / (_std([s[i] for i in rows]) + 1e-6) if norm else margin
    _check(advantage_estimator("grpo_passk")(x), _broadcast(x, per))
    with pytest.raises(ValueError, match="at least 2 responses"):
        advantage_estimator("grpo_passk")(_batch(6))


def _grpo_per_row(x: AdvantageInputs, s: list[float]) -> list[float]:
    per = [0.0] * len(s)
    for rows in _members(x).values():
        v = [s[i] for i in rows]
        mean, std = (0.0, 1.0) if len(v) == 1 else (_mean(v), _std(v))
        for i in rows:
            per[i] = (s[i] - mean) / (std + 1e-6)
    return per


def test_gdpo_normalises_each_component_in_its_group_then_whitens_the_weighted_sum():
    x = _batch(7)
    gen = torch.Generator().manual_seed(70)
    parts = {"accuracy": torch.randint(0, 2, (len(x.scores),), generator=gen).float(),
             "format": torch.rand(len(x.scores), generator=gen)}
    weights = {"accuracy": 1.0, "format": 0.5}
    y = AdvantageInputs(**{**x.__dict__, "score_components": parts, "score_weights": weights})
    total = [0.0] * len(x.scores)
    for name, comp in parts.items():
        for i, a in enumerate(_grpo_per_row(x, comp.tolist())):
            total[i] += weights[name] * a
    _check(advantage_estimator("gdpo")(y), _whiten(x, _broadcast(x, total)))
    # without components the one component is the summed token rewards
    _check(advantage_estimator("gdpo")(x), _whiten(x, _broadcast(x, _grpo_per_row(x, _scores(x)))))


# ----- token-level returns ---------------------------------------------------------------------------------

def _discounted_returns(x: AdvantageInputs, gamma: float) -> torch.Tensor:
    r, out = _token_rewards(x), torch.zeros(x.mask.shape, dtype=torch.float64)
    for i in range(len(r)):
        pos = _positions(x, i)
        for k, t in enumerate(pos):
            out[i, t] = sum(gamma ** (n - k) * r[i][pos[n]] for n in range(k, len(pos)))
    return out


@pytest.mark.parametrize("kl", [False, True])
def test_reinforce_plus_plus_whitens_the_discounted_return_over_the_batch(kl):
    # Hu 2025: G_t = Σ_{l ≥ t} γ^{l−t} r_l, whitened over every response token
    x = _batch(8, kl=kl)
    returns = _discounted_returns(x, x.gamma)
    _check(advantage_estimator("reinforce_plus_plus")(x), _whiten(x, returns), returns)


def test_reinforce_plus_plus_baseline():
    x = _batch(9, kl=True)
    s, per = _scores(x), [0.0] * len(x.scores)
    for rows in _members(x).values():
        mean = _mean([s[i] for i in rows]) if len(rows) > 1 else 0.0
        for i in rows:
            per[i] = s[i] - mean
    _check(advantage_estimator("reinforce_plus_plus_baseline")(x), _whiten(x, _broadcast(x, per)))


def test_remax_subtracts_the_greedy_score_from_the_reward_to_go():
    x = _batch(10, kl=True)
    returns = _discounted_returns(x, 1.0)
    adv = returns - x.baseline_scores.double()[:, None] * x.mask.double()
    _check(advantage_estimator("remax")(x), adv, returns)
    with pytest.raises(ValueError, match="baseline_scores"):
        advantage_estimator("remax")(AdvantageInputs(**{**x.__dict__, "baseline_scores": None}))


# ----- optimal token baseline -------------------------------------------------------------------------------

def _otb_reference(x: AdvantageInputs, zero_tail: bool, skip_empty: bool = False) -> torch.Tensor:
    """Per group, with responses aligned by their k-th own token: B_k = Σ_i G·W / Σ_i W over the responses
    that have a k-th token, W_k = Σ_{j ≤ k} (1 − 2π_j + Σπ²_j)·ρ_j²; a group of one has no baseline."""
    returns = _discounted_returns(x, 1.0)
    adv = torch.zeros(x.mask.shape, dtype=torch.float64)
    for rows in _members(x).values():
        rows = [i for i in rows if _positions(x, i) or not skip_empty]
        pos = {i: _positions(x, i) for i in rows}
        energy = {}
        for i in rows:
            acc, energy[i] = 0.0, []
            for t in pos[i]:
                rho = 1.0 if x.rollout_is_weights is None else float(x.rollout_is_weights[i, t])
                acc += (1 - 2 * math.exp(float(x.old_logp[i, t])) + float(x.sum_pi_squared[i, t])) * rho**2
                energy[i].append(acc)
        lengths = sorted(len(pos[i]) for i in rows)
        for i in rows:
            for k, t in enumerate(pos[i]):
                present = [j for j in rows if len(pos[j]) > k]
                b = (sum(float(returns[j, pos[j][k]]) * energy[j][k] for j in present)
                     / (sum(energy[j][k] for j in present) + 1e-8)) if len(rows) > 1 else 0.0
                alone_at_tail = len(rows) > 1 and lengths[-1] > lengths[-2] and k >= lengths[-2]
                adv[i, t] = float(returns[i, t]) - (0.0 if zero_tail and alone_at_tail else b)
    return adv


@pytest.mark.parametrize("is_weights", [False, True])
def test_optimal_token_baseline(is_weights):
    x = _batch(11, kl=True)
    if is_weights:
        x = AdvantageInputs(**{**x.__dict__, "rollout_is_weights": torch.rand(x.mask.shape) + 0.5})
    _check(advantage_estimator("optimal_token_baseline")(x), _otb_reference(x, False), _discounted_returns(x, 1.0))
    # responses without holes: the multi-turn variant differs only by its zero-tail default
    _check(advantage_estimator("tir_optimal_token_baseline")(x), _otb_reference(x, True))
    _check(optimal_token_baseline_estimator(x, zero_tail=True), _otb_reference(x, True))
    with pytest.raises(ValueError, match="sum_pi_squared"):
        advantage_estimator("optimal_token_baseline")(AdvantageInputs(**{**x.__dict__, "sum_pi_squared": None}))


def test_tir_optimal_token_baseline_aligns_responses_by_their_own_tokens():
    x = _batch(12, holes=True)
    x.mask[0] = 0.0  # an empty response takes no part in its group
    _check(advantage_estimator("tir_optimal_token_baseline")(x), _otb_reference(x, True, skip_empty=True))


def test_estimators_do_not_depend_on_the_order_of_rows():
    x = _batch(13, kl=True)
    perm = torch.tensor(random.Random(0).sample(range(len(x.scores)), len(x.scores)))
    y = AdvantageInputs(**{k: (v[perm] if isinstance(v, torch.Tensor) else v) for k, v in x.__dict__.items()})
    for name in ADVANTAGE_ESTIMATORS:
        if name != "grpo_passk":
            torch.testing.assert_close(advantage_estimator(name)(y)["adv"], advantage_estimator(name)(x)["adv"][perm])


def test_group_estimators_need_two_samples_per_prompt():
    assert {"grpo", "rloo", "opo", "gpg", "grpo_passk", "gdpo", "optimal_token_baseline"} <= set(NEEDS_GROUPS)


# ----- the spec ----------------------------------------------------------------------------------------------

def _spec(estimator: str, samples: int = 2, **algorithm) -> dict:
    models = ("actor", "critic", "reference") if estimator == "gae" else ("actor", "reference")
    return {"models": {m: {"preset": "qwen2.5-0.5b"} for m in models},
            "algorithm": {"name": "ppo" if estimator == "gae" else "grpo", "adv_estimator": estimator,
                          "samples_per_prompt": samples, **algorithm},
            "workload": {"prompts_per_step": 4, "prompt_length": 8, "response_length": {"mean": 3, "max": 4}},
            "cluster": {"gpu": "H100", "nodes": 1, "gpus_per_node": 4}}


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS)
def test_the_spec_accepts_every_estimator_under_its_verl_name(name):
    assert job_from_dict(_spec(name)).algorithm.adv_estimator == name


def test_the_spec_refuses_what_an_estimator_cannot_compute():
    with pytest.raises(SpecError, match=r"^algorithm\.adv_estimator: 'vtrace' is not allowed; choose one of \['gae', "
                                        r"'grpo', 'reinforce_plus_plus', .*'gdpo'\]$"):
        job_from_dict(_spec("vtrace"))
    with pytest.raises(SpecError, match=r"algorithm\.samples_per_prompt: rloo \(algorithm\.adv_estimator\) compares "
                                        r"each response with the others"):
        job_from_dict(_spec("rloo", samples=1))
    assert job_from_dict(_spec("reinforce_plus_plus", samples=1)).algorithm.samples_per_prompt == 1
    assert job_from_dict(_spec("remax", samples=1)).algorithm.samples_per_prompt == 1
    with pytest.raises(SpecError, match=r"algorithm\.recompute_old_log_prob: optimal_token_baseline reads Σπ²"):
        job_from_dict(_spec("optimal_token_baseline", recompute_old_log_prob=False))
