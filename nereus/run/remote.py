"""Functions that run on the workers through ``Runtime.apply``: read a layout's shards (checkpoints), read
and write the Adam state, and the PPO/GRPO losses with their statistics. Weights move between layouts
through the live transition executor (``Runtime.sync_weights``, ``Runtime.transition``), not through here.
"""

from __future__ import annotations

import torch

from nereus.rl.core import clipped_policy_loss, clipped_value_loss, kl_estimate, masked_mean
from nereus.runtime.engine import ShardedModel, shard_boxes

# Per-micro-batch loss statistics, appended by the loss functions on the worker and drained by the driver.
_STATS: list[dict[str, float]] = []


def read_shards(sm: ShardedModel) -> dict[str, tuple[tuple, torch.Tensor]] | None:
    """name → (global box, local tensor) on DP replica 0 (other replicas hold copies), else None."""
    if sm.groups.coords.dp != 0:
        return None
    boxes = shard_boxes(sm.cfg, sm.groups)
    return {k: (tuple(boxes[k]), v.detach().clone()) for k, v in sm.shards().items()}


def assemble(parts: list[dict | None]) -> dict[str, torch.Tensor]:
    """Whole tensors from the boxes of ``read_shards`` (every element covered once per replica)."""
    shapes: dict[str, list[int]] = {}
    for part in filter(None, parts):
        for name, (box, _) in part.items():
            shape = shapes.setdefault(name, [0] * len(box))
            for d, (_, hi) in enumerate(box):
                shape[d] = max(shape[d], hi)
    full = {name: torch.empty(shape) for name, shape in shapes.items()}
    for part in filter(None, parts):
        for name, (box, t) in part.items():
            full[name][tuple(slice(lo, hi) for lo, hi in box)] = t
    return full


def read_optimizer(sm: ShardedModel) -> dict[str, torch.Tensor] | None:
    """This rank's Adam state (fp32 master range of the flat buffer, moments, step count), or None before
    the first step."""
    opt = sm.optimizer
    moments = opt.moments() if opt is not None else None
    if moments is None:
        return None
    avg, sq, step = moments
    cat = lambda ts: torch.cat(ts) if ts else torch.zeros(0)  # noqa: E731
    return {"master": opt.flat_master().clone(), "exp_avg": cat(avg), "exp_avg_sq": cat(sq),
            "step": torch.tensor([step])}


@torch.no_grad()
def write_optimizer(sm: ShardedModel, state: dict[str, torch.Tensor], lr: float) -> bool:
    """Restore what ``read_optimizer`` returned on the same rank of the same layout."""
    opt = sm.optimizer or sm.make_optimizer(lr, init_master=False)
    if state["master"].numel() != opt.hi - opt.lo:
        raise ValueError(f"optimizer shard of {tuple(state['master'].shape)} does not fit this layout's "
                         f"{opt.hi - opt.lo} elements: resume under the layout the checkpoint was written with")
    sizes = [b - a for _, a, b in opt.segments]
    split = lambda t: [x.clone() for x in torch.split(t.float(), sizes)]  # noqa: E731
    opt.install_state(split(state["master"]), split(state["exp_avg"]), split(state["exp_avg_sq"]),
                      float(state["step"][0]))
    return True


def drain_stats(sm: ShardedModel) -> list[dict[str, float]] | None:
    """The loss statistics recorded since the last drain, from the output rank (TP rank 0, last stage)."""
    out = list(_STATS)
    _STATS.clear()
    return out if sm.is_output_rank else None


def drain_grad_norms(sm: ShardedModel) -> list[float] | None:
    """The global gradient norms (before clipping) of the steps since the last drain, from the output rank
    (every rank computed the same ones)."""
    out, sm.grad_norms = list(sm.grad_norms), []
    return out if sm.is_output_rank else None


def _response(out: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per response token [b, R] from the model's per-position output (log-probs [b, T−1] or values
    [b, T]) at the batch's ``index`` positions."""
    return out.gather(1, mb["index"])


def actor_loss(out: torch.Tensor, mb: dict[str, torch.Tensor], clip_low: float, clip_high: float | None,
               kl_loss_coef: float, kl_loss_type: str) -> torch.Tensor:
    """PPO clipped surrogate (Schulman et al. 2017) plus, for GRPO, β·KL(π‖π_ref) as a loss (Shao et al.
    2024, eq. 3). ``mb["weight"]`` is mask · (mini-batch rows / mini-batch response tokens), so summing
    weight·loss over rows and dividing by the micro-batch's rows gives, after the engine's mean over
    micro-batches and replicas, the token mean over the whole mini-batch under any layout."""
    logp, mask, weight = _response(out, mb), mb["mask"], mb["weight"]
    pg, clipped = clipped_policy_loss(logp, mb["old_logp"], mb["adv"], clip_low, clip_high)
    loss = pg
    kl = torch.zeros_like(pg)
    if kl_loss_coef and "ref_logp" in mb:
        kl = kl_estimate(logp, mb["ref_logp"], kl_loss_type)
        loss = pg + kl_loss_coef * kl
    with torch.no_grad():
        n = float(mask.sum())
        _STATS.append({"tokens": n, "pg_loss": float(masked_mean(pg, mask)),
                       "pg_clipfrac": float(masked_mean(clipped, mask)),
                       "ppo_kl": float(masked_mean(mb["old_logp"] - logp, mask)),
                       "kl_loss": float(masked_mean(kl, mask))})
    return (loss * weight).sum() / len(logp)


def critic_loss(out: torch.Tensor, mb: dict[str, torch.Tensor], clip: float) -> torch.Tensor:
    """Clipped value loss towards the GAE returns, token mean over the mini-batch (as ``actor_loss``)."""
    values, mask = _response(out, mb), mb["mask"]
    loss, clipped = clipped_value_loss(values, mb["old_values"], mb["returns"], clip)
    with torch.no_grad():
        _STATS.append({"tokens": float(mask.sum()), "vf_loss": float(masked_mean(loss, mask)),
                       "vf_clipfrac": float(masked_mean(clipped, mask))})
    return (loss * mb["weight"]).sum() / len(values)
