"""The sampling side of DAPO (Yu et al. 2025, arXiv:2503.14476) as pure functions: overlong reward shaping
(eq. 13), the group filter of dynamic sampling (Sec. 3.2, eq. 11's constraint 0 < |{o_i correct}| < G) and
the rule that decides whether a step generates another batch. ``run.dynamic_sampling`` drives them;
``spec.run_dapo`` reads their keys."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nereus.spec.errors import RuntimeFailure


def overlong_penalty(response_len: torch.Tensor, max_len: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """DAPO eq. 13, the soft overlong punishment of each response of ``response_len`` tokens (EOS counted,
    as verl counts the response's attention mask), with L_max = ``max_len`` and L_cache = ``buffer_len``:
    0 up to L_max − L_cache tokens, then ((L_max − L_cache) − |y|) / L_cache × ``penalty_factor`` (linear
    from 0 down to −penalty_factor at L_max), and −penalty_factor beyond L_max. Added to the score."""
    if buffer_len < 1:
        raise ValueError(f"buffer_len must be at least 1, got {buffer_len}")
    over = (response_len.double() - (max_len - buffer_len)) / buffer_len
    return -(over.clamp(min=0.0, max=1.0) * penalty_factor).to(torch.float32)


def filter_metric(metric: str, score: torch.Tensor, rule: torch.Tensor | None) -> torch.Tensor:
    """Each response's value of verl's filter ``metric`` [B]: ``acc`` whether the rule reward counts it
    right (> 0: the built-in tasks score 1/0, DAPO's math scorer +1/−1); ``score``, ``seq_reward`` and
    ``seq_final_reward`` the score the advantages read (one value on the last token, so its sequence sum;
    without an in-reward KL penalty the final reward is the same)."""
    if metric == "acc":
        if rule is None:
            raise ValueError("the 'acc' filter metric needs the rule reward (run.rule_reward is none)")
        return (rule > 0).to(torch.float32)
    if metric in ("score", "seq_reward", "seq_final_reward"):
        return score.to(torch.float32)
    raise ValueError(f"unknown filter metric {metric!r}")


def kept_groups(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which groups of ``group_size`` consecutive rows keep a learning signal [B / group_size] bool: those
    whose ``values`` are not all equal (standard deviation > 0, as verl's filter). A group whose responses
    all score alike has zero group-relative advantage (GRPO, arXiv:2402.03300 eq. 3), so DAPO drops it. A
    group of one response is always kept (verl's rule; its spread is undefined)."""
    if values.numel() % group_size:
        raise ValueError(f"{values.numel()} rows are not whole groups of {group_size}")
    groups = values.reshape(-1, group_size)
    if group_size == 1:
        return torch.ones(groups.shape[0], dtype=torch.bool)
    return groups.amax(dim=1) > groups.amin(dim=1)


class GenerationBatchesExhausted(RuntimeFailure):
    """A step drew ``run.filter_groups.max_num_gen_batches`` generation batches without keeping enough
    groups (verl raises here too): the CLI prints its one line; the checkpoints written stay resumable."""


@dataclass(frozen=True)
class FilterTally:
    """A step's dynamic sampling so far: generation batches drawn, groups generated and groups kept."""

    batches: int = 0
    generated: int = 0
    kept: int = 0

    def add(self, keep: torch.Tensor) -> FilterTally:
        """The tally after one more generation batch whose groups' ``keep`` mask (``kept_groups``) is given."""
        return FilterTally(self.batches + 1, self.generated + keep.numel(), self.kept + int(keep.sum()))

    @property
    def keep_rate(self) -> float:
        """Kept groups per generated group (verl's DAPO trainer keeps the surplus of the last batch out of
        training; it still counts as kept here: the rate the policy's groups carry a signal)."""
        return self.kept / self.generated if self.generated else 1.0

    def metrics(self) -> dict[str, float]:
        """verl's ``train/num_gen_batches`` and the keep-rate, per step."""
        return {"train/num_gen_batches": float(self.batches), "train/filter_groups_keep_rate": self.keep_rate,
                "train/filter_groups_kept": float(self.kept), "train/filter_groups_generated": float(self.generated)}


def needs_another_batch(tally: FilterTally, needed: int, limit: int | None) -> bool:
    """Whether the step generates another batch: fewer than ``needed`` groups kept and fewer than ``limit``
    batches drawn (None: no limit). Short of groups at the limit, raises ``GenerationBatchesExhausted``
    naming the key, as verl's DAPO trainer raises rather than training a short batch."""
    if tally.kept >= needed:
        return False
    if limit is None or tally.batches < limit:
        return True
    raise GenerationBatchesExhausted(
        f"run.filter_groups: {tally.batches} generation batches kept {tally.kept} of the {needed} groups a step "
        f"trains (keep-rate {tally.keep_rate:.0%}; every other group's responses all scored alike). Raise "
        "run.filter_groups.max_num_gen_batches (0: no limit), or give prompts the policy sometimes solves")


def trained_rows(keeps: list[torch.Tensor], group_size: int, needed: int) -> list[tuple[int, int]]:
    """The (generation batch, row) pairs a step trains: the rows of the first ``needed`` kept groups in
    generation order (verl trims the concatenated kept groups to the batch size), each batch's groups
    given by its ``keep`` mask."""
    out: list[tuple[int, int]] = []
    taken = 0
    for b, keep in enumerate(keeps):
        for g in torch.nonzero(keep).flatten().tolist():
            if taken == needed:
                return out
            out += [(b, g * group_size + i) for i in range(group_size)]
            taken += 1
    return out
