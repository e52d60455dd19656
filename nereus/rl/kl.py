"""Per-token estimators of KL(π‖π_ref) from samples of π (Schulman 2020, "Approximating KL Divergence"),
functions of the log-ratio log r = log π − log π_ref, under the canonical names of
``nereus.spec.algorithms.KL_ESTIMATOR_NAMES``; verl's spellings are aliases (``KL_ALIASES``)."""

from __future__ import annotations

import torch

from nereus.rl.registry import name_table
from nereus.spec.algorithms import KL_ALIASES, KL_ESTIMATOR_NAMES


def kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    """log r: unbiased, but negative on some tokens."""
    return log_ratio


def kl_k2(log_ratio: torch.Tensor) -> torch.Tensor:
    """½(log r)²: biased, low variance, never negative."""
    return 0.5 * log_ratio**2


def kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """(1/r − 1) + log r: unbiased and never negative (GRPO's KL loss, Shao et al. 2024 eq. 4). As verl's
    ``low_var_kl``, log r is clamped to [−20, 20] before the exponential and the result to [−10, 10], so
    one outlier token cannot dominate."""
    lr = log_ratio.clamp(-20, 20)
    return (torch.exp(-lr) - 1 + lr).clamp(-10, 10)


def kl_abs(log_ratio: torch.Tensor) -> torch.Tensor:
    """|log r| (verl's ``abs``): biased, never negative."""
    return log_ratio.abs()


KL_ESTIMATORS = name_table(KL_ESTIMATOR_NAMES, {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3, "abs": kl_abs})


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) from samples of π (Schulman 2020) with r = π/π_ref, by the
    estimator ``kind`` names: a canonical name or a verl spelling (``kl``, ``mse``, ``low_var_kl``;
    ``nereus.spec.algorithms.KL_ALIASES``)."""
    if kind not in KL_ALIASES:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {list(KL_ALIASES)}")
    return KL_ESTIMATORS[KL_ALIASES[kind]](logp - ref_logp)
