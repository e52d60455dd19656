"""The rows a training step runs on, as named tensors: what a loss function reads (``rl.losses``).

Every rank of a layout receives the whole ``TrainBatch``; ``ShardedModel.micro_batches`` cuts it to the
replica's rows and then into micro-batches with ``select``, every tensor along its first dimension. Only
``tokens`` is always there: the rest is what one loss or another reads, None where the step has no such
tensor (a critic's batch holds no advantages, an actor's no returns).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass(frozen=True)
class TrainBatch:
    """A training step's rows. Per-token tensors are in the response frame [B, R] of ``index`` (the RL
    step's), or whatever frame the loss that reads them uses (the tests' losses read [B, T] ones)."""

    tokens: torch.Tensor  # [B, T] long: the packed sequences the model runs on
    index: torch.Tensor | None = None  # [B, R] long: the log-prob position whose next token is response token j
    mask: torch.Tensor | None = None  # [B, R]: 1 on the response's real tokens
    weight: torch.Tensor | None = None  # [B, R]: the mini-batch's loss_agg_mode weights (rl.core.agg_weights)
    # [B, R]: the policy term's weights where its loss fixes its own aggregation (GSPO's seq-mean-token-mean,
    # rl.policy_losses); None: ``weight``
    pg_weight: torch.Tensor | None = None
    advantages: torch.Tensor | None = None  # [B, R]
    returns: torch.Tensor | None = None  # [B, R]: the critic's targets
    old_values: torch.Tensor | None = None  # [B, R]: the critic's values before the update (value clipping)
    old_logp: torch.Tensor | None = None  # [B, R]: the log-probs of the policy that sampled (π_old)
    ref_logp: torch.Tensor | None = None  # [B, R]: the reference's log-probs (a KL loss)
    is_weight: torch.Tensor | None = None  # [B, R]: π_old / π_rollout per token (run.async, rl.offpolicy)
    entropy: torch.Tensor | None = None  # [b, T−1]: set by the engine for a loss that needs_entropy
    # [B] long: each row's real tokens (``tokens`` is right-padded past them); None: every row is T long.
    # A packing layout runs only these (``parallel.packing``)
    lengths: torch.Tensor | None = None
    # [B, T, sparse layers, k] int16: the experts generation routed each position to (router replay,
    # ``model.routes``); None: the forward routes with its own router
    routes: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, rows: slice | torch.Tensor) -> TrainBatch:
        """The same tensors cut to ``rows`` (a slice or an index tensor) along the batch."""
        return replace(self, **{f.name: getattr(self, f.name)[rows] for f in fields(self)
                                if getattr(self, f.name) is not None})

    def to(self, device: torch.device | str) -> TrainBatch:
        """Every tensor on ``device``."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if getattr(self, f.name) is not None})
