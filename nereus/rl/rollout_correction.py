"""verl's rollout correction as ``bypass_mode`` computes it inside the loss (verl docs/algo/rollout_corr.md,
verl/trainer/ppo/rollout_corr_helper.py): importance weights w = π_θ/π_rollout, truncated (TIS, Yao et al.
2025, https://fengyao.notion.site/off-policy-rl) or zeroed outside a band (IcePop), and rejection of
tokens or whole sequences whose divergence estimate (Schulman 2020's k1, k2, k3 of log w) passes a
threshold. Every quantity is per token or per row, so it is the same under any split of the rows.
"""

from __future__ import annotations

import math

import torch

from nereus.rl.offpolicy import LOG_BOUND, raw_weights
from nereus.rl.policy_loss_types import PolicyLossOptions

RS_STATS = ("k1", "k2", "k3")
RS_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")


def _band(spec: float | str, k1: bool, what: str) -> tuple[float | None, float]:
    """(lower, upper) from verl's threshold spelling: a number (the upper bound) or ``"lower_upper"``; a k1
    rejection bound without a lower one gets 1/upper, as verl's."""
    text = str(spec).strip()
    lower_text, _, upper_text = text.rpartition("_")
    try:
        upper = float(upper_text)
        lower = float(lower_text) if lower_text else (1.0 / upper if k1 else None)
    except ValueError:
        raise ValueError(f"{what}: {spec!r} is not a number or 'lower_upper'") from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"{what}: {spec!r} needs 0 < lower <= upper")
    return lower, upper


def is_weights(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str,
               threshold: float | str) -> torch.Tensor:
    """w = π_θ/π_rollout per token (``token``) or the product over the row on each token (``sequence``), log
    bounded to ±20, 0 on padding: clamped at the threshold (TIS), or with ``"lower_upper"`` zero outside
    [lower, upper] (IcePop). No gradient."""
    if level not in ("token", "sequence"):
        raise ValueError(f"rollout_is must be 'token', 'sequence' or None, got {level!r}")
    lower, upper = _band(threshold, False, "rollout_is_threshold")
    with torch.no_grad():
        w = raw_weights(logp, rollout_logp, mask, level) * mask
        if lower is None:
            return w.clamp(max=upper)
        return torch.where((w >= lower) & (w <= upper), w, torch.zeros_like(w))


def _row_stat(values: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    if level == "seq_sum":
        return (values * mask).sum(-1)
    if level == "seq_mean":
        return (values * mask).sum(-1) / (mask.sum(-1) + 1e-8)
    top = values.masked_fill(mask <= 0, float("-inf")).max(-1).values
    return torch.where(torch.isinf(top), torch.zeros_like(top), top)


def rejection_keep(log_ratio: torch.Tensor, mask: torch.Tensor, options: str,
                   thresholds: float | str | None) -> torch.Tensor:
    """1 where a token passes every comma-separated ``rollout_rs`` option (``token_k1``..., ``seq_sum_k*``,
    ``seq_mean_k*``, ``seq_max_k2``/``k3``), 0 where one rejects it. With r = π_θ/π_rollout: k1 = −log r
    must lie in [log lower, log upper]; k2 = ½(log r)² and k3 = r − 1 − log r at most the upper bound.
    ``thresholds``: one for all options or one per option, comma-separated."""
    names = list(dict.fromkeys(part.strip() for part in options.split(",") if part.strip()))
    if thresholds is None:
        raise ValueError("rollout_rs needs rollout_rs_threshold")
    specs = [part.strip() for part in str(thresholds).split(",") if part.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_rs_threshold: give one threshold or {len(names)}, got {thresholds!r}")
    lr = log_ratio.clamp(-LOG_BOUND, LOG_BOUND)
    stats = {"k1": -lr, "k2": 0.5 * lr**2, "k3": torch.exp(lr) - 1.0 - lr}
    keep = torch.ones_like(mask)
    for name, spec in zip(names, specs * len(names) if len(specs) == 1 else specs, strict=False):
        level, _, stat = name.rpartition("_")
        if level not in RS_LEVELS or stat not in RS_STATS or name == "seq_max_k1":
            raise ValueError(f"rollout_rs: unknown option {name!r}")
        lower, upper = _band(spec, stat == "k1", f"rollout_rs_threshold of {name}")
        values = stats[stat] if level == "token" else _row_stat(stats[stat], mask, level).unsqueeze(-1)
        if stat == "k1":
            ok = (values >= math.log(lower)) & (values <= math.log(upper))
        else:
            ok = values <= upper
        keep = keep * ok.expand_as(mask).to(mask.dtype)
    return keep


def bypass_correction(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                      o: PolicyLossOptions) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """(IS weights or None without ``rollout_is``, the kept-token mask, per-token metrics under verl's
    ``rollout_corr/*`` names). Normalising the weights to mean 1 over the batch needs the whole batch's
    weights before any micro-batch's loss, so ``rollout_is_batch_normalize`` is refused."""
    if o.rollout_is_batch_normalize:
        raise ValueError("rollout_is_batch_normalize is not supported: the weights' batch mean would differ "
                         "between micro-batches; leave it false")
    with torch.no_grad():
        weights = None if o.rollout_is is None else is_weights(logp, rollout_logp, mask, o.rollout_is,
                                                                o.rollout_is_threshold)
        keep = torch.ones_like(mask)
        if o.rollout_rs is not None:
            keep = rejection_keep(logp - rollout_logp, mask, o.rollout_rs, o.rollout_rs_threshold)
        extra = {"rollout_corr/rollout_rs_masked_fraction": 1.0 - keep,
                 "rollout_corr/kl": rollout_logp - logp}
        if weights is not None:
            extra["rollout_corr/rollout_is_mean"] = weights
    return weights, keep, extra
