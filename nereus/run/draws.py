"""Which training prompts each step draws (seeded, so a resumed run draws what an uninterrupted one did)."""

from __future__ import annotations

import torch

from nereus.rl.data import Prompt
from nereus.run.setup import DYNAMIC_SAMPLING_PROMPTS, PROMPT_ORDER, SPARE_PROMPTS
from nereus.runtime.engines.sampling import derive_seed


class PromptDraws:
    """The draws from ``train``: ``per_step`` prompts a step, under the run's ``seed``."""

    def __init__(self, train: list[Prompt], per_step: int, seed: int) -> None:
        self.train, self.per_step, self.seed = train, per_step, seed

    def prompts(self, step: int) -> list[Prompt]:
        """The step's prompts: consecutive slices of a seeded permutation per epoch (so a resumed run
        draws the same prompts as an uninterrupted one)."""
        per = self.per_step
        out = []
        for i in range(step * per, (step + 1) * per):
            epoch, pos = divmod(i, len(self.train))
            order = torch.randperm(len(self.train), generator=torch.Generator().manual_seed(
                derive_seed(self.seed, PROMPT_ORDER, epoch)))
            out.append(self.train[int(order[pos])])
        return out

    def spare(self, step: int, n: int) -> list[Prompt]:
        """``n`` draws beyond the step's own (tail batching's over-launch), from a permutation of their own."""
        order = torch.randperm(len(self.train), generator=torch.Generator().manual_seed(
            derive_seed(self.seed, SPARE_PROMPTS, step)))
        return [self.train[int(order[i % len(self.train)])] for i in range(n)]

    def further(self, step: int, batch: int) -> list[Prompt]:
        """Generation batch ``batch`` >= 1 of step ``step`` under dynamic sampling (``run.filter_groups``):
        ``per_step`` more prompts from a permutation of their own (verl takes the dataloader's next batch;
        seeded by step and batch here, so a resumed run draws what an uninterrupted one did)."""
        order = torch.randperm(len(self.train), generator=torch.Generator().manual_seed(
            derive_seed(self.seed, DYNAMIC_SAMPLING_PROMPTS, step, batch)))
        return [self.train[int(order[i % len(self.train)])] for i in range(self.per_step)]
